"""The ZeRO-3 gather window: which units are whole, when, and why nothing else keeps them alive.

Forward. Every hooked module (each layer, and every module outside the layers)
asks, in its forward pre-hook, for the units it needs: the ones owning its
parameters plus those of any ZeRO parameter passed to it as an argument (a
tied output layer receives the embedding's weight). Units are all-gathered in
their static order (see ``units.py``); asking for unit k first gathers, and at
once releases, any unit before k this rank skipped, so ranks that run
different layers still issue the same all-gathers in the same order. Up to
``prefetch_numel`` elements ahead are all-gathered asynchronously (None: the next
unit, as FSDP2 prefetches), never more than ``max_live_numel`` gathered at once
(None: no cap). A unit is released as soon as the module that asked for it has run.

Parameters read as attributes. A module may use a parameter it neither owns nor
receives (``F.linear(x, self.embedding.weight)`` in a model's own forward).
Every module's parameter dict is replaced by one that gathers the parameter's
unit on access during forward or backward (DeepSpeed's ZeRO-3 does the same),
and the unit is released when the module running at that moment finishes.

Saved for backward. While the model runs forward, a saved-tensor hook notes
which units' storage autograd saves (the weights of linear layers and norms).
Those references cost nothing once the unit is released (its storage is empty,
see ``flat.py``); unpacking one in backward is what gathers the unit again.
The trace of forward requests, with a flag for "saved something", agreed over
DP (``agreement.py``), fixes the backward gather order for every rank: the
reversed trace, keeping the entries some rank needs.
A unit gathered in backward is released when the backward of the module that
used it has finished (an identity autograd function on the module's inputs).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..utils.scopes import scope
from .agreement import ForwardAgreement, all_reduce_sum, install_usage_hooks
from .comm import grads_channel
from .flat import FlatGroup, storage_key
from .units import Unit, UnitPlan, units_for_call

__all__ = ["GatherWindow", "track_forwards", "refuse_differing_forwards"]


class _Saved:
    """A saved tensor that lives in a ZeRO-3 unit's storage."""

    __slots__ = ("tensor", "unit")

    def __init__(self, tensor: torch.Tensor, unit: Unit) -> None:
        self.tensor, self.unit = tensor, unit


class _AfterBackward(torch.autograd.Function):
    """Identity whose backward runs once the module it wraps has computed its input gradients."""

    @staticmethod
    def forward(ctx, callback, *xs):
        ctx.callback = callback
        return xs if len(xs) > 1 else xs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


class _GatheringDict(dict):
    """A module's ``_parameters`` that tells the window whenever a ZeRO parameter is read: the unit
    holding it, found by the parameter's name in this module (a lookup by the tensor would run
    ``Tensor.__hash__``, Python, at every read of every parameter in forward and backward)."""

    def __init__(self, params: dict, units: dict[str, Unit], on_access: Callable[[Unit], None]) -> None:
        super().__init__(params)
        self.units, self.on_access = units, on_access

    def __getitem__(self, key):
        p = super().__getitem__(key)
        unit = self.units.get(key)
        if unit is not None:
            self.on_access(unit)
        return p


class _Entry:
    __slots__ = ("unit", "saved")

    def __init__(self, unit: Unit, saved: bool) -> None:
        self.unit, self.saved = unit, saved


