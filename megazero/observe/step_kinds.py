"""What a live tensor of a training step is, told by what was running when it was allocated.

A labeller for :class:`megazero.utils.memory_tracker.LiveMemoryTracker` (``kind_of=``), so a step's
peak splits into the kinds a ZeRO engineer reasons about. Used by the rehearsal
(``tools/rehearse.py``) and by ``benchmarks/bench_zero_memory.py`` for megazero and FSDP2 alike
(nothing here knows either engine beyond file names):

=================  ===============================================================================
``gathered``       a storage grown in place: ZeRO-3's (and FSDP2's) gathered parameters
``activations``    allocated inside a module's forward (saved for backward or temporaries)
``recomputed``     allocated inside a module's forward run by autograd's backward (recompute)
``reduce buckets`` allocated in backward by megazero's gradient reducer (``zero/reducer.py``,
                   ``zero/flat.py``): the buckets of full-size gradients being reduce-scattered
``backward``       other allocations of autograd's backward: parameter gradients, input
                   gradients and the backward kernels' temporaries
``step``           allocated outside forward and backward by the ZeRO engine, its optimizer, loss
                   scaler or norms (gradient partitions' temporaries, the norm, the update)
``other``          anything else (the loss outside a module, the data, the framework's own)
=================  ===============================================================================

``state`` is not a label of this class: a tracker's ``reset_peak(relabel="state")`` gives it to
what is alive when the measured step begins.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

__all__ = ["StepKinds", "KINDS"]

KINDS = ("gathered", "activations", "recomputed", "reduce buckets", "backward", "step", "other")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REDUCER_FILES = ("zero/reducer.py", "zero/flat.py")
_STEP_FILES = ("zero/engine.py", "zero/offload.py", "zero/loss_scaler.py", "zero/optim.py", "training/norms.py",
               "training/step.py")
_MEASURING = ("observe/step_kinds.py", "utils/memory_tracker.py", "utils/meta_device.py")


def _megazero_file() -> str:
    """The innermost megazero source file running (relative to the package), or ''."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_PACKAGE):
            rel = os.path.relpath(path, _PACKAGE).replace(os.sep, "/")
            if rel not in _MEASURING:
                return rel
        f = f.f_back
    return ""


class StepKinds:
    """Context manager (module forward hooks for the nesting depth) with :meth:`kind_of`."""

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
            return "reduce buckets" if _megazero_file() in _REDUCER_FILES else "backward"
        if self.depth > 0:
            return "activations"
        return "step" if _megazero_file() in _STEP_FILES else "other"
