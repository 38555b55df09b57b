"""Units: the parameters that ZeRO-3 gathers and releases together.

A unit is one module that runs as a block (by default every child of every
top-level ``nn.ModuleList``: the transformer layers), plus a *root* unit for
all remaining parameters (embeddings, final norm, output layer) and a
*persistent* unit for parameters below ``stage3_param_persistence_threshold``
elements, which are never released. A parameter shared by modules of two
units (tied weights) goes to the root unit, so it is gathered once and its
gradient reduced once.

:class:`Stage3Coordinator` installs the hooks that make a unit whole before
its forward and backward, prefetch the next one asynchronously, and release it
again when its gradients have left.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from .flat import FlatGroup

__all__ = ["Unit", "find_unit_modules", "Stage3Coordinator"]


class Unit:
    """A named set of flat groups that are gathered and released together."""

    def __init__(self, name: str, groups: list[FlatGroup]) -> None:
        self.name = name
        self.groups = groups
        self.pending: list = []  # async all-gather works in flight
        self.gathered = all(g.resident for g in groups)
        self.grads_expected = sum(1 for g in groups for s in g.slots if s.param.requires_grad)
        self.grads_seen = 0
        self.reduced = False
        self.used = False

    @property
    def resident(self) -> bool:
        return all(g.resident for g in self.groups)

    def numel(self) -> int:
        return sum(g.numel for g in self.groups)


def find_unit_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Children of the outermost ``nn.ModuleList``s, in registration (= forward) order."""
    units: list[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            if isinstance(child, torch.nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(model)
    return units


class Stage3Coordinator:
    """Gathers units on demand (with one-ahead prefetch) and releases them after use."""

    def __init__(
        self,
        model: torch.nn.Module,
        units: list[Unit],
        unit_modules: list[torch.nn.Module],
        root: Optional[Unit],
        gather: Callable[[Unit, bool], None],
        on_grads_ready: Callable[[Unit], None],
        in_backward: Callable[[], bool],
    ) -> None:
        self.units, self.root = units, root
        self.gather, self.on_grads_ready, self.in_backward = gather, on_grads_ready, in_backward
        self.handles = []
        index = {id(m): i for i, m in enumerate(unit_modules)}
        for m in unit_modules:
            i = index[id(m)]
            self.handles.append(m.register_forward_pre_hook(self._pre_forward(i)))
            self.handles.append(m.register_forward_hook(self._post_forward(i)))
        self.handles.append(model.register_forward_pre_hook(self._model_pre_forward))
        self.handles.append(model.register_forward_hook(self._model_post_forward))

    # ---- helpers -------------------------------------------------------------------------

    def _ensure(self, unit: Unit) -> None:
        unit.used = True
        self.gather(unit, False)

    def _prefetch(self, i: int) -> None:
        if 0 <= i < len(self.units) and not self.units[i].gathered and not self.units[i].pending:
            self.gather(self.units[i], True)

    @staticmethod
    def _tensors(out) -> Iterable[torch.Tensor]:
        if isinstance(out, torch.Tensor):
            yield out
        elif isinstance(out, (tuple, list)):
            for o in out:
                yield from Stage3Coordinator._tensors(o)
        elif isinstance(out, dict):
            for o in out.values():
                yield from Stage3Coordinator._tensors(o)

    # ---- hooks --------------------------------------------------------------------------

    def _model_pre_forward(self, module, args):
        if self.root is not None:
            self._ensure(self.root)
        self._prefetch(0)

    def _model_post_forward(self, module, args, out):
        # The root (embeddings, final norm, tied head) is released between forward and
        # backward like every other unit, and gathered again when backward starts.
        if self.root is not None and not self.in_backward():
            self._register_pre_backward(out, self.root, len(self.units) - 1)
            release(self.root)

    def _register_pre_backward(self, out, unit: Unit, prefetch: int) -> None:
        if not torch.is_grad_enabled():
            return
        fired = [False]

        def pre_backward(grad):
            if not fired[0]:
                fired[0] = True
                self._ensure(unit)
                self._prefetch(prefetch)
            return grad

        for t in self._tensors(out):
            if t.requires_grad:
                t.register_hook(pre_backward)

    def _pre_forward(self, i: int):
        def hook(module, args):
            self._ensure(self.units[i])
            # A forward inside backward is a recomputation: the next unit needed is the previous one.
            self._prefetch(i - 1 if self.in_backward() else i + 1)

        return hook

    def _post_forward(self, i: int):
        def hook(module, args, out):
            unit = self.units[i]
            if self.in_backward():
                return  # recomputation inside backward: its backward follows at once
            self._register_pre_backward(out, unit, i - 1)
            release(unit)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def release(unit: Unit) -> None:
    """Free a unit's full buffers (no-op for resident units)."""
    for w in unit.pending:
        w.wait()
    unit.pending = []
    if unit.resident:
        return
    for g in unit.groups:
        g.release()
    unit.gathered = False
