"""What a live tensor of a training step is, told by what was running when it was allocated.

A labeller for :class:`megazero.utils.memory_tracker.LiveMemoryTracker` (``kind_of=``), so a step's
peak splits into the kinds a ZeRO engineer reasons about. Used by the rehearsal
(``tools/rehearse.py``) and by ``benchmarks/bench_zero_memory.py``. What is running is read from
autograd (is backward running), module forward hooks (is a module's forward running) and the
scopes the mechanism enters (:mod:`megazero.utils.scopes`), never from source file names:

=================  ===============================================================================
``gathered``       a storage grown in place: ZeRO-3's (and FSDP2's) gathered parameters
``activations``    allocated inside a module's forward (saved for backward or temporaries)
``recomputed``     allocated inside a module's forward run by autograd's backward (recompute)
``reduce buckets`` allocated in backward inside a ``zero.reduce`` scope: the buckets of
                   full-size gradients being reduce-scattered
``backward``       other allocations of autograd's backward: parameter gradients, input
                   gradients and the backward kernels' temporaries
``step``           allocated outside forward and backward inside a step scope (``zero.step``: the
                   engine's gradient partitions' temporaries, the norm, the update; ``train.norms``:
                   the statistics the log line reads)
``other``          anything else (the loss outside a module, the data, the framework's own)
=================  ===============================================================================

Engines that enter no megazero scope (FSDP2) get the labels that need none (``gathered``,
``activations``, ``recomputed``, ``backward``, ``other``): their reduce-scatter buffers count as
``backward`` and their optimizer step as ``other``.

``state`` is not a label of this class: a tracker's ``reset_peak(relabel="state")`` gives it to
what is alive when the measured step begins.
"""

from __future__ import annotations

from typing import Any

import torch

from megazero.utils.scopes import current_scopes

__all__ = ["StepKinds", "KINDS", "REDUCE_SCOPES", "STEP_SCOPES"]

KINDS = ("gathered", "activations", "recomputed", "reduce buckets", "backward", "step", "other")
# Scopes whose allocations in backward are "reduce buckets", and outside forward and backward "step".
REDUCE_SCOPES = frozenset({"zero.reduce"})
STEP_SCOPES = frozenset({"zero.step", "train.norms"})


def _inside(names: frozenset) -> bool:
    return any(s in names for s in current_scopes())


class StepKinds:
    """Context manager with :meth:`kind_of`: while entered, global module forward hooks keep the
    depth of module forwards running (the hooks are removed on exit, also after an exception)."""

    def __init__(self) -> None:
        self.depth = 0
        self.handles: list = []

    def __enter__(self) -> "StepKinds":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self._enter),
                        register_module_forward_hook(self._leave, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, out) -> None:
        self.depth -= 1

    def kind_of(self, event: str) -> str:
        """The label of a storage allocated (``event='alloc'``) or grown in place (``'resize'``) now."""
        if event == "resize":
            return "gathered"
        if torch._C._current_graph_task_id() != -1:  # autograd's backward is running
            if self.depth > 0:
                return "recomputed"
            return "reduce buckets" if _inside(REDUCE_SCOPES) else "backward"
        if self.depth > 0:
            return "activations"
        return "step" if _inside(STEP_SCOPES) else "other"
