"""Pipeline schedules as pure data: (pp, virtual stages, micro-batches, rank) -> ordered steps.

A schedule is the exact sequence of work one pipeline rank performs in a training
step: ``Compute`` steps (forward or backward of micro-batch ``mb`` through local
model chunk ``chunk``) and ``Exchange`` steps (one batch of point-to-point
transfers posted together, as Megatron's ``batch_isend_irecv``). Nothing here
touches a process group, so every property (order, matching transfers, absence
of deadlock, bubble) is testable in one process.

Three schedules, as in Megatron-core's ``pipeline_parallel/schedules.py``:

* pp = 1: no pipeline, forward then backward of each micro-batch.
* 1F1B (PipeDream-Flush): rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards.
  At most ``pp - r`` micro-batches' activations are alive on rank ``r``.
* Interleaved 1F1B (Narayanan et al. 2021): each rank holds ``v`` model chunks; chunk
  ``c`` of rank ``r`` is virtual stage ``c * pp + r``, so activations travel the ring
  ``pp - 1 -> 0`` between chunks. Warm-up is ``(pp - r - 1) * 2 + (v - 1) * pp``
  forwards (capped at ``m * v``); micro-batches run in groups of ``pp`` per chunk, so
  ``m`` must be a multiple of ``pp``. The bubble shrinks from ``(pp - 1) / m`` to
  ``(pp - 1) / (v * m)`` of the ideal time, for ``v`` times more p2p messages.

Transfers within one exchange are ordered activations before gradients and sends
before receives per peer, so both ends of every channel list their messages in
the same order even when the same two ranks exchange both kinds (pp = 2, interleaved).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence, Union

__all__ = ["Compute", "Transfer", "Exchange", "Step", "build_schedule", "check_schedule_args",
           "num_warmup_microbatches", "virtual_stage", "simulate", "SimulationResult", "ScheduleError"]

FORWARD, BACKWARD = "forward", "backward"
ACTIVATION, GRADIENT = "activation", "gradient"


class ScheduleError(ValueError):
    """A (pp, v, m, rank) combination no schedule exists for."""


@dataclasses.dataclass(frozen=True)
class Compute:
    kind: str  # FORWARD | BACKWARD
    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One message: ``send`` of this rank's tensor, or ``recv`` of one for a local chunk.

    ``microbatch``/``chunk`` name the local computation the tensor belongs to: for a
    send, the one that produced it; for a receive, the one that will consume it.
    ``peer`` is the pipeline rank at the other end.
    """

    send: bool
    what: str  # ACTIVATION | GRADIENT
    peer: int
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Exchange:
    transfers: tuple[Transfer, ...]


Step = Union[Compute, Exchange]


def virtual_stage(pp: int, rank: int, chunk: int) -> int:
    """Position of ``chunk`` of ``rank`` in the whole model (Megatron's layout: chunk-major)."""
    return chunk * pp + rank


def check_schedule_args(pp: int, v: int, m: int, rank: Optional[int] = None) -> None:
    """Raise ScheduleError, with the numbers, for impossible combinations."""
    if pp < 1 or v < 1 or m < 1:
        raise ScheduleError(f"pipeline size ({pp}), virtual stages ({v}) and micro-batches ({m}) must all be >= 1")
    if rank is not None and not 0 <= rank < pp:
        raise ScheduleError(f"pipeline rank {rank} is outside [0, {pp})")
    if v > 1 and pp == 1:
        raise ScheduleError(f"{v} virtual pipeline stages need a pipeline (pp > 1); with pp = 1 use v = 1")
    if v > 1 and m % pp:
        raise ScheduleError(
            f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple of the pipeline "
            f"size ({pp}), as in Megatron-core; use {((m + pp - 1) // pp) * pp} or {max(pp, (m // pp) * pp)} "
            f"micro-batches (global batch / (micro batch x dp)), or v = 1")


