"""Units: the parameters that ZeRO gathers, releases and reduces together.

A unit is either one *layer* (by default every child of every outermost
``nn.ModuleList``: the transformer layers) or one *piece* outside the layers:
the parameters owned directly by the same set of modules (the embedding, the
final norm, an untied output layer each make one piece; a weight owned by two
modules, or by a layer and a module outside it, makes a piece of its own, so it
is gathered wherever either module runs). Parameters below
``stage3_param_persistence_threshold`` elements form the *persistent* unit,
which ZeRO-3 never releases.

Units have a *static order*: the position of their first owning module in
``model.modules()``, which is the same on every rank. Collectives follow it, so
ranks that execute different subsets of the model still issue the same
collectives in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .flat import FlatGroup
from .partitioning import PartitionFn, Partitioning

__all__ = ["Unit", "PlannedUnit", "UnitPlan", "build_units", "find_unit_modules", "plan_units", "units_for_call"]


class Unit:
    """A named set of flat groups that are gathered, released and reduced together."""

    def __init__(self, name: str, groups: list[FlatGroup], position: int) -> None:
        self.name = name
        self.groups = groups
        for g in groups:
            g.unit = self
        self.position = position  # static order (see the module docstring)
        self.pending: list = []  # async all-gather works in flight
        self.released_groups = [g for g in groups if not g.resident]  # what ZeRO-3 gathers and releases
        self.grads_expected = sum(1 for g in groups if g.trainable for s in g.slots)
        self.grads_seen = 0  # gradients complete in this backward (reducer.py)
        # ZeRO-3's gather window (window.py): position among the gathered units; modules running
        # that hold it; wrapped inputs whose backward has not run; issued in this pass's order;
        # index of its last entry in this forward's trace.
        self.index = -1
        self.active = 0
        self.after_backward = 0
        self.issued = False
        self.last_entry: Optional[int] = None

    @property
    def resident(self) -> bool:
        return all(g.resident for g in self.groups)

    @property
    def gathered(self) -> bool:
        return all(g.gathered for g in self.groups)

    @property
    def trainable_groups(self) -> list[FlatGroup]:
        return [g for g in self.groups if g.trainable]

    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    def drop_grads(self) -> None:
        """Forget the gradients autograd left on the unit's parameters (a unit no rank reduces)."""
        for g in self.trainable_groups:
            for s in g.slots:
                s.param.grad = None

    # ---- gather / release (ZeRO-3's window decides when) ---------------------------------

    def start_gather(self, all_gather: Callable, source: Callable[[FlatGroup], torch.Tensor]) -> None:
        """All-gather every released group (:meth:`FlatGroup.start_gather`); works in flight go to ``pending``."""
        for g in self.released_groups:
            work = g.start_gather(all_gather, source)
            if work is not None:
                self.pending.append(work)

    def finish_gather(self) -> list[FlatGroup]:
        """Wait for the all-gathers in flight and mark the groups whole; returns the groups gathered."""
        self._wait_pending()
        for g in self.released_groups:
            g.gathered = True
        return self.released_groups

    def release(self) -> list[FlatGroup]:
        """Free the gathered groups' storage (after any all-gather in flight); returns them."""
        self._wait_pending()
        for g in self.released_groups:
            g.release()
        return self.released_groups

    def _wait_pending(self) -> None:
        if self.pending:
            for w in self.pending:
                w.wait()
            self.pending = []

    def full_bytes(self) -> int:
        return sum(g.full_bytes for g in self.released_groups)

    def __repr__(self) -> str:
        return f"Unit({self.name}, {self.numel()} elements)"


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


@dataclasses.dataclass
class PlannedUnit:
    """One unit before any buffer exists."""

    name: str
    position: int  # static order (see the module docstring)
    params: list[tuple[str, torch.nn.Parameter]]  # (name in the model, parameter)
    persistent: bool  # ZeRO-3's small parameters: never released


@dataclasses.dataclass
class UnitPlan:
    """Which parameters go together, before any buffer exists."""

    units: list[PlannedUnit]  # in static order
    # module -> names of the units whose parameters it owns (what its forward needs gathered)
    needs: dict[torch.nn.Module, list[str]]
    hooked: list[torch.nn.Module]  # modules that get gather hooks: layers and every module outside them
    in_layer: frozenset[torch.nn.Parameter] = frozenset()  # the parameters inside a layer module

    def unit_needs(self, units: list["Unit"]) -> dict[torch.nn.Module, list["Unit"]]:
        """``needs`` with the built units in place of their names."""
        by_name = {u.name: u for u in units}
        return {m: [by_name[n] for n in names] for m, names in self.needs.items()}


