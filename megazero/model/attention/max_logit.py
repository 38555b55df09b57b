"""The largest attention logit of each head, for QK-clip (Kimi K2's MuonClip) and its log.

A logit is ``q_i . k_j / sqrt(d)`` for a query ``i`` and a key ``j`` it may attend to (causal, and the
optional user mask). The fused kernels do not return it, so it is computed apart, without gradient, in
tiles of query rows: the extra work is one ``QK^T`` (half of attention's forward matmuls) and the extra
memory one tile of scores.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["max_attention_logit"]

TILE_ELEMENTS = 1 << 24  # scores per tile: 64 MiB in fp32


@torch.no_grad()
def max_attention_logit(q: torch.Tensor, k: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                        window: Optional[int] = None) -> torch.Tensor:
    """Per query head, the largest logit over the batch: q ``[s, b, heads, d]``, k ``[s, b, groups, d]``
    (each group serves heads/groups consecutive heads), ``attention_mask`` True where attention is
    forbidden (as core attention takes it), ``window``: the keys a sliding window leaves (None: all
    before the query). Returns ``[heads]`` fp32."""
    s, b, n, d = q.shape
    groups = k.size(2)
    qh = q.permute(1, 2, 0, 3).float().reshape(b, groups, n // groups, s, d)  # [b, g, heads/g, s, d]
    kh = k.permute(1, 2, 3, 0).float().unsqueeze(2)  # [b, g, 1, d, s]
    rows = max(1, min(s, TILE_ELEMENTS // max(b * n * s, 1)))
    best = torch.full((n,), float("-inf"), dtype=torch.float32, device=q.device)
    keys = torch.arange(s, device=q.device)
    for lo in range(0, s, rows):
        hi = min(s, lo + rows)
        scores = torch.matmul(qh[..., lo:hi, :], kh) * (1.0 / math.sqrt(d))  # [b, g, heads/g, rows, s]
        forbidden = keys.view(1, -1) > torch.arange(lo, hi, device=q.device).view(-1, 1)
        if window is not None:
            forbidden |= keys.view(1, -1) < torch.arange(lo, hi, device=q.device).view(-1, 1) - window
        if attention_mask is not None:  # [b or 1, 1, s, s]: one more axis for the groups
            forbidden = (forbidden | attention_mask.to(torch.bool)[..., lo:hi, :]).unsqueeze(1)
        scores = scores.masked_fill(forbidden, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).reshape(n))
    return best