class GatherWindow:
    """Hooks a model so that ZeRO-3 units are gathered only while they are used."""

    def __init__(
        self,
        model: torch.nn.Module,
        units: list[Unit],
        needs: dict[torch.nn.Module, list[Unit]],
        hooked: list[torch.nn.Module],
        unit_of_param: dict[torch.nn.Parameter, Unit],
        *,
        all_gather: Callable[[torch.Tensor, torch.Tensor, FlatGroup], object],
        in_backward: Callable[[], bool],
        on_forward_begin: Callable[[tuple, dict], None],
        on_forward_end: Callable[[list, object], None],
        mark_used: Callable[[Unit], None],
        prefetch_numel: Optional[int],
        max_live_numel: Optional[int],
        hold: bool = False,
        source: Optional[Callable[[FlatGroup], torch.Tensor]] = None,
    ) -> None:
        # source(g): what g's all-gather sends, g's own slice of the full buffer filled with its
        # partition (the gather then runs in place); the parameter offload fills it from the host or NVMe.
        self.source = source or FlatGroup.fill_own_slice
        self.units = [u for u in units if not u.resident]
        for i, u in enumerate(self.units):
            u.index = i
        self.needs, self.unit_of_param = needs, unit_of_param
        self.all_gather, self.in_backward = all_gather, in_backward
        self.on_forward_begin, self.on_forward_end, self.mark_used = on_forward_begin, on_forward_end, mark_used
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel if max_live_numel is not None else float("inf")
        # hold: units stay gathered until the engine's step releases them (stage3_keep_gathered_in_step)
        self.hold = hold
        self.by_storage: dict[int, Unit] = {}  # storage_key of a gathered group's full buffer -> its unit
        self.live_numel = 0
        self.depth = 0  # nesting of the model's own forward
        self._reset_pass()
        self._root_units = list(needs.get(model, ()))
        self.handles = []
        for m in hooked:
            if m is model:
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post_forward, always_call=True))
        self.handles.append(model.register_forward_pre_hook(self._model_pre_forward, with_kwargs=True))
        self.handles.append(model.register_forward_hook(self._model_post_forward, always_call=True))
        self._saved_hooks = None
        self._module_units: dict[torch.nn.Module, list[Unit]] = {}  # units each running module holds
        self.running: list[torch.nn.Module] = []  # hooked modules whose forward is in progress (innermost last)
        self._model = model
        for m in model.modules():
            if m._parameters and not isinstance(m._parameters, _GatheringDict):
                units = {name: unit_of_param[p] for name, p in m._parameters.items() if p in unit_of_param}
                m._parameters = _GatheringDict(m._parameters, units, self._on_access)

    def _reset_pass(self) -> None:
        self.cursor = -1  # forward: position in self.units of the last unit passed
        self.trace: list[_Entry] = []
        self.sequence: Optional[list[Unit]] = None  # backward gather order, once agreed
        self.bcursor = -1
        for u in self.units:  # their window state (units.py) starts afresh with each forward
            u.last_entry, u.issued = None, False

    # ---- gather / release ---------------------------------------------------------------

    def issue(self, unit: Unit) -> None:
        """Start the all-gather of ``unit`` unless it is whole or on its way."""
        if unit.gathered or unit.pending:
            return
        with scope("zero.gather"):
            unit.start_gather(self.all_gather, self.source)  # each group over its own partitioning
        self.live_numel += unit.numel()
        if not unit.pending:
            self._complete(unit)

    def wait(self, unit: Unit) -> None:
        if not (unit.gathered or unit.pending):
            self.issue(unit)
        if unit.pending:
            self._complete(unit)

    def _complete(self, unit: Unit) -> None:
        for g in unit.finish_gather():
            self.by_storage[g.storage_key()] = unit

    def release(self, unit: Unit, force: bool = False) -> None:
        if unit.resident or not (unit.gathered or unit.pending) or (self.hold and not force):
            return
        for g in unit.release():
            self.by_storage.pop(g.storage_key(), None)  # (a storage's key survives its release)
        self.live_numel -= unit.numel()

    def release_all(self, force: bool = False) -> None:
        for u in self.units:
            self.release(u, force)
            u.active = 0

    def end_step(self) -> None:
        """The optimizer step is over: units kept gathered for it (``hold``) are released."""
        if self.hold:
            self.release_all(force=True)

    def end_backward(self) -> None:
        """Everything is released between a backward and the next forward."""
        self.release_all()
        for u in self.units:
            u.after_backward = 0

    def _prefetch(self, seq: list[Unit], start: int) -> None:
        """Issue the next units of ``seq`` within the window. A unit already issued in this
        pass is never issued again here: every rank must issue the same gathers."""
        budget = self.prefetch_numel
        if budget is None:  # the next unit that is gathered at all
            budget = next((u.numel() for u in seq[start:] if not u.resident), 0)
        for q in range(start, len(seq)):
            if budget <= 0:
                break
            u = seq[q]
            if u.resident:  # always whole: neither gathered nor counted
                continue
            if not u.issued:
                if self.live_numel + u.numel() > self.max_live_numel:
                    break
                self._issue_once(u)
            budget -= u.numel()

    def _issue_once(self, unit: Unit) -> None:
        unit.issued = True
        self.issue(unit)

    # ---- forward ------------------------------------------------------------------------

    def _model_pre_forward(self, module, args, kwargs):
        if self.in_backward():
            return
        self.depth += 1
        if self.depth > 1:
            return
        self.release_all()
        self._reset_pass()
        self.on_forward_begin(args, kwargs)
        if torch.is_grad_enabled():
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        self._prefetch(self.units, 0)
        self._module_units[self._model] = []
        for u in self._root_units:  # parameters owned by the model object itself
            self.mark_used(u)
            if not u.resident:
                self._request_forward(u, saved=not torch.is_grad_enabled())
                u.active += 1

    def _model_post_forward(self, module, args, out):
        if self.in_backward():
            return
        self.depth -= 1
        if self.depth > 0:
            return
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        for u in self._module_units.pop(self._model, []) + [u for u in self._root_units if not u.resident]:
            u.active -= 1
        self._catch_up(len(self.units))
        for u in self.units:
            if not u.active:
                self.release(u)
        self.on_forward_end(self.trace, out)

    def _pre_forward(self, module, args, kwargs):
        units = units_for_call(self.needs, self.unit_of_param, module, args, kwargs)
        if not units:
            self._module_units[module] = []
            self.running.append(module)
            return None
        for u in units:
            self.mark_used(u)
        backward = self.in_backward()
        pending = [u for u in units if not u.resident]
        for u in pending:
            if backward:
                self._request_backward(u)
            else:
                self._request_forward(u, saved=not torch.is_grad_enabled())
            u.active += 1
        self._module_units[module] = pending
        self.running.append(module)
        if pending and torch.is_grad_enabled():
            return self._wrap_inputs(args, kwargs, pending)
        return None

    def _post_forward(self, module, args, out):
        if self.running and self.running[-1] is module:
            self.running.pop()
        pending = self._module_units.pop(module, [])
        for u in pending:
            u.active -= 1
            if not u.active and not self.in_backward():
                # Done with it; autograd's saved references to it become free with the storage.
                self.release(u)
        return None

    def _on_access(self, unit: Unit) -> None:
        """A parameter of ``unit`` read during forward or backward: make sure the unit is whole."""
        if self.depth <= 0 and not self.in_backward():
            return
        if unit.resident:
            return
        if unit.gathered and not unit.pending:
            return
        owner = self.running[-1] if self.running else self._model
        if self.in_backward():
            self._request_backward(unit)
        else:
            self._request_forward(unit, saved=not torch.is_grad_enabled())
        held = self._module_units.setdefault(owner, [])
        if unit not in held:
            held.append(unit)
            unit.active += 1

    def _request_forward(self, unit: Unit, saved: bool) -> None:
        pos = unit.index
        if pos > self.cursor:
            self._catch_up(pos)
            self.cursor = pos
            self._record(unit, saved)
            if not unit.issued:
                self._issue_once(unit)
            self.wait(unit)
            self._prefetch(self.units, pos + 1)
        else:  # used again out of order (a tied weight): every rank does the same
            self._record(unit, saved)
            self.wait(unit)

    def _catch_up(self, pos: int) -> None:
        """Gather (and drop) the units before ``pos`` that this rank skipped, so that all-gathers pair up."""
        for q in range(self.cursor + 1, pos):
            u = self.units[q]
            self._record(u, False)
            if not u.issued:
                self._issue_once(u)
            self.wait(u)
            if not u.active:
                self.release(u)
        self.cursor = max(self.cursor, pos - 1)

    def _record(self, unit: Unit, saved: bool) -> None:
        unit.last_entry = len(self.trace)
        self.trace.append(_Entry(unit, saved))

    def _wrap_inputs(self, args, kwargs, units: list[Unit]):
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx:
            return None
        for u in units:
            u.after_backward += 1

        def done():
            for u in units:
                u.after_backward -= 1
                if u.after_backward <= 0 and not u.active:
                    self.release(u)

        wrapped = _AfterBackward.apply(done, *[args[i] for i in idx])
        if len(idx) == 1:
            wrapped = (wrapped,)
        new = list(args)
        for i, w in zip(idx, wrapped):
            new[i] = w
        return tuple(new), kwargs

    # ---- saved tensors --------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if not self.by_storage:
            return t
        unit = self.by_storage.get(storage_key(t))
        if unit is None:
            return t
        if not self.in_backward():
            entry = unit.last_entry
            if entry is not None:
                self.trace[entry].saved = True
        return _Saved(t, unit)

    def _unpack(self, saved):
        if isinstance(saved, _Saved):
            if not saved.unit.gathered:
                self._request_backward(saved.unit)
            return saved.tensor
        return saved

    # ---- backward -----------------------------------------------------------------------

    def begin_backward(self, trace: list, saved: list[bool]) -> None:
        """The backward of the forward that recorded ``trace``, with the agreed "saved something"
        flag of each entry (``agreement.py``): fixes the order of the backward's gathers."""
        self.trace = trace
        seq: list[Unit] = []
        for entry, flag in zip(reversed(trace), reversed(saved)):
            if flag and entry.unit not in seq:
                seq.append(entry.unit)
        self.sequence, self.bcursor = seq, -1
        for u in self.units:
            u.issued = False

    def _request_backward(self, unit: Unit) -> None:
        seq = self.sequence or []
        for j in range(self.bcursor + 1, len(seq)):
            if seq[j] is unit:
                for q in range(self.bcursor + 1, j):  # needed by another rank before this one
                    u = seq[q]
                    if not u.issued:
                        self._issue_once(u)
                    self.wait(u)
                    if not u.active and not u.after_backward:
                        self.release(u)
                self.bcursor = j
                if not unit.issued:
                    self._issue_once(unit)
                self.wait(unit)
                self._prefetch(seq, j + 1)
                return
        # Passed already (another saved tensor of a unit in use), or outside the agreed order:
        # the latter is identical on every rank for a deterministic model.
        self.wait(unit)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def track_forwards(module: torch.nn.Module, units: list[Unit], plan: UnitPlan, comm, *, stage: int, dp_size: int,
                   device: torch.device, forward_key, in_backward: Callable[[], bool],
                   source: Optional[Callable[[FlatGroup], torch.Tensor]], zc, hold: bool
                   ) -> tuple[Optional[ForwardAgreement], Optional[GatherWindow], list]:
    """ZeRO-2/3: which units each forward used, agreed over DP without a per-step host sync
    (``agreement.py``); ZeRO-3: the window that gathers units while they are used (``zc``: the
    ``zero_optimization`` config). Returns ``(agreement, window, ZeRO-2's usage hook handles)``."""
    if stage < 2:
        return None, None, []
    agreement = ForwardAgreement(units, all_reduce_sum(comm), dp_size, device, forward_key)
    needs = plan.unit_needs(units)
    unit_of_param = {s.param: g.unit for u in units for g in u.groups for s in g.slots}
    if stage == 2:
        hooks = install_usage_hooks(module, needs, plan.hooked, unit_of_param, agreement, in_backward=in_backward)
        return agreement, None, hooks
    window = GatherWindow(
        module, units, needs, plan.hooked, unit_of_param,
        all_gather=lambda out, shard, g: comm.all_gather(out, shard, g.part.name, async_op=True),
        source=source, in_backward=in_backward,
        on_forward_begin=agreement.begin, on_forward_end=agreement.end, mark_used=agreement.mark_used,
        prefetch_numel=zc.stage3_prefetch_bucket_size, max_live_numel=zc.stage3_max_live_parameters, hold=hold)
    return agreement, window, []


def refuse_differing_forwards(comm, partitionings: list) -> None:
    """ZeRO-3 with per-unit reduce-scatters, after the DP ranks' forwards used different units (agreeing,
    every rank learns it from the same sum; static, the rank whose forward left the kept record does, and
    the launcher then stops the others, waiting in their first collective). Such ranks interleave their
    backward gathers and reduce-scatters differently; on a shared communicator (NCCL) they would pair the
    wrong collectives and hang, so refuse before the first of them."""
    shared = [p.name for p in partitionings if comm.groups[grads_channel(p)] is comm.groups[p.name]]
    if shared:
        raise RuntimeError(
            "ZeRO-3: the data-parallel ranks ran different layers in this forward (control flow that depends "
            "on the data); their backward gathers and gradient reduce-scatters share one communicator "
            f"({', '.join(shared)}) and cannot be ordered alike on every rank. Use ZeRO-2, or keep the units "
            'gathered through the step ("stage3_keep_gathered_in_step": true), or make every rank run '
            "every layer (as GPT layers do)")