def plan_units(model: torch.nn.Module, layer_modules: list[torch.nn.Module], persistence_threshold: int) -> UnitPlan:
    """Assign every parameter to a unit (see the module docstring)."""
    order = {m: i for i, m in enumerate(model.modules())}
    layers = set(layer_modules)
    inside_layer = {m for layer in layer_modules for m in layer.modules()}
    owners: dict[torch.nn.Parameter, set[torch.nn.Module]] = {}  # layers, or direct owners outside layers
    for layer in layer_modules:
        for p in layer.parameters():
            owners.setdefault(p, set()).add(layer)
    in_layer = frozenset(owners)  # the parameters inside a layer module
    for m in model.modules():
        if m not in inside_layer:
            for p in m.parameters(recurse=False):
                owners.setdefault(p, set()).add(m)

    persistent: list[tuple[str, torch.nn.Parameter]] = []
    by_owner_set: dict[frozenset[torch.nn.Module], list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in model.named_parameters():  # named_parameters() yields each shared parameter once
        if persistence_threshold >= 0 and p.numel() <= persistence_threshold:
            persistent.append((name, p))
        else:
            by_owner_set.setdefault(frozenset(owners[p]), []).append((name, p))

    units = []
    needs: dict[torch.nn.Module, list[str]] = {}
    for owner_set, members in by_owner_set.items():
        first = min(owner_set, key=order.__getitem__)
        if len(owner_set) == 1 and first in layers:
            name = f"layer{layer_modules.index(first)}"
        else:
            name = "+".join(_module_name(model, o) for o in sorted(owner_set, key=order.__getitem__))
        units.append(PlannedUnit(name, order[first], members, False))
        for o in owner_set:
            needs.setdefault(o, []).append(name)
    units.sort(key=lambda u: u.position)
    if persistent:
        units.append(PlannedUnit("persistent", len(order), persistent, True))
    hooked = [m for m in model.modules() if m in layers or m not in inside_layer]
    return UnitPlan(units, needs, hooked, in_layer)


def build_units(plan: UnitPlan, *, stage: int, no_decay: Callable[[str, torch.nn.Parameter], bool],
                partitioning: Optional[PartitionFn], default: Partitioning, param_name: Callable[[str], str],
                compute_dtype: torch.dtype, device: torch.device,
                per_matrix: Optional[Callable[[str, torch.nn.Parameter, bool], bool]] = None
                ) -> tuple[list[Unit], list[Partitioning]]:
    """The units of ``plan`` with their flat groups (no buffers yet), and the partitionings in use.

    A unit's parameters are split by partitioning (``partitioning(name, param)``, None meaning
    ``default``) and then by optimizer class: updated per matrix (``per_matrix(name, param,
    inside_a_layer)``, a per-matrix optimizer's choice) or elementwise, decayed or undecayed
    (``no_decay``), frozen. Groups are
    partitioned from stage 1 on and resident (always whole) below stage 3 and for persistent units;
    ``param_name`` gives the name a slot is known by (a pipeline stage's whole-model names).
    """
    parts: dict[str, Partitioning] = {default.name: default}
    units = []
    for planned in plan.units:
        by_part: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for n, p in planned.params:
            part = (partitioning(n, p) if partitioning is not None else None) or default
            if parts.setdefault(part.name, part) is not part:
                raise ValueError(f"two partitionings are named {part.name!r}; give each process group its own name")
            by_part.setdefault(part.name, []).append((n, p))
        groups = []
        matrix = {p for n, p in planned.params
                  if p.requires_grad and per_matrix is not None and per_matrix(n, p, p in plan.in_layer)}
        for name, params in by_part.items():
            for trainable, decay, whole in ((True, True, True), (True, True, False), (True, False, True),
                                            (True, False, False), (False, False, False)):
                chosen = [(param_name(n), p) for n, p in params
                          if p.requires_grad == trainable and (not trainable or no_decay(n, p) != decay)
                          and (p in matrix) == whole]
                if chosen:
                    groups.append(FlatGroup(chosen, part=parts[name], partitioned=stage > 0,
                                            compute_dtype=compute_dtype, device=device,
                                            resident=stage < 3 or planned.persistent,
                                            weight_decay=trainable and decay, trainable=trainable,
                                            per_matrix=whole))
        units.append(Unit(planned.name, groups, planned.position))
    return units, list(parts.values())


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name or "root"
    return type(module).__name__


def units_for_call(needs: dict[torch.nn.Module, list[Unit]], unit_of_param: dict[torch.nn.Parameter, Unit],
                   module: torch.nn.Module, args: tuple, kwargs: dict) -> list[Unit]:
    """The units a call of ``module`` needs: those owning its parameters, and those of any
    ZeRO parameter passed to it (a tied output layer receives the embedding's weight)."""
    units = list(needs.get(module, ()))
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.nn.Parameter):
            u = unit_of_param.get(a)
            if u is not None and u not in units:
                units.append(u)
    return units
