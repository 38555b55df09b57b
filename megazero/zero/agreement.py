"""What each forward used, agreed over the data-parallel group without stalling the device.

ZeRO-2/3 make every DP rank pair the same collectives in backward: the reducer sends the
units a forward used, in their static order (``reducer.py``); the ZeRO-3 window re-gathers,
in reverse trace order, the units whose gathered weights autograd saved (``window.py``).
Both follow the forward's *record*: which units it used, and which trace entries saved
something. A model whose control flow depends on the data (a layer some ranks skip) makes
the records differ between ranks, and then every rank must follow the DP-wide union.

Agreeing on the union costs a collective per forward and, worse, reading its result on the
host before backward can be queued: one synchronisation per micro-batch, which stops the
CPU from running ahead of a GPU. So the agreement has two modes:

* **agreeing** (the first optimizer step, and for good once records were seen to differ):
  each forward starts a tiny asynchronous all-reduce (a sum) of its record; its backward
  waits for it and reads it: the union, and whether every rank's record was the same
  (``Record.uniform``). Correct for any control flow. The agreed record is kept per
  forward *key*: ``forward_key(args, kwargs)`` of the model call, constant by default; forwards
  that use different units on every rank alike (a pipeline stage's virtual chunks) need keys
  that tell them apart, or the engine stays agreeing.
* **static** (from the step after one in which, on every rank, every forward's agreed record
  equalled the rank's own and its signature's earlier ones): each backward follows the kept
  record of its signature; no collective, no synchronisation. A rank whose forward used (or
  saved) what the kept record does not cover counts a deviation; the step's gradient-norm
  all-reduce, which exists anyway, carries the count, and a deviation anywhere skips that
  update on every rank and returns the engine to agreeing. A forward that used *less* than
  the kept record is covered: its missing gradients go out as zeros, as when agreeing. A
  ZeRO-3 forward that saved a unit no rank saved before cannot be re-gathered alone (its
  peers do not take part): that, as for ranks running different modules under DeepSpeed's
  ZeRO-3 or FSDP, is not supported; models whose forwards differ show it in the first step.

Every mode change is decided from sums all ranks receive from the same all-reduce, so they
change together. GPTs are static: after the first step ZeRO-2/3 make no host
synchronisation of their own.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Hashable, Optional

import torch
import torch.distributed as dist

from .units import Unit, units_for_call

__all__ = ["ForwardAgreement", "Record", "STEP_VALUES", "install_usage_hooks"]

STEP_VALUES = 1  # values this module adds to the step's norm all-reduce: forwards not settled


@dataclasses.dataclass
class Record:
    """One forward awaiting its backward."""

    key: Hashable                  # the forward's key (which forwards are alike)
    used: set[Unit]                # the units used on some DP rank (agreed)
    used_here: set[Unit]           # the units this rank used
    saved: list[bool]              # per window trace entry: autograd saved a gathered weight
    trace: list                    # the window's trace of this forward (ZeRO-3; else empty)
    # grad_fn ids of the outputs (which backward belongs to it): ids, not the nodes, for a record
    # must not keep its forward's autograd graph alive (a forward whose backward never comes)
    outputs: set[int]
    uniform: bool = True           # every DP rank's record was the same (static: this rank's was the kept one)

    def saved_units(self) -> set[Unit]:
        return {e.unit for e, s in zip(self.trace, self.saved) if s}

    def same(self, other: "Record") -> bool:
        return self.used == other.used and self.saved == other.saved and \
            [e.unit for e in self.trace] == [e.unit for e in other.trace]

    def covered_by(self, kept: "Record") -> bool:
        return self.used_here <= kept.used and self.saved_units() <= kept.saved_units()
    local: Optional[list[int]] = None           # agreeing: this rank's flags before the reduction
    flags: Optional[torch.Tensor] = None        # agreeing: the flags being reduced on the device
    work: object = None                         # agreeing: the all-reduce in flight


class ForwardAgreement:
    """Records forwards and hands each backward the record to follow (see the module doc)."""

    def __init__(self, units: list[Unit], all_reduce_sum: Callable[[torch.Tensor], object], ranks: int,
                 device: torch.device, forward_key: Optional[Callable[[tuple, dict], Hashable]] = None) -> None:
        self.units, self.all_reduce_sum, self.device = units, all_reduce_sum, device
        self.ranks = ranks  # the DP ranks the flags are summed over
        self.forward_key = forward_key or (lambda args, kwargs: ())
        self.persistent = {u for u in units if u.name == "persistent"}
        self.agreeing = True
        self.pending: collections.deque[Record] = collections.deque()
        self.used: set[Unit] = set()
        self.key: Hashable = ()
        self.kept: dict[Hashable, Record] = {}        # static: the agreed record per key
        self._reset_step()

    def _reset_step(self) -> None:
        self.unsettled = 0      # forwards of this step that argue against (staying) static
        self.step_records: dict[Hashable, Record] = {}  # agreeing: this step's agreed records

    # ---- forward --------------------------------------------------------------------------

    def begin(self, args: tuple = (), kwargs: Optional[dict] = None) -> None:
        """A forward of the model starts, called with ``args``/``kwargs``."""
        # Small persistent parameters sit in every layer: no module hook speaks for them.
        self.used = set(self.persistent)
        self.key = self.forward_key(args, kwargs or {})

    def mark_used(self, unit: Unit) -> None:
        self.used.add(unit)

    def end(self, trace: Optional[list], out=None) -> None:
        """A forward with gradients ended: record it (and, agreeing, start its all-reduce)."""
        if not torch.is_grad_enabled():
            return
        trace = list(trace) if trace is not None else []
        saved = [bool(e.saved) for e in trace]
        rec = Record(self.key, set(self.used), set(self.used), saved, trace,
                     {id(t.grad_fn) for t in _tensors(out) if t.grad_fn is not None})
        if self.agreeing:
            rec.local = [1 if u in self.used else 0 for u in self.units] + [1 if s else 0 for s in saved]
            # one byte per flag while the sum fits (255 ranks); int32 beyond
            rec.flags = torch.tensor(rec.local, dtype=torch.uint8 if self.ranks < 256 else torch.int32).to(self.device)
            rec.work = self.all_reduce_sum(rec.flags)  # counts: the union, and whether all agree
        self.pending.append(rec)

    # ---- backward -------------------------------------------------------------------------

    def for_backward(self, loss: torch.Tensor) -> Record:
        """The record ``loss``'s backward must follow (agreeing: the DP union, read on the host)."""
        if not self.pending:
            raise RuntimeError("ZeroEngine.backward() without a forward through the engine: run "
                               "engine(batch) (or the wrapped model) with gradients enabled first")
        rec = self._owner(loss)
        if rec.flags is None:  # static: follow the kept record of this key
            kept = self.kept.get(rec.key)
            if kept is None or not rec.covered_by(kept):
                self.unsettled += 1
            if kept is None:
                return dataclasses.replace(rec, uniform=False)
            # uniform only as far as this rank can tell: its forward is exactly the kept one
            return dataclasses.replace(kept, used_here=rec.used_here, outputs=rec.outputs, uniform=rec.same(kept))
        if rec.work is not None:
            rec.work.wait()
        counts = rec.flags.cpu().tolist()  # the agreeing mode's one synchronisation per micro-batch
        rec.uniform = all(c in (0, self.ranks) for c in counts)
        agreed = [1 if c else 0 for c in counts]
        n = len(self.units)
        rec.used = {u for u, f in zip(self.units, agreed[:n]) if f}
        rec.saved = [bool(f) for f in agreed[n:]]
        earlier = self.step_records.get(rec.key)
        if agreed != rec.local or (earlier is not None and not earlier.same(rec)):
            self.unsettled += 1
        self.step_records[rec.key] = rec
        return rec

    def _owner(self, loss: torch.Tensor) -> Record:
        """The forward ``loss`` was computed from. Pipelines keep several forwards in flight and
        the interleaved schedule runs their backwards out of order: walk a few autograd nodes
        up from ``loss`` to a recorded output, else take the oldest. Nodes are compared by ``id``
        (see ``Record.outputs``; autograd's nodes take no weak references)."""
        if len(self.pending) > 1 and loss.grad_fn is not None:
            owner = {gid: i for i, rec in enumerate(self.pending) for gid in rec.outputs}
            frontier, seen = [loss.grad_fn], set()
            while frontier and len(seen) < 256:
                fn = frontier.pop(0)
                key = id(fn)
                if fn is None or key in seen:
                    continue
                seen.add(key)
                if key in owner:
                    rec = self.pending[owner[key]]
                    del self.pending[owner[key]]
                    return rec
                frontier.extend(f for f, _ in fn.next_functions)
        return self.pending.popleft()

    # ---- the step -------------------------------------------------------------------------

    def step_values(self) -> list[float]:
        """This rank's contribution to the step's all-reduce (summed over the world)."""
        return [float(self.unsettled)]

    def settle(self, unsettled: float) -> bool:
        """After the step's reduction (``unsettled`` summed over every rank): change mode as every
        rank will. True when a static step's forward was not covered: skip its update."""
        records = self.step_records
        self._reset_step()
        if self.agreeing:
            if unsettled == 0:
                self.agreeing, self.kept = False, {k: _kept(r) for k, r in records.items()}
            return False
        if unsettled:
            self.agreeing, self.kept = True, {}
            return True
        return False


