"""LiveMemoryTracker: exact live-byte figures for known allocations, autograd's saved
tensors, views, storages resized in place, pre-existing storages; and a GPT step."""

import contextlib
import time

import pytest
import torch
import torch.nn.functional as F

from megazero.training.meters import memory_mb
from megazero.utils import LiveMemoryTracker, active_tracker, peak_memory_source, step_peak_memory

F32 = 4


def test_new_tensors_views_and_frees_are_exact():
    with LiveMemoryTracker() as t:
        a = torch.empty(1000)
        assert t.current_bytes == 1000 * F32
        b = a[10:].view(10, 99)  # views: no new bytes, and they keep the storage alive
        del a
        assert t.current_bytes == 1000 * F32
        c = torch.zeros(250, dtype=torch.float64)
        assert t.current_bytes == 1000 * F32 + 250 * 8
        del b
        assert t.current_bytes == 250 * 8
        d = torch.tensor([1.0, 2.0, 3.0])  # built outside the dispatcher (aten::lift_fresh)
        c.add_(1.0)  # in place: nothing new
        assert t.current_bytes == 250 * 8 + 3 * F32
        del c, d
    assert t.current_bytes == 0 and t.peak_bytes == 1000 * F32 + 250 * 8
    assert t.absolute_peak_bytes == t.baseline_bytes + t.peak_bytes


def test_multi_output_operators_count_each_new_output_once():
    x = torch.randn(64, 32)
    with LiveMemoryTracker() as t:
        parts = x.split(16)  # four views of x
        assert t.current_bytes == 0
        values, indices = x.max(dim=1)  # two new tensors: fp32 values, int64 indices
        assert t.current_bytes == 64 * F32 + 64 * 8
        del parts, values, indices
    assert t.current_bytes == 0


def test_tensors_only_referenced_by_autograd_stay_counted_until_backward():
    x = torch.randn(256, requires_grad=True)
    with LiveMemoryTracker() as t:
        h = x * 2  # saved by sin() for backward
        out = h.sin()
        loss = out.sum()
        del h, out  # h now lives only in autograd's saved tensors; out is freed
        after_forward = t.mark("after_forward")
        assert after_forward.current_bytes == 256 * F32 + F32  # h + the scalar loss
        assert after_forward.peak_bytes == 2 * 256 * F32 + F32
        loss.backward()
        # The graph (and h) is gone; x.grad (new) and loss remain.
        assert t.current_bytes == 256 * F32 + F32
        # Backward holds grad*cos(h)'s operands: at least h, cos(h) and their product at once.
        assert t.peak_bytes >= 3 * 256 * F32
    assert t.marks["after_forward"] == after_forward


def test_storage_resized_to_zero_and_back_in_place():
    with LiveMemoryTracker() as t:
        flat = torch.empty(4096)  # a gathered parameter buffer
        weight = flat[:1024].view(32, 32)
        x = torch.randn(8, 32, requires_grad=True)
        y = F.linear(x, weight)  # autograd saves the view into flat
        base = t.current_bytes
        assert base == (4096 + 8 * 32 + 8 * 32) * F32
        flat.untyped_storage().resize_(0)  # FSDP/ZeRO-3's free: autograd's reference now costs nothing
        assert t.current_bytes == base - 4096 * F32
        other = torch.empty(100)
        assert t.current_bytes == base - 4096 * F32 + 100 * F32 and t.peak_bytes == base
        flat.untyped_storage().resize_(4096 * F32)  # regrown before reuse
        assert t.current_bytes == base + 100 * F32 == t.peak_bytes
        del flat, weight, y, x, other
    assert t.current_bytes == 0
    assert "resize_" not in torch.UntypedStorage.__dict__, "the resize hook must be removed at exit"


