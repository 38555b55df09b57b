"""Context-parallel attention by all-to-all over heads (``a2a``, DeepSpeed Ulysses) and by
all-gather of K/V (``allgather``).

Each rank of a CP group holds some tokens of every sequence in the batch (any layout:
contiguous chunks, or the balanced 2P-chunk zigzag) and knows their global positions.
``SequenceShard.gather`` collects every rank's positions once per batch (``from_rank_positions``
builds the same from a layout, without communication); every layer reuses it.

* ``a2a_attention``: all-to-all so each rank holds the whole sequence for heads/P of the heads,
  reorder to the global order, run ``core_attention`` there, all-to-all back. Exact: it is the
  one-process computation restricted to a subset of heads.
* ``allgather_attention``: all-gather K/V along the sequence; this rank's queries attend to all
  of it under the causal (and document) mask built from the global positions.

Attention dropout is keyed by position (``dropout``, an :class:`~megazero.model.keyed_dropout.AttentionDropout`
naming the global heads held): both exchanges then apply the whole sequence's masks, by the math
kernel's tiles. Or the kernels draw their own masks (``dropout_p``, from the model-parallel stream),
which depend on the layout.

Shapes follow ``core_attention``: q ``[s_local, b, heads, dqk]``, k ``[s_local, b, groups, dqk]``,
v ``[s_local, b, groups, dv]`` (dv may differ from dqk), output ``[s_local, b, heads * dv]``. ``group`` is the CP process group (``None``: the default group,
every process). ``attention_mask`` (optional, boolean, True = masked, in addition
to causality) is given for the *global* sequence in global order: ``[b, 1, S, S]`` or ``[S, S]``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.model.attention.core import core_attention, resolve_backend
from megazero.model.attention.cp.layout import CPLayout
from megazero.model.keyed_dropout import AttentionDropout
from megazero.model.attention.tiled import block_attention, dense_attention
from megazero.mpu.cp_exchange import (CommCounter, all_gather_tensor, gather_sequence, heads_to_seq_all_to_all,
                                      replicated_kv_all_to_all, seq_to_heads_all_to_all)
from megazero.mpu.random import get_rng_tracker
from megazero.mpu.utils import group_size

__all__ = [
    "SequenceShard",
    "scatter_heads",
    "a2a_head_split",
    "a2a_dropout",
    "a2a_sinks",
    "a2a_attention",
    "allgather_attention",
    "a2a_elements",
    "allgather_elements",
]


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's tokens sit in the global sequence, and where every rank's do.

    ``positions``: ``[s_local]`` global indices of this rank's tokens, in the order they are held.
    ``all_positions``: ``[S]`` every rank's ``positions``, rank-major (the order gathers produce).
    ``order``: ``[S]`` with ``order[i]`` the rank-major index of global position ``i``.
    ``is_identity``: rank-major order is already the global order (a contiguous layout), so no reordering.
    Built once per batch (its checks read values on the host), then reused by every layer.
    """

    positions: torch.Tensor
    all_positions: torch.Tensor
    order: torch.Tensor
    is_identity: bool

    @classmethod
    def gather(cls, positions: torch.Tensor, group: Optional[dist.ProcessGroup]) -> "SequenceShard":
        """Collect every rank's ``positions`` (one small all-gather, once per batch) and check that
        together they cover ``0 .. S-1`` exactly once."""
        return cls._checked(_as_positions(positions), all_gather_tensor(_as_positions(positions), group))

    def to(self, device: torch.device) -> "SequenceShard":
        """The same shard with its index tensors on ``device`` (where the attention's tensors are)."""
        return SequenceShard(self.positions.to(device), self.all_positions.to(device), self.order.to(device),
                             self.is_identity)

    @classmethod
    def from_rank_positions(cls, per_rank: Sequence[torch.Tensor], rank: int) -> "SequenceShard":
        """The same without communication, from every rank's positions (a layout every rank can compute,
        e.g. ``[layout.positions(r) for r in range(cp)]``) and this rank's index."""
        per_rank = [_as_positions(p) for p in per_rank]
        if len({p.numel() for p in per_rank}) != 1:
            raise ValueError(f"every CP rank must hold the same number of tokens; got {[p.numel() for p in per_rank]}")
        return cls._checked(per_rank[rank], torch.cat(per_rank))

    @classmethod
    def _checked(cls, positions: torch.Tensor, everyone: torch.Tensor) -> "SequenceShard":
        total = everyone.numel()
        seen = torch.bincount(everyone.clamp(0, total), minlength=total + 1)[:total]
        if everyone.min() < 0 or everyone.max() >= total or not bool((seen == 1).all()):
            missing = (seen == 0).nonzero().flatten()[:8].tolist()
            raise ValueError(f"the CP ranks' positions must cover 0..{total - 1} exactly once (every rank "
                             f"holding the same number of tokens); missing {missing} (first 8). Give each "
                             f"rank the global indices of the tokens it holds, e.g. from the CP layout helpers")
        order = torch.argsort(everyone)
        identity = bool(torch.equal(everyone, torch.arange(total, device=everyone.device)))
        return cls(positions, everyone, order, identity)


