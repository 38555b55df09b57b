"""StepKinds labels allocations by what is running: autograd's backward, module forwards and the
scopes the mechanism enters (megazero.utils.scopes), not by which source file allocates."""

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megazero.observe.step_kinds import KINDS, StepKinds
from megazero.utils import LiveMemoryTracker
from megazero.utils.scopes import scope

F32 = 4


class _Probe(nn.Module):
    """Records StepKinds' label of an allocation in its forward."""

    def __init__(self, kinds: StepKinds, seen: list) -> None:
        super().__init__()
        self.kinds, self.seen, self.w = kinds, seen, nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.kinds.kind_of("alloc"))
        return x * self.w


def test_labels_outside_forward_and_backward_come_from_scopes():
    kinds = StepKinds()
    with kinds:
        assert kinds.kind_of("alloc") == "other"
        assert kinds.kind_of("resize") == "gathered"
        with scope("zero.step"):
            assert kinds.kind_of("alloc") == "step"
            with scope("zero.reduce"):  # a bucket flushed by the step, outside backward: the step's
                assert kinds.kind_of("alloc") == "step"
        with scope("train.norms"):
            assert kinds.kind_of("alloc") == "step"
        with scope("zero.reduce"):  # reduce buckets are a backward kind
            assert kinds.kind_of("alloc") == "other"
        with scope("zero.gather"):
            assert kinds.kind_of("alloc") == "other"


def test_labels_in_forward_and_backward():
    kinds, seen, in_backward = StepKinds(), [], {}
    model = _Probe(kinds, seen)

    def hook(grad: torch.Tensor) -> torch.Tensor:  # what a gradient reducer does in backward
        in_backward["plain"] = kinds.kind_of("alloc")
        with scope("zero.reduce"):
            in_backward["reduce"] = kinds.kind_of("alloc")
        with scope("zero.step"):  # backward comes first: nothing in backward is the step's
            in_backward["step"] = kinds.kind_of("alloc")
        return grad

    model.w.register_hook(hook)
    with kinds:
        x = torch.randn(3, 4, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).sum().backward()  # forward, then recomputed in backward
        with scope("zero.reduce"):
            model(x)  # a module's forward inside any scope allocates activations
    assert seen == ["activations", "recomputed", "activations"]
    assert in_backward == {"plain": "backward", "reduce": "reduce buckets", "step": "backward"}
    assert kinds.handles == [] and kinds.depth == 0


def test_tracker_splits_a_step_by_scope():
    """Under LiveMemoryTracker: what a fake backward allocates inside ``zero.reduce`` is 'reduce
    buckets', what the step allocates inside ``zero.step`` is 'step', each to the byte."""
    w = nn.Parameter(torch.ones(256))
    buckets = []

    def reduce_in_backward(grad: torch.Tensor) -> torch.Tensor:
        with scope("zero.reduce"):
            buckets.append(torch.zeros(1000))  # a bucket kept until the step
        return grad

    w.register_hook(reduce_in_backward)
    kinds = StepKinds()
    with kinds, LiveMemoryTracker("cpu", kind_of=kinds.kind_of) as t:
        t.reset_peak(relabel="state")
        (w * 2.0).sum().backward()
        with scope("zero.step"):
            update = torch.zeros(500)
        live = t.live_by_kind
        del update, buckets[:]
    assert set(live) <= set(KINDS) | {"state"}
    assert live["reduce buckets"] == 1000 * F32
    assert live["step"] == 500 * F32
    assert live["backward"] >= 256 * F32  # w's gradient