def test_pre_existing_storages_are_the_baseline():
    # Storages reachable from Python at entry are the baseline; their release and resizing count.
    old = torch.empty(2000)
    resized = torch.empty(500)
    w = torch.randn(16, 16, requires_grad=True)
    hidden = (w * 3).relu()  # relu saves its output: known to autograd, not to Python after del
    loss = (hidden * 1).sum()
    del hidden
    with LiveMemoryTracker() as t:
        baseline = t.baseline_bytes
        assert baseline >= (2000 + 500 + 256) * F32
        del old
        assert t.current_bytes == -2000 * F32
        resized.untyped_storage().resize_(0)
        assert t.current_bytes == -2500 * F32
        resized.untyped_storage().resize_(500 * F32)
        assert t.current_bytes == -2000 * F32 and t.peak_bytes == 0
        # Frees relu's saved output, which only autograd (C++) held at entry: neither its bytes
        # nor its release are counted. w.grad is new.
        loss.backward()
        assert t.baseline_bytes == baseline
        assert t.current_bytes == -2000 * F32 + 256 * F32
    assert w.grad is not None


def test_nested_trackers_count_independently_and_memory_mb_reads_the_innermost():
    with LiveMemoryTracker() as outer:
        a = torch.empty(1 << 18)  # 1 MiB
        assert peak_memory_source() == "tracked_peak_live" and active_tracker() is outer
        with LiveMemoryTracker() as inner:
            b = torch.empty(1 << 19)  # 2 MiB
            del b
            assert inner.peak_bytes == 2 << 20 and inner.current_bytes == 0
            peak = inner.absolute_peak_bytes
            assert memory_mb() == peak / 2 ** 20
            # the call restarted the inner tracker's peak window at the current bytes
            assert inner.absolute_peak_bytes == inner.absolute_current_bytes
            assert step_peak_memory(reset=False) == (inner.absolute_current_bytes, "tracked_peak_live")
        assert outer.current_bytes == 1 << 20 and outer.peak_bytes == 3 << 20
        del a
    assert active_tracker() is None and peak_memory_source() == "rss"
    value, source = step_peak_memory()
    assert source == "rss" and value > 1 << 20


def test_resize_is_wrapped_only_while_a_tracker_is_active():
    """Nothing of torch stays replaced after the last tracker exits: not after nested trackers,
    not after an exception inside, and a resize_ someone else set on UntypedStorage comes back."""
    original = torch.UntypedStorage.resize_
    assert "resize_" not in torch.UntypedStorage.__dict__
    with LiveMemoryTracker("cpu", scan_existing=False):
        assert torch.UntypedStorage.resize_ is not original
        with LiveMemoryTracker("meta", scan_existing=False):
            pass
        assert torch.UntypedStorage.resize_ is not original  # the outer tracker still needs it
    assert torch.UntypedStorage.resize_ is original and "resize_" not in torch.UntypedStorage.__dict__

    with pytest.raises(ValueError, match="inside"):
        with LiveMemoryTracker("cpu", scan_existing=False):
            with LiveMemoryTracker("meta", scan_existing=False):
                raise ValueError("inside")
    assert torch.UntypedStorage.resize_ is original and "resize_" not in torch.UntypedStorage.__dict__
    assert active_tracker() is None and torch.utils._python_dispatch._get_current_dispatch_mode() is None

    def theirs(storage, size):
        return original(storage, size)

    torch.UntypedStorage.resize_ = theirs
    try:
        with LiveMemoryTracker("cpu", scan_existing=False) as t:
            buf = torch.empty(100)
            buf.untyped_storage().resize_(0)
            assert t.current_bytes == 0  # the wrap calls theirs and still sees the resize
        assert torch.UntypedStorage.__dict__["resize_"] is theirs
    finally:
        del torch.UntypedStorage.resize_


def test_misuse_is_reported():
    t = LiveMemoryTracker()
    with pytest.raises(RuntimeError, match="enter the context"):
        t.peak_bytes
    with pytest.raises(ValueError, match="'cpu', 'meta' or 'cuda'"):
        LiveMemoryTracker("xpu")
    with t:
        with pytest.raises(RuntimeError, match="not reentrant"):
            t.__enter__()
    assert t.peak_bytes == 0  # figures stay readable after exit