def _as_positions(positions: torch.Tensor) -> torch.Tensor:
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be a 1-D integer tensor of a rank's global token indices; "
                         f"got shape {tuple(positions.shape)} and dtype {positions.dtype}")
    return positions.long()


def a2a_head_split(heads: int, groups: int, cp: int) -> str:
    """How ``a2a`` distributes KV heads: ``"split"`` (groups % cp == 0) or ``"replicate"`` (cp % groups
    == 0, each rank gets the one KV head its query heads read); refuses other combinations."""
    if heads % cp != 0:
        raise ValueError(f"a2a context parallelism splits the {heads} query heads over {cp} ranks: {heads} is "
                         f"not divisible by {cp}; pick a context parallel size dividing the heads, or use "
                         f"cp_comm_type 'p2p' or 'allgather'")
    if groups % cp == 0:
        return "split"
    if cp % groups == 0:
        return "replicate"
    raise ValueError(f"a2a context parallelism needs the {groups} KV groups divisible by the context parallel "
                     f"size {cp} (heads split) or {cp} divisible by {groups} (heads replicated); neither holds. "
                     f"Pick another context parallel size or cp_comm_type 'p2p' or 'allgather'")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard,
           attention_mask: Optional[torch.Tensor]) -> None:
    if q.dim() != 4 or v.shape[:3] != k.shape[:3] or k.shape[:2] != q.shape[:2] or k.size(3) != q.size(3):
        raise ValueError(f"expected q [s, b, heads, dqk], k [s, b, groups, dqk] and v [s, b, groups, dv]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.size(0) != shard.positions.numel():
        raise ValueError(f"q holds {q.size(0)} tokens but the shard names {shard.positions.numel()} positions; "
                         f"build the SequenceShard from this batch's layout")
    if q.size(2) % k.size(2) != 0:
        raise ValueError(f"{q.size(2)} query heads are not a multiple of {k.size(2)} KV groups")
    total = shard.all_positions.numel()
    if attention_mask is not None and tuple(attention_mask.shape[-2:]) != (total, total):
        raise ValueError(f"attention_mask must cover the global sequence, [b, 1, {total}, {total}] or "
                         f"[{total}, {total}] in global order; got {tuple(attention_mask.shape)}")


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup],
                  counter: Optional[CommCounter] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses' first all-to-all: q ``[s_local, b, heads, dqk]`` and k/v ``[s_local, b, groups, dqk | dv]`` ->
    every rank's tokens (rank-major) for heads/P query heads and their K/V heads (split, or replicated
    per query head when P > groups: :func:`a2a_head_split`)."""
    heads, groups = q.size(2), k.size(2)
    mode = a2a_head_split(heads, groups, group_size(group))
    q_h = seq_to_heads_all_to_all(q, group, counter)
    if mode == "split":
        return q_h, seq_to_heads_all_to_all(k, group, counter), seq_to_heads_all_to_all(v, group, counter)
    # repeated here, not after the exchange, so that backward sums the per-head gradients in one op
    rep = heads // groups
    k_h = replicated_kv_all_to_all(k.repeat_interleave(rep, dim=2), group, counter)
    v_h = replicated_kv_all_to_all(v.repeat_interleave(rep, dim=2), group, counter)
    return q_h, k_h, v_h


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard,
                  group: Optional[dist.ProcessGroup], *, backend: str = "auto",
                  attention_mask: Optional[torch.Tensor] = None, counter: Optional[CommCounter] = None,
                  dropout: Optional[AttentionDropout] = None, dropout_p: float = 0.0, window: Optional[int] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ulysses attention over ``group``: q/k ``[s_local, b, heads | groups, dqk]``, v ``[s_local, b, groups,
    dv]`` -> ``[s_local, b, heads * dv]``.

    Bit-identical to ``core_attention`` of the whole sequence in one process (same backend), for the
    output and the gradients: each rank runs exactly that computation for heads/P of the heads.
    ``heads`` must divide by P, and KV groups divide by P or P by the groups (``a2a_head_split``).
    ``dropout``: keyed attention dropout of this rank's heads (``dropout.heads`` before the split; rank
    j keeps heads/P of them, as the exchange does), the whole sequence's masks. ``dropout_p``: the
    backend's own masks instead (``core_attention``'s, from the model-parallel stream), which depend on
    the layout. ``window`` and ``sinks`` (``[heads]``, this rank's heads before the split): as
    ``core_attention``'s, the sinks of the heads the exchange leaves this rank.
    """
    _check(q, k, v, shard, attention_mask)
    cp, heads, d = group_size(group), q.size(2), v.size(3)
    q_h, k_h, v_h = scatter_heads(q, k, v, group, counter)
    reorder = not shard.is_identity
    if reorder:  # rank-major -> global order, so that causality and document masks read true positions
        q_h, k_h, v_h = (t.index_select(0, shard.order) for t in (q_h, k_h, v_h))
    out = core_attention(q_h, k_h, v_h, backend=backend, attention_mask=attention_mask, dropout_p=dropout_p,
                         dropout=a2a_dropout(dropout, group), window=window, sinks=a2a_sinks(sinks, group))
    total, b = out.size(0), out.size(1)
    out = out.view(total, b, heads // cp, d)
    if reorder:
        out = out.index_select(0, shard.all_positions)
    return heads_to_seq_all_to_all(out, group, counter).reshape(q.size(0), b, heads * d)


def a2a_dropout(dropout: Optional[AttentionDropout], group: Optional[dist.ProcessGroup]) -> Optional[AttentionDropout]:
    """The dropout of the heads the all-to-all over ``group`` leaves this rank (rank j: the j-th of P slices)."""
    if dropout is None or group_size(group) == 1:
        return dropout
    n, cp = dropout.heads.numel(), group_size(group)
    j = dist.get_rank(group)
    return dropout.select(heads=slice(j * n // cp, (j + 1) * n // cp))


def a2a_sinks(sinks: Optional[torch.Tensor], group: Optional[dist.ProcessGroup]) -> Optional[torch.Tensor]:
    """The sinks of the heads the all-to-all over ``group`` leaves this rank (rank j: the j-th of P slices)."""
    if sinks is None or group_size(group) == 1:
        return sinks
    n, cp, j = sinks.numel(), group_size(group), dist.get_rank(group)
    return sinks[j * n // cp:(j + 1) * n // cp]


def _allowed(shard: SequenceShard, total: int, attention_mask: Optional[torch.Tensor],
             window: Optional[int] = None) -> torch.Tensor:
    """Boolean "may attend" for this rank's queries against all keys in global order."""
    keys = torch.arange(total, device=shard.positions.device)
    allowed = shard.positions[:, None] >= keys[None, :]  # [s_local, S]
    if window is not None:
        allowed &= shard.positions[:, None] - keys[None, :] <= window
    if attention_mask is None:
        return allowed
    rows = attention_mask.to(torch.bool).index_select(-2, shard.positions.to(attention_mask.device))
    return allowed & ~rows  # [s_local, S] or [b, 1, s_local, S]


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard,
                        group: Optional[dist.ProcessGroup], *, backend: str = "auto",
                        attention_mask: Optional[torch.Tensor] = None, counter: Optional[CommCounter] = None,
                        layout: Optional[CPLayout] = None, dropout: Optional[AttentionDropout] = None,
                        dropout_p: float = 0.0, window: Optional[int] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-gather-KV attention over ``group``: q/k ``[s_local, b, heads | groups, dqk]``, v ``[s_local, b,
    groups, dv]`` -> ``[s_local, b, heads * dv]``.

    K/V (their ``groups`` heads, not repeated) are gathered along the sequence; backward
    reduce-scatters dK/dV. Given the ``layout`` the tokens were split by and no mask, each of this
    rank's chunks attends to the keys before it and (causally) to itself through the ring's block
    kernels (flash on CPU and CUDA): no mask, no scores held. Otherwise (a mask: packed documents)
    ``sdpa`` or ``math`` with an explicit mask from the global positions (``flash`` is refused).
    ``dropout``: keyed attention dropout (the math kernel's tiles, masks of the global positions).
    ``dropout_p``: the kernels' own masks (the block kernels', or sdpa's), from the model-parallel stream.
    ``window`` (the blocks or the mask) and ``sinks`` ``[heads]``: as ``core_attention``'s.
    """
    _check(q, k, v, shard, attention_mask)
    if dropout is not None and dropout_p > 0.0:
        raise ValueError("give attention dropout once: dropout_p (the kernels' masks) or dropout (keyed)")
    k_all, v_all = gather_sequence(k, group, counter), gather_sequence(v, group, counter)
    if not shard.is_identity:
        k_all, v_all = k_all.index_select(0, shard.order), v_all.index_select(0, shard.order)
    if layout is not None and attention_mask is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        k_runs = sorted((run for runs in layout.runs for run in runs), key=lambda run: run[1])  # global order
        return block_attention(q, k_all, v_all, layout.runs[rank], k_runs,
                               kernel="math" if backend == "math" else "auto", dropout=dropout, dropout_p=dropout_p,
                               window=window, sinks=sinks)
    if dropout is not None or sinks is not None:  # the math kernel's tiles, the mask sliced per tile
        allowed = _allowed(shard, k_all.size(0), attention_mask, window)
        keys = torch.arange(k_all.size(0), device=q.device)
        return dense_attention(q, k_all, v_all, dropout, positions=(shard.positions, keys), causal=False,
                               mask=~allowed, sinks=sinks, dropout_p=dropout_p)
    if backend == "flash":
        raise ValueError("allgather context-parallel attention with an attention mask needs a kernel that takes "
                         "one (queries at scattered positions); use backend 'auto', 'sdpa' or 'math'")
    chosen = resolve_backend("sdpa" if backend == "auto" else backend, q, True)
    s, b, heads, d = q.shape
    rep = heads // k.size(2)
    dv = v.size(3)
    k_all, v_all = (t.repeat_interleave(rep, dim=2) if rep > 1 else t for t in (k_all, v_all))
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k_all, v_all))  # [b, n, s, d]
    allowed = _allowed(shard, k_all.size(0), attention_mask, window)
    with get_rng_tracker().fork(device=q.device) if dropout_p > 0.0 else contextlib.nullcontext():
        if chosen == "sdpa":
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, dropout_p=dropout_p)
        else:  # the explicit formula, as core_attention's math backend computes it
            scores = torch.matmul(qq, kk.transpose(-1, -2)) * (1.0 / math.sqrt(d))
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(F.dropout(probs, dropout_p) if dropout_p > 0.0 else probs, vv)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * dv)


def a2a_elements(seq: int, heads: int, groups: int, head_dim: int, cp: int, batch: int = 1,
                 phase: str = "forward", v_head_dim: Optional[int] = None) -> int:
    """Elements one rank sends in one ``a2a_attention`` call: S (a + g) (dqk + dv) (P-1) / P^2 per
    sequence (q and k at ``head_dim`` = dqk, v and the output at ``v_head_dim`` = dv, default dqk).

    With KV heads replicated (cp % groups == 0), g counts as P forward (one KV head to each rank)
    and as ``heads`` backward (one gradient per query head, for a bit-exact sum).
    """
    if cp == 1:
        return 0
    mode = a2a_head_split(heads, groups, cp)
    kv = groups if mode == "split" else (cp if phase == "forward" else heads)
    dv = head_dim if v_head_dim is None else v_head_dim
    return batch * seq * (heads + kv) * (head_dim + dv) * (cp - 1) // (cp * cp)


def allgather_elements(seq: int, groups: int, head_dim: int, cp: int, batch: int = 1,
                       v_head_dim: Optional[int] = None) -> int:
    """Elements one rank receives in one ``allgather_attention`` call (forward: the K/V all-gather;
    backward: the dK/dV reduce-scatter, the same volume): S g (dqk + dv) (P-1) / P per sequence
    (K at ``head_dim`` = dqk, V at ``v_head_dim`` = dv, default dqk)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    return batch * seq * groups * (head_dim + dv) * (cp - 1) // cp
