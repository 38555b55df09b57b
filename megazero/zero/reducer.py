"""Gradient reduction for ZeRO-2/3: buckets reduce-scattered as units finish their backward.

Every unit's gradients leave the full-size autograd buffers as soon as the unit
is complete: they are copied into a bucket laid out ``[partitions, columns]``
(each group's padded flat gradient, viewed as ``[partitions, shard]``, is one
column block), so that a single reduce-scatter of the bucket hands every rank
the sum of its own partition of every group in it. Groups partitioned over
different process groups (``partitioning.py``: experts beside dense layers)
fill different buckets, one open bucket per partitioning. A bucket is sent once
it holds ``bucket_numel`` elements; at most ``max_in_flight`` buckets are being reduced
at a time (the oldest is waited for and accumulated into the rank's gradient
partitions before the next bucket is allocated), which bounds the full-size
gradient memory by ``max_in_flight x bucket`` plus the units not yet complete.

Order. All ranks must pair the same reduce-scatters. Units are reduced in the
reverse of their static order (``units.py``), which is the order backward
completes them in a sequential model; a unit is sent when it is complete, or,
if this rank did not use it in this forward while another rank did, as zeros
in its turn (the ranks agree on the used set with one small all-reduce per
forward while the engine agrees, none once the ranks' forwards proved static:
see ``agreement.py``). Units no rank used are skipped by all.

On CUDA the reduce-scatters are asynchronous NCCL calls, so the next unit's
backward overlaps them; the structure (issue, then wait only when the window
is full or at the end) is what makes that possible.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..utils.scopes import scope
from .flat import FlatGroup
from .partitioning import Partitioning
from .units import Unit

__all__ = ["GradReducer"]


class GradReducer:
    """Reduce-scatters units' gradients in the agreed order into each group's ``grad_shard``.

    ``reduce_scatter(out, full, partitioning)`` issues one bucket's collective and returns its
    work (or None when done)."""

    def __init__(
        self,
        units: list[Unit],
        *,
        reduce_scatter: Callable[[torch.Tensor, torch.Tensor, Partitioning], object],
        reduce_dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        max_in_flight: int,
        predivide: float = 1.0,
    ) -> None:
        persistent = [u for u in units if u.resident and u.name == "persistent"]
        ordered = [u for u in reversed(units) if u not in persistent] + persistent
        self.order = [u for u in ordered if u.grads_expected]
        self.reduce_scatter = reduce_scatter
        self.reduce_dtype, self.device = reduce_dtype, device
        self.bucket_numel, self.max_in_flight = max(1, bucket_numel), max(1, max_in_flight)
        self.predivide = predivide  # DeepSpeed's gradient_predivide_factor (undone by the optimizer step)
        # The current backward's units: used on some DP rank (agreed), and on this one.
        self.used: Optional[set[Unit]] = None
        self.used_here: set[Unit] = set()
        self._reset()
        self.peak_bucket_bytes = 0  # largest bucket buffers alive at once (full-size gradients)

    def _reset(self) -> None:
        self.pointer = 0
        # one open bucket per partitioning (by name): its groups and their padded elements
        self.buckets: dict[str, tuple[Partitioning, list[FlatGroup]]] = {}
        self.fill: dict[str, int] = {}
        self.dropped: list[Unit] = []
        self.in_flight: list[tuple[object, torch.Tensor, torch.Tensor, list[FlatGroup]]] = []
        for u in self.order:
            u.grads_seen = 0

    # ---- events -------------------------------------------------------------------------

    def grad_ready(self, unit: Unit) -> None:
        unit.grads_seen += 1
        if unit.grads_seen == unit.grads_expected:
            self.advance(final=False)

    def advance(self, final: bool) -> None:
        """Send, in the agreed order, every unit whose turn has come and whose gradients are known."""
        if self.used is None:
            return
        while self.pointer < len(self.order):
            u = self.order[self.pointer]
            if u not in self.used:
                self._drop(u)
            elif final or u.grads_seen >= u.grads_expected or u not in self.used_here:
                self._add(u)
            else:
                break
            self.pointer += 1

    def finish(self) -> None:
        """End of a backward: send what is left (missing gradients as zeros) and wait for everything."""
        self.advance(final=True)
        for u in self.dropped:  # gradients that arrived after their unit was dropped (an uncovered forward)
            u.drop_grads()
        self._flush()
        while self.in_flight:
            self._complete_oldest()
        self._reset()
        self.used, self.used_here = None, set()

    # ---- buckets ------------------------------------------------------------------------

    def _drop(self, unit: Unit) -> None:
        self.dropped.append(unit)
        unit.drop_grads()

    def _add(self, unit: Unit) -> None:
        full = set()
        for g in unit.trainable_groups:
            name = g.part.name
            self.buckets.setdefault(name, (g.part, []))[1].append(g)
            self.fill[name] = self.fill.get(name, 0) + g.padded_numel
            if self.fill[name] >= self.bucket_numel:
                full.add(name)
        for name in [n for n in self.buckets if n in full]:  # in the buckets' (agreed) order
            self._flush(name)

    def _flush(self, name: Optional[str] = None) -> None:
        """Send the open bucket of partitioning ``name`` (None: every open bucket, oldest first)."""
        if name is None:
            for n in list(self.buckets):
                self._flush(n)
            return
        part, groups = self.buckets.pop(name)
        self.fill.pop(name)
        with scope("zero.reduce"):
            # Wait for the oldest before allocating: at most max_in_flight buckets exist at once (the
            # reduction of the previous bucket still overlaps the backward that filled this one).
            while len(self.in_flight) >= self.max_in_flight:
                self._complete_oldest()
            columns = sum(g.shard_numel for g in groups)
            buf = torch.empty(groups[0].partitions, columns, dtype=self.reduce_dtype, device=self.device)
            col = 0
            for g in groups:
                g.grads_into(buf[:, col:col + g.shard_numel])
                col += g.shard_numel
            if self.predivide != 1.0:
                buf.div_(self.predivide)
            out = torch.empty(columns, dtype=self.reduce_dtype, device=self.device)
            work = self.reduce_scatter(out, buf.view(-1), part)
        self.in_flight.append((work, out, buf, groups))
        live = sum(b.numel() * b.element_size() for _, _, b, _ in self.in_flight)
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, live)

    def _complete_oldest(self) -> None:
        work, out, _buf, groups = self.in_flight.pop(0)
        if work is not None:
            work.wait()
        col = 0
        for g in groups:
            g.grad_shard.add_(out[col:col + g.shard_numel])
            col += g.shard_numel