def test_gpt_step_is_exact_and_overhead_is_printed():
    from megazero.model import GPTModel
    from tests.model.common import batch, tiny_config

    torch.set_num_threads(1)
    config = tiny_config("gpt", num_layers=2)
    torch.manual_seed(0)
    model = GPTModel(config)
    ids, labels = batch(config)

    def step():
        loss = model(ids, labels=labels).mean()
        loss.backward()

    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    after_forward = {}
    for recompute in (None, "full"):
        model.config.recompute_granularity = recompute
        model.zero_grad(set_to_none=True)
        with LiveMemoryTracker() as t:
            loss = model(ids, labels=labels).mean()
            fwd = t.mark("after_forward")
            loss.backward()
            del loss
        # Everything the step allocated is gone except the new gradients.
        assert t.current_bytes == grad_bytes
        assert t.peak_bytes > fwd.current_bytes > 0
        assert t.baseline_bytes >= grad_bytes  # the parameters (same sizes as their gradients)
        after_forward[recompute] = fwd.current_bytes
    assert after_forward["full"] < after_forward[None] / 4  # full recompute keeps only layer inputs
    model.config.recompute_granularity = None
    step()

    def per_step(ctx, n=10):
        with ctx:
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            return (time.perf_counter() - t0) / n

    plain = per_step(contextlib.nullcontext())
    t0 = time.perf_counter()
    tracked = per_step(LiveMemoryTracker())
    total = time.perf_counter() - t0
    print(f"\nGPT step (2 layers, h 64): {plain * 1e3:.2f} ms plain, {tracked * 1e3:.2f} ms tracked "
          f"({tracked / plain:.1f}x), tracker entry+exit {(total - 10 * tracked) * 1e3:.0f} ms; "
          f"peak {t.peak_bytes} B above {t.baseline_bytes} B")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reads_allocator_statistics():
    dev = torch.device("cuda")
    with LiveMemoryTracker(dev) as t:
        a = torch.empty(1 << 20, device=dev)  # 4 MiB: a multiple of the allocator's 512 B rounding
        a.untyped_storage().resize_(0)
        b = torch.empty(1 << 18, device=dev)
        assert t.current_bytes == 1 << 20
        del a, b
    assert t.peak_bytes == 4 << 20 and t.current_bytes == 0


def test_without_the_entry_scan_only_the_region_counts():
    old = torch.empty(2000)
    flat = torch.empty(300)
    with LiveMemoryTracker(scan_existing=False) as t:
        assert t.baseline_bytes == 0
        del old  # unknown to this tracker: its release is not counted either
        new = old_view = flat.view(3, 100)  # a view of an unknown storage is not an allocation
        assert t.current_bytes == 0
        flat.untyped_storage().resize_(0)  # a resize reveals the storage and its previous size
        assert t.baseline_bytes == 300 * F32 and t.current_bytes == -300 * F32
        # 3-d matmul returns mm's output through aten::_unsafe_view (no alias annotation): counted once.
        new = torch.ones(2, 3, 10) @ torch.ones(10, 7)
        assert t.current_bytes == -300 * F32 + 2 * 3 * 7 * F32
        del new, old_view


def test_meta_storages_with_kinds_and_where_the_peak_was():
    """On the meta device (no memory, storages of the right size) with labels: the peak split by
    the label each storage was allocated (or resized) under, and ``where()`` of the last rise."""
    phase = ["forward"]
    before = torch.empty(100, device="meta")  # made before entry: not scanned
    with LiveMemoryTracker("meta", scan_existing=False, kind_of=lambda event: "grown" if event == "resize"
                           else phase[0], where=lambda: phase[0]) as t:
        a = torch.empty(1000, device="meta")
        torch.empty(10)  # CPU: another device, not counted
        phase[0] = "backward"
        b = a * 2
        assert t.current_bytes == 2 * 1000 * F32 and t.live_by_kind == {"forward": 4000, "backward": 4000}
        del a
        t.reset_peak(relabel="state")
        assert t.peak_by_kind == {"state": 4000} and t.peak_where is None
        phase[0] = "step"
        buf = torch.empty(500, device="meta")
        buf.untyped_storage().resize_(0)  # released in place (as ZeRO-3 does), then regrown
        buf.untyped_storage().resize_(3000 * F32)
        assert t.absolute_peak_bytes == 4000 + 12000 and t.peak_by_kind == {"state": 4000, "grown": 12000}
        assert t.peak_where == "step"
        del buf, b
    assert t.current_bytes == 0 and t.live_by_kind == {} and t.peak_by_kind == {"state": 4000, "grown": 12000}
    del before
