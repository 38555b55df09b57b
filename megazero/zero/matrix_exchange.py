"""Whole matrices for per-matrix optimizers, with ZeRO's memory kept.

A per-matrix optimizer (Muon) needs each weight matrix whole, while ZeRO keeps a flat partition of
several parameters on each rank of a parameter's partitioning (the data-parallel group, or an
expert's expert-data-parallel group). Each matrix gets an *owner* in that group, chosen once by
longest-processing-time over the matrices' Newton-Schulz cost (as Megatron's layer-wise optimizer
and torchtitan's DistMuon balance theirs), the same on every rank and every TP rank.

Per step, :class:`MatrixExchange` moves, for every matrix of a partitioning at once:

* **in**: each holder sends the part of the matrix's (momentum-updated) gradient it holds to the
  owner: one ``all_to_all_single``; a rank sends about its partition's share of the per-matrix
  groups and receives about the matrices it owns (ZeRO-0: every rank holds them, nothing moves);
* **out**: the owner sends each holder the part of the update it holds: one ``all_to_all_single``
  (ZeRO-0: every rank holds the whole, so each owner sends its updates to every rank).

Nothing on a rank grows with the whole model beyond its own partition and the matrices it owns.
TP shards of a matrix are gathered whole by the owners on each TP rank (``muon.py``); the owners of
a matrix's TP shards share a TP group, since the owner index is the same on every TP rank.
"""

from __future__ import annotations

import dataclasses
import heapq
import torch

from .comm import CommCounter
from .flat import FlatGroup, ParamSlot

__all__ = ["Matrix", "assign_owners", "MatrixExchange", "ns_cost"]


@dataclasses.dataclass(eq=False)
class Matrix:
    """One parameter stepped as a matrix: where it lies in its flat group and who owns it."""

    group: FlatGroup
    slot: ParamSlot
    shape: tuple[int, int]  # of the whole matrix (TP shards gathered, where they are)
    owner: int = -1  # rank in the group's partitioning


def ns_cost(shape: tuple[int, int], steps: int = 5) -> float:
    """Multiply-adds of Newton-Schulz on a ``shape`` matrix: per iteration X X^T, A A and B X
    with ``m = min(shape)``, ``n = max(shape)``: 2 m^2 n + m^3 (doubled for FLOPs)."""
    m, n = min(shape), max(shape)
    return steps * (2.0 * m * m * n + m ** 3)


def assign_owners(matrices: list[Matrix], ranks: int, steps: int = 5) -> list[float]:
    """Give each matrix an owner in ``range(ranks)``: the largest first, each to the least loaded
    rank (ties to the lowest rank): deterministic, so every rank computes the same owners. Returns
    each rank's load (Newton-Schulz multiply-adds)."""
    loads = [0.0] * ranks
    costs = [ns_cost(m.shape, steps) for m in matrices]
    heap = [(0.0, r) for r in range(ranks)]  # (load, rank): a heap, so 1,024 ranks cost log(1024) per matrix
    for i in sorted(range(len(matrices)), key=lambda i: (-costs[i], i)):
        load, owner = heapq.heappop(heap)
        matrices[i].owner = owner
        loads[owner] = load + costs[i]
        heapq.heappush(heap, (loads[owner], owner))
    return loads


class MatrixExchange:
    """The two exchanges of one partitioning's matrices (see the module docstring).

    ``name`` is the partitioning's group name in ``comm``; ``rank``/``size`` this rank's place in
    it. Every group of the matrices is partitioned alike (ZeRO >= 1) or whole on every rank (ZeRO-0)."""

    def __init__(self, matrices: list[Matrix], comm: CommCounter, name: str, rank: int, size: int) -> None:
        self.matrices, self.comm, self.name, self.rank, self.size = matrices, comm, name, rank, size
        self.whole = all(m.group.partitions == 1 for m in matrices)  # ZeRO-0: every rank holds every matrix
        self.owned = [m for m in matrices if m.owner == rank]

    def held(self, m: Matrix, r: int) -> tuple[int, int]:
        """``(start in the matrix, length)`` of the part of ``m`` that rank ``r`` holds."""
        p0, _, n = m.group.owned_range(m.slot, r)
        return p0, n

    def _local(self, m: Matrix, shard: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``m``, as a view of its ``shard`` of ``m``'s group."""
        _, s0, n = m.group.owned_range(m.slot)
        return shard.narrow(0, s0, n)

    def gather(self, values: dict[FlatGroup, torch.Tensor]) -> dict[Matrix, torch.Tensor]:
        """Each owned matrix whole (flat, fp32) from every holder's ``values`` (its partition)."""
        if self.whole or self.size == 1:
            return {m: self._local(m, values[m.group]) for m in self.owned}
        sends = [[self._local(m, values[m.group]) for m in self.matrices if m.owner == dst] for dst in range(self.size)]
        in_splits = [sum(t.numel() for t in s) for s in sends]
        out_splits = [sum(self._span(m, src) for m in self.owned) for src in range(self.size)]
        device = next(iter(values.values())).device
        inp = torch.cat([t.float() for s in sends for t in s]) if sum(in_splits) else torch.empty(0, device=device)
        out = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
        self.comm.all_to_all(out, inp, out_splits, in_splits, self.name)
        pieces: dict[Matrix, list[torch.Tensor]] = {m: [] for m in self.owned}
        at = 0
        for src in range(self.size):  # sources in rank order: their pieces lie in the matrix's order
            for m in self.owned:
                n = self._span(m, src)
                pieces[m].append(out.narrow(0, at, n))
                at += n
        return {m: torch.cat(p) if len(p) > 1 else p[0] for m, p in pieces.items()}

    def scatter(self, updates: dict[Matrix, torch.Tensor], into: dict[FlatGroup, torch.Tensor]) -> None:
        """Write each matrix's update (flat, computed by its owner) into every holder's ``into``
        (its partition of each group)."""
        if self.size == 1:
            for m, u in updates.items():
                self._local(m, into[m.group]).copy_(u)
            return
        sends = [[self._piece(m, updates[m], dst) for m in self.owned] for dst in range(self.size)]
        in_splits = [sum(t.numel() for t in s) for s in sends]
        senders = [[m for m in self.matrices if m.owner == src] for src in range(self.size)]
        out_splits = [sum(self._span(m, self.rank) for m in ms) for ms in senders]
        device = next(iter(into.values())).device
        inp = torch.cat([t for s in sends for t in s]) if sum(in_splits) else torch.empty(0, device=device)
        out = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
        self.comm.all_to_all(out, inp, out_splits, in_splits, self.name)
        at = 0
        for ms in senders:
            for m in ms:
                n = self._span(m, self.rank)
                self._local(m, into[m.group]).copy_(out.narrow(0, at, n))
                at += n

    def _span(self, m: Matrix, r: int) -> int:
        return self.held(m, r)[1]

    def _piece(self, m: Matrix, update: torch.Tensor, r: int) -> torch.Tensor:
        return update.narrow(0, *self.held(m, r))

    def bytes_per_step(self) -> dict[str, int]:
        """fp32 bytes this rank sends per step: ``in`` (to the owners) and ``out`` (to the holders)."""
        sent_in = 0 if self.whole else sum(self._span(m, self.rank) for m in self.matrices if m.owner != self.rank)
        sent_out = sum((m.slot.numel if self.whole else m.slot.numel - self._span(m, self.rank))
                       * (self.size - 1 if self.whole else 1) for m in self.owned)
        return {"in": 4 * sent_in, "out": 4 * sent_out}
