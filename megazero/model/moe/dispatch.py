"""The token dispatcher of a mixture of experts (Megatron-core's alltoall dispatcher): token copies to the
ranks holding their experts and the experts' outputs back, by uneven all-to-alls over the exchange group.

The exchange group holds ``ep`` ranks of different experts, each ``copies`` times (the etp ranks sharing
an expert's weights when each rank routes its own tokens; else 1), rank ``j`` holding expert-parallel
shard ``j // copies``. A rank's copies arrive sorted by expert; each expert's rows reach it ordered by
(source rank, token), one process's order. Dropless, the sizes vary and are read on the host once per
call (:meth:`TokenDispatcher.dispatch`); padded to ``slots`` rows per expert they are fixed
(:meth:`TokenDispatcher.dispatch_padded`) and nothing waits for the device.

Around the exchange, :func:`permute` sorts a rank's token copies by expert (the copies over capacity
last, sent nowhere) and :func:`unpermute` takes the experts' outputs back to (token, choice) order and
sums each token's k outputs by their routing weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megazero.mpu.moe_exchange import all_to_all_rows, exchange_counts

from .routing import expert_counts

__all__ = ["TokenDispatcher", "Permutation", "permute", "unpermute", "padded_slots"]


@dataclass
class Permutation:
    """How a rank's token copies were sorted by expert: ``flat`` ``[T k]`` each copy's expert in (token,
    choice) order (``E`` for a dropped one), ``order`` the stable sort of ``flat``, ``counts`` ``[E]`` the
    kept copies per expert. The sorted rows travel apart, so they are freed once dispatched."""

    flat: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor


def permute(tokens: torch.Tensor, top: torch.Tensor, drop: Optional[torch.Tensor],
            experts: int) -> tuple[torch.Tensor, Permutation]:
    """``tokens`` ``[T, h]`` routed to ``top`` ``[T, k]`` of ``experts``, ``drop`` ``[T, k]`` the copies over
    capacity (None: dropless): the copies ``[T k, h]`` sorted by expert, then by token (a stable sort;
    the dropped ones last), and the :class:`Permutation` that sorted them."""
    k = top.size(1)
    flat, buckets = top.reshape(-1), experts
    if drop is not None:  # copies over capacity go to a bucket past the last expert: sorted last, sent nowhere
        flat, buckets = torch.where(drop.reshape(-1), experts, flat), experts + 1
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, buckets)[:experts]
    return tokens.index_select(0, order // k), Permutation(flat, order, counts)


def unpermute(out: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """``out``: the kept copies' outputs in ``perm``'s sorted order (the dropped ones, last, may be
    missing: zeros). Returns each token's outputs summed by ``weights`` ``[T, k]``: ``[T, h]``."""
    n, k = weights.shape
    if out.size(0) < n * k:  # the dropped copies' outputs: zeros
        out = torch.cat([out, out.new_zeros(n * k - out.size(0), out.size(1))])
    out = out.index_select(0, torch.argsort(perm.order))  # back to (token, choice) order
    return (out.view(n, k, -1) * weights.unsqueeze(-1)).sum(1)