def num_warmup_microbatches(pp: int, v: int, m: int, rank: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Megatron's counts)."""
    check_schedule_args(pp, v, m, rank)
    if pp == 1:
        return 0
    if v == 1:
        return min(pp - rank - 1, m)
    return min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def build_schedule(pp: int, v: int, m: int, rank: int) -> list[Step]:
    """The ordered steps of pipeline rank ``rank`` for one training step of ``m`` micro-batches."""
    check_schedule_args(pp, v, m, rank)
    if pp == 1:
        return [c for i in range(m) for c in (Compute(FORWARD, i), Compute(BACKWARD, i))]
    if v == 1:
        return _one_f_one_b(pp, m, rank)
    return _interleaved(pp, v, m, rank)


class _Builder:
    """Accumulates steps; a transfer list becomes one Exchange (empty lists vanish)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def compute(self, kind: str, mb: int, chunk: int = 0) -> None:
        self.steps.append(Compute(kind, mb, chunk))

    def exchange(self, transfers: Iterable[Optional[Transfer]]) -> None:
        chosen = [t for t in transfers if t is not None]
        if chosen:
            # Canonical order: per peer, activations before gradients, sends before receives.
            # Both ends then post any two messages of one channel in the same order.
            chosen.sort(key=lambda t: (t.peer, t.what != ACTIVATION, not t.send))
            self.steps.append(Exchange(tuple(chosen)))


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Step]:
    first, last = rank == 0, rank == pp - 1
    b = _Builder()

    def send_act(mb):
        return None if last else Transfer(True, ACTIVATION, rank + 1, mb, 0)

    def recv_act(mb):
        return None if first or mb >= m else Transfer(False, ACTIVATION, rank - 1, mb, 0)

    def send_grad(mb):
        return None if first else Transfer(True, GRADIENT, rank - 1, mb, 0)

    def recv_grad(mb):
        return None if last else Transfer(False, GRADIENT, rank + 1, mb, 0)

    warmup = num_warmup_microbatches(pp, 1, m, rank)
    remaining = m - warmup
    for i in range(warmup):
        b.exchange([recv_act(i)])
        b.compute(FORWARD, i)
        b.exchange([send_act(i)])
    if remaining:
        b.exchange([recv_act(warmup)])
    for i in range(remaining):
        fwd, bwd = warmup + i, i
        b.compute(FORWARD, fwd)
        b.exchange([send_act(fwd), recv_grad(bwd)])
        b.compute(BACKWARD, bwd)
        b.exchange([send_grad(bwd)] + ([recv_act(fwd + 1)] if i < remaining - 1 else []))
    for i in range(remaining, m):
        b.exchange([recv_grad(i)])
        b.compute(BACKWARD, i)
        b.exchange([send_grad(i)])
    return b.steps


def _interleaved(pp: int, v: int, m: int, rank: int) -> list[Step]:
    total = m * v
    first_rank, last_rank = rank == 0, rank == pp - 1
    nxt, prev = (rank + 1) % pp, (rank - 1) % pp

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def mb_of(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    # Received tensors are queued per chunk and consumed in micro-batch order, so the
    # n-th receive into a chunk belongs to its n-th micro-batch.
    recv_count = {ACTIVATION: [0] * v, GRADIENT: [0] * v}

    def recv(what: str, chunk: int) -> Transfer:
        mb = recv_count[what][chunk]
        recv_count[what][chunk] += 1
        return Transfer(False, what, prev if what == ACTIVATION else nxt, mb, chunk)

    def send_act(k: int) -> Optional[Transfer]:
        c = chunk_of(k, True)
        return None if (last_rank and c == v - 1) else Transfer(True, ACTIVATION, nxt, mb_of(k), c)

    def send_grad(k: int) -> Optional[Transfer]:
        c = chunk_of(k, False)
        return None if (first_rank and c == 0) else Transfer(True, GRADIENT, prev, mb_of(k), c)

    b = _Builder()
    warmup = num_warmup_microbatches(pp, v, m, rank)
    all_warmup = warmup == total
    remaining = total - warmup

    if not first_rank:
        b.exchange([recv(ACTIVATION, 0)])
    for k in range(warmup):
        b.compute(FORWARD, mb_of(k), chunk_of(k, True))
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
        ops = [send_act(k), recv(ACTIVATION, next_chunk) if recv_prev else None]
        if k == warmup - 1 and not all_warmup and not last_rank:
            ops.append(recv(GRADIENT, v - 1))
        b.exchange(ops)

    for i in range(remaining):
        fk, bk = i + warmup, i
        b.compute(FORWARD, mb_of(fk), chunk_of(fk, True))
        b.compute(BACKWARD, mb_of(bk), chunk_of(bk, False))
        ops = [send_act(fk), send_grad(bk)]
        if first_rank:  # the neighbour sending to us (pp - 1) is pp - 1 forwards behind
            c = chunk_of(fk - (pp - 1), True)
            recv_prev, next_fwd_chunk = c != v - 1, c + 1
        else:
            recv_prev, next_fwd_chunk = True, chunk_of(fk + 1, True)
        if last_rank:  # the neighbour sending to us (0) is pp - 1 backwards behind
            c = chunk_of(bk - (pp - 1), False)
            recv_next, next_bwd_chunk = c != 0, c - 1
        else:
            recv_next, next_bwd_chunk = True, chunk_of(bk + 1, False)
        if i == remaining - 1:
            recv_prev = False
        if recv_prev:
            ops.append(recv(ACTIVATION, next_fwd_chunk))
        if recv_next:
            ops.append(recv(GRADIENT, next_bwd_chunk))
        b.exchange(ops)

    if all_warmup and not last_rank:
        b.exchange([recv(GRADIENT, v - 1)])
    for k in range(remaining, total):
        b.compute(BACKWARD, mb_of(k), chunk_of(k, False))
        next_chunk = chunk_of(k + 1, False)
        recv_next = not (last_rank and next_chunk == v - 1) and k != total - 1
        b.exchange([send_grad(k), recv(GRADIENT, next_chunk) if recv_next else None])
    return b.steps


# ---------------------------------------------------------------------------------------- simulation


@dataclasses.dataclass
class SimulationResult:
    makespan: float  # time of the last step on any rank
    busy: list[float]  # compute time per rank
    ideal: float  # compute time of one rank (all ranks do equal work)
    max_live_activations: list[int]  # per rank: forwards done whose backward has not yet run

    @property
    def bubble_fraction(self) -> float:
        """Idle time relative to the ideal (no-bubble) time, as Narayanan et al. define it."""
        return (self.makespan - self.ideal) / self.ideal


def simulate(schedules: Sequence[Sequence[Step]], forward_cost: float = 1.0, backward_cost: float = 2.0) -> SimulationResult:
    """Run every rank's schedule on a clock with free communication and rendezvous transfers.

    A compute step takes its cost. An exchange completes when the matching transfer of
    every message in it has been posted by its peer (a send waits for the receive: the
    strictest semantics, so a schedule that passes here cannot deadlock on buffering).
    Messages pair in order per (sender, receiver). Raises ScheduleError on a deadlock or
    on a message without a counterpart.
    """
    pp = len(schedules)
    # Position of every transfer in its channel; the counterpart has the same position.
    channel_pos: dict[tuple[int, int], int] = {}
    posted: dict[tuple[int, int, int], float] = {}  # (sender, receiver, n) -> time posted, per side
    posted_recv: dict[tuple[int, int, int], float] = {}
    keys: list[list[list[tuple[bool, tuple[int, int, int]]]]] = []
    for r, steps in enumerate(schedules):
        per_step = []
        for s in steps:
            ks = []
            if isinstance(s, Exchange):
                for t in s.transfers:
                    ch = (r, t.peer) if t.send else (t.peer, r)
                    side = (ch, t.send)
                    n = channel_pos.get(side, 0)
                    channel_pos[side] = n + 1
                    ks.append((t.send, (ch[0], ch[1], n)))
            per_step.append(ks)
        keys.append(per_step)
    for (ch, is_send), n in channel_pos.items():
        other = channel_pos.get((ch, not is_send), 0)
        if other != n:
            raise ScheduleError(f"channel {ch[0]}->{ch[1]}: {channel_pos.get((ch, True), 0)} sends but "
                                f"{channel_pos.get((ch, False), 0)} receives")

    clock = [0.0] * pp
    busy = [0.0] * pp
    pc = [0] * pp
    live = [0] * pp
    max_live = [0] * pp
    while True:
        progressed = False
        for r in range(pp):
            while pc[r] < len(schedules[r]):
                s = schedules[r][pc[r]]
                if isinstance(s, Compute):
                    cost = forward_cost if s.kind == FORWARD else backward_cost
                    clock[r] += cost
                    busy[r] += cost
                    live[r] += 1 if s.kind == FORWARD else -1
                    max_live[r] = max(max_live[r], live[r])
                else:
                    for is_send, k in keys[r][pc[r]]:
                        book = posted if is_send else posted_recv
                        if k not in book:
                            book[k] = clock[r]
                            progressed = True
                    partners = [(posted_recv if is_send else posted).get(k) for is_send, k in keys[r][pc[r]]]
                    if any(p is None for p in partners):
                        break
                    clock[r] = max([clock[r]] + partners)
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(schedules[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = {r: schedules[r][pc[r]] for r in range(pp) if pc[r] < len(schedules[r])}
            raise ScheduleError(f"deadlock: ranks wait forever at {stuck}")
    return SimulationResult(makespan=max(clock), busy=busy, ideal=max(busy), max_live_activations=max_live)
