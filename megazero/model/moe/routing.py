"""Routing of a mixture of experts (Megatron-core's router functions): which k experts each token goes
to and with what weights, which token copies exceed an expert's capacity, and the copies per expert.
Pure tensor functions, no parameters and no communication."""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["route", "over_capacity", "capacity_of", "expert_counts"]


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest of each row, ties to the lower index (a stable sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _limit_groups(scores: torch.Tensor, k: int, groups: int, group_topk: int) -> torch.Tensor:
    """DeepSeek's group-limited routing: experts in ``groups`` consecutive groups, a group scored by the sum
    of its k / group_topk best experts; the experts outside the best ``group_topk`` groups masked out."""
    t, e = scores.shape
    per_group = scores.view(t, groups, e // groups)
    group_scores = torch.sort(per_group, dim=-1, descending=True, stable=True).values[..., :k // group_topk].sum(-1)
    keep = torch.zeros(t, groups, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, _top(group_scores, group_topk), True)
    return scores.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))


def route(logits: torch.Tensor, k: int, pre_softmax: bool, score: str = "softmax", groups: Optional[int] = None,
          group_topk: Optional[int] = None, scaling: Optional[float] = None, bias: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits`` ``[T, E]`` (fp32 or fp64) -> (expert indices ``[T, k]``, their weights ``[T, k]``, the
    scores over all experts the load-balancing loss reads ``[T, E]``), Megatron-core's routing:
    softmax (the k top logits' softmax, or with ``pre_softmax`` the full softmax at the top k) or
    sigmoid (the top k sigmoids, renormalised when k > 1: DeepSeek-V3's); optionally limited to the
    best ``group_topk`` of ``groups`` expert groups, and the weights times ``scaling``. ``bias`` (sigmoid
    only): added to the scores that choose the experts, not to their weights (DeepSeek-V3)."""
    limit = (lambda s: _limit_groups(s, k, groups, group_topk)) if groups else (lambda s: s)
    if score == "sigmoid":
        scores = torch.sigmoid(logits)
        top = _top(limit(scores if bias is None else scores + bias.to(scores.dtype)), k)
        weights = scores.gather(1, top)
        if k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    else:
        probs = torch.softmax(logits, dim=-1)
        top = _top(limit(probs if pre_softmax else logits), k)
        weights = probs.gather(1, top) if pre_softmax else torch.softmax(logits.gather(1, top), dim=-1)
    return top, weights * scaling if scaling else weights, probs


def capacity_of(tokens: int, k: int, experts: int, factor: float, minimum: int = 0) -> int:
    """The copies an expert keeps out of ``tokens`` tokens' k: max(ceil(k T / E * factor), minimum)."""
    return max(math.ceil(tokens * k / experts * factor), minimum)


def over_capacity(top: torch.Tensor, weights: torch.Tensor, experts: int, factor: float, policy: str,
                  minimum: int = 0) -> torch.Tensor:
    """``[T, k]`` True for the token copies an expert cannot take: each expert keeps at most
    :func:`capacity_of` of its copies, those of the highest routing weight ('probs'; ties to the
    earlier token) or the earliest ('position')."""
    n, k = top.shape
    capacity = capacity_of(n, k, experts, factor, minimum)
    flat = top.reshape(-1)
    order = torch.arange(flat.numel(), device=flat.device)
    if policy == "probs":  # by weight, descending; a stable sort keeps token order among equals
        order = torch.sort(weights.reshape(-1).detach(), descending=True, stable=True).indices
    order = order[torch.sort(flat[order], stable=True).indices]  # then by expert
    counts = torch.bincount(flat, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]  # rank within its expert
    drop = torch.empty_like(flat, dtype=torch.bool)
    drop[order] = place >= capacity
    return drop.view(n, k)


def expert_counts(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """Token copies per expert ``[experts]`` of ``flat`` (each copy's expert). On the meta device (a
    rehearsal) the routing is unknown: the counts are taken uniform, the load a balanced router reaches."""
    if flat.device.type != "meta":
        return torch.bincount(flat, minlength=experts)
    base, extra = divmod(flat.numel(), experts)
    return torch.tensor([base + (e < extra) for e in range(experts)], dtype=torch.long)