@dataclass
class TokenDispatcher:
    """``group``: the exchange group (None: this rank alone); ``ep``: its expert-parallel shards; ``copies``:
    ranks per shard; ``local``: this rank's experts; ``counter``: bytes sent, by phase, when a caller asks."""

    group: Optional[dist.ProcessGroup]
    ep: int
    copies: int
    local: range
    counter: Optional[dict] = None

    @property
    def ranks(self) -> int:
        return self.ep * self.copies

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """``rows``: this rank's token copies sorted by expert (any dropped ones last), ``counts`` ``[E]`` the
        kept ones per expert. Returns the rows this rank's experts get, ordered by (expert, source rank,
        token), and the plan :meth:`combine` and the experts need (its first item: rows per local expert)."""
        per_rank, copies = len(self.local), self.copies
        send = counts.view(self.ep, per_rank).repeat_interleave(copies, dim=0)  # row j: to exchange rank j
        if counts.device.type == "meta":  # a rehearsal: every rank routes alike (uniform), so it receives what it sends
            mine = counts.tolist()[self.local.start:self.local.stop]
            table = [send.tolist(), [mine] * self.ranks]
        else:
            table = torch.stack([send, exchange_counts(send, self.group)]).tolist()  # [2, ranks, E/ep], on the host
        send_splits, recv_table = [sum(r) for r in table[0]], table[1]
        recv_splits = [sum(r) for r in recv_table]
        rows = rows[:sum(send_splits) // copies]  # without the dropped copies
        if copies > 1:  # each EP rank's block once per etp rank holding its experts
            rows = torch.cat([b for b in rows.split(send_splits[::copies]) for _ in range(copies)])
        got = all_to_all_rows(rows, self.group, recv_splits, send_splits, self.counter)
        index = _by_expert(recv_table, sum(recv_splits), got.device)
        per_expert = [sum(recv_table[r][e] for r in range(self.ranks)) for e in range(per_rank)]
        return got.index_select(0, index), (per_expert, index, send_splits, recv_splits)

    def combine(self, out: torch.Tensor, plan: tuple) -> torch.Tensor:
        """The experts' outputs back to their tokens' ranks, in the order the rows were sent (kept copies
        sorted by expert); with etp copies, their partial sums added here in etp-rank order."""
        _, index, send_splits, recv_splits = plan
        out = out.index_select(0, torch.argsort(index))  # (source rank, expert) order, as received
        back = all_to_all_rows(out, self.group, send_splits, recv_splits, self.counter)
        if self.copies == 1:
            return back
        parts = back.split(send_splits)
        return torch.cat([sum(parts[j + 1:j + self.copies], parts[j]) for j in range(0, len(parts), self.copies)])

    def dispatch_padded(self, send: torch.Tensor, slots: int) -> torch.Tensor:
        """``send`` ``[E * slots, h]``: each expert's ``slots`` rows from this rank. Returns this rank's
        experts' rows, ``[E/ep * ranks * slots, h]`` ordered by (expert, source rank, slot): equal splits."""
        per_rank, ranks, local = len(self.local) * slots, self.ranks, len(self.local)
        if ranks == 1:
            return send
        send = send.view(self.ep, 1, per_rank, -1).expand(-1, self.copies, -1, -1).reshape(-1, send.size(-1))
        got = all_to_all_rows(send, self.group, [per_rank] * ranks, [per_rank] * ranks, self.counter)
        return got.view(ranks, local, slots, -1).transpose(0, 1).reshape(-1, got.size(-1))

    def combine_padded(self, out: torch.Tensor, slots: int) -> torch.Tensor:
        """The inverse of :meth:`dispatch_padded`: ``[E * slots, h]``, etp partial sums added."""
        per_rank, ranks, local = len(self.local) * slots, self.ranks, len(self.local)
        if ranks == 1:
            return out
        out = out.view(local, ranks, slots, -1).transpose(0, 1).reshape(-1, out.size(-1))
        out = all_to_all_rows(out, self.group, [per_rank] * ranks, [per_rank] * ranks, self.counter)
        return out.view(self.ep, self.copies, per_rank, -1).sum(1).reshape(-1, out.size(-1))


def _by_expert(recv_table: list, total: int, device: torch.device) -> torch.Tensor:
    """The permutation taking the ``total`` received rows, ordered (source rank, expert, token), to (expert,
    source rank, token): built from the ``[ranks, E/ep]`` host table with a few small tensor operations."""
    table = torch.tensor(recv_table, dtype=torch.long)  # [ranks, E/ep]
    starts = (torch.cumsum(table.reshape(-1), 0) - table.reshape(-1)).view_as(table)  # where each block arrived
    sizes, origin = table.t().reshape(-1), starts.t().reshape(-1)  # blocks in (expert, source rank) order
    shift = origin - (torch.cumsum(sizes, 0) - sizes)
    index = torch.repeat_interleave(shift, sizes, output_size=total) + torch.arange(total)
    return index.to(device, non_blocking=True)


def padded_slots(flat: torch.Tensor, order: torch.Tensor, experts: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` ``[T k]``: each copy's expert (``experts`` for a dropped one); ``order``: its stable sort.
    Returns ``(src [E * slots], slot [T k])``: which sorted copy fills each expert's slot (index ``T k``,
    a zero row, when the expert has fewer), and each copy's slot in (token, choice) order (``E * slots``,
    a zero row, when dropped). Device arithmetic only."""
    copies = flat.numel()
    if flat.device.type == "meta":
        return (torch.empty(experts * slots, dtype=torch.long, device="meta"),
                torch.empty(copies, dtype=torch.long, device="meta"))
    counts = torch.bincount(flat, minlength=experts + 1)  # the last bucket: dropped copies
    starts = torch.cumsum(counts, 0) - counts
    p = torch.arange(slots, device=flat.device)
    src = torch.where(p < counts[:experts, None], starts[:experts, None] + p, copies).reshape(-1)
    expert = flat[order]
    place = torch.arange(copies, device=flat.device) - starts[expert]
    sorted_slot = torch.where(expert < experts, expert * slots + place, experts * slots)
    return src, torch.empty_like(sorted_slot).index_copy_(0, order, sorted_slot)