def _kept(rec: Record) -> Record:
    """What a static backward needs of an agreed record (no device tensors, no outputs)."""
    return dataclasses.replace(rec, outputs=set(), local=None, flags=None, work=None)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def all_reduce_sum(comm, name: str = "dp") -> Callable[[torch.Tensor], object]:
    """The agreeing mode's collective on ``comm``'s ``name`` group."""
    return lambda t: comm.all_reduce(t, name, op=dist.ReduceOp.SUM, async_op=True)


def install_usage_hooks(model: torch.nn.Module, needs: dict[torch.nn.Module, list[Unit]],
                        hooked: list[torch.nn.Module], unit_of_param: dict[torch.nn.Parameter, Unit],
                        agreement: ForwardAgreement,
                        in_backward: Callable[[], bool]) -> list:
    """ZeRO-2's forward hooks: note which units each forward used (for the agreed reduction
    order), as ZeRO-3's gather window does while gathering. Returns the hook handles."""
    def pre(module, args, kwargs):
        for u in units_for_call(needs, unit_of_param, module, args, kwargs):
            agreement.mark_used(u)

    def model_pre(module, args, kwargs):
        if not in_backward():
            agreement.begin(args, kwargs)
        pre(module, args, kwargs)

    def model_post(module, args, out):
        if not in_backward():
            agreement.end(None, out)

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in hooked if m is not model]
    handles.append(model.register_forward_pre_hook(model_pre, with_kwargs=True))
    handles.append(model.register_forward_hook(model_post, always_call=True))
    return handles
