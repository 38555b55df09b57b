"""The expert-parallel exchange: an all-to-all of token rows with uneven splits, differentiable.

Forward sends ``in_splits[r]`` rows of ``x`` to rank ``r`` of ``group`` and receives ``out_splits[r]``
rows from it, in rank order; backward sends the gradients back the same way. ``counter`` (a dict)
adds the bytes this rank sends, by phase, for checks against the formula.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows", "exchange_counts"]


def _all_to_all(x: torch.Tensor, group, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def _sent_bytes(x: torch.Tensor, in_splits: Sequence[int], rank: int) -> int:
    row = x[0].numel() * x.element_size() if x.size(0) else 0
    return row * (sum(in_splits) - in_splits[rank])


class _AllToAllRows(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, counter):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.counter = group, out_splits, in_splits, counter
        if counter is not None:
            counter["forward"] = counter.get("forward", 0) + _sent_bytes(x, in_splits, dist.get_rank(group))
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        if ctx.counter is not None:
            ctx.counter["backward"] = ctx.counter.get("backward", 0) + _sent_bytes(
                grad, ctx.out_splits, dist.get_rank(ctx.group))
        return _all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None, None


def all_to_all_rows(x: torch.Tensor, group: Optional[dist.ProcessGroup], out_splits: Sequence[int],
                    in_splits: Sequence[int], counter: Optional[dict] = None) -> torch.Tensor:
    """``x`` ``[sum(in_splits), ...]`` -> ``[sum(out_splits), ...]``: rows ``in_splits[r]`` go to rank r,
    ``out_splits[r]`` rows come from it (rank order); differentiable (backward: the reverse exchange)."""
    return _AllToAllRows.apply(x, group, tuple(out_splits), tuple(in_splits), counter)


def exchange_counts(counts: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``counts`` ``[P, n]`` (row r: what this rank sends to rank r) -> ``[P, n]`` (row r: what rank r sends
    here): one equal-split all-to-all of integers, no autograd."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
