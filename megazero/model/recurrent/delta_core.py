"""The delta rule with a diagonal decay, token by token and chunk by chunk: what Gated DeltaNet (one decay per head,
``delta_rule.py``) and Kimi Delta Attention (one decay per key channel, ``kda_rule.py``) share.

Per batch row and head the state ``S`` is a ``[dk, dv]`` matrix; for t = 1..T

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,        o_t = scale * S_t^T q_t

the decay first, then the delta update on the decayed state (FLA's ``naive_recurrent_kda`` and transformers'
rules; with one decay per head the two commute). Here every tensor is heads-first (``[B, H, T, ...]``) in the
compute dtype, ``g`` ``[B, H, T, 1]`` (one decay per head) or ``[B, H, T, dk]``. ``starts[b, t]`` marks where a
packed document begins: the state entering step t is replaced by zero there, exactly (masks, not large negative
decays).

:func:`chunked_scan`: within a chunk of ``C`` tokens the updates are condensed by the UT transform (one unit
lower-triangular solve) into matmuls, and only the ``[dk, dv]`` state crosses chunk boundaries. Only the
intra-chunk decays differ between the two kinds: one per head is a ``[C, C]`` matrix of exact per-pair sums; one
per channel would be ``[C, C, dk]``, so the chunk splits into sub-chunks (64 -> 4 x 16 -> 16 x 4 tokens): pairs
across sub-chunks factor at the later sub-chunk's start into two decays that are both <= 1 (no overflow, whatever
the decay; g <= 0), pairs within the 4-token leaves sum their decays pair by pair. Every log decay is a sum of the
g's it spans (no difference of long prefix sums, which would cancel). Against transformers' ``[C, C, dk]`` form this
is ~10x faster on the CPU (``benchmarks/bench_delta_rule.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["check_inputs", "compute_dtype", "heads_first", "token_loop", "chunked_scan"]

SPLIT = 4  # sub-chunks per level of the per-channel decays
LEAF = 4  # at most this many tokens: every pair's per-channel decay summed on its own


def check_inputs(q: Tensor | None, k: Tensor, v: Tensor | None, g: Tensor, beta: Tensor,
                 initial_state: Tensor | None, starts: Tensor | None, *, per_channel: bool) -> None:
    """Raise ValueError naming the first argument (``[B, T, H, ...]`` layout) whose shape or dtype does not fit.
    ``per_channel``: g is ``[B, T, H, dk]`` (else ``[B, T, H]``)."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, dk] (the bshd layout); got shape {tuple(k.shape)}")
    B, T, H, dk = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q must have k's shape {tuple(k.shape)}; got {tuple(q.shape)}")
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be [B, T, H, dv] = [{B}, {T}, {H}, dv] like k; got {tuple(v.shape)} "
                         "(repeat grouped q/k heads to v's head count before calling)")
    g_shape = (B, T, H, dk) if per_channel else (B, T, H)
    if g.shape != g_shape:
        name = "[B, T, H, dk]" if per_channel else "[B, T, H]"
        raise ValueError(f"g must be {name} = {g_shape}; got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got {tuple(beta.shape)}")
    dv = v.shape[-1] if v is not None else dk
    if initial_state is not None and initial_state.shape != (B, H, dk, dv):
        raise ValueError(f"initial_state must be [B, H, dk, dv] = {(B, H, dk, dv)}; got {tuple(initial_state.shape)}")
    if starts is not None and (starts.shape != (B, T) or starts.dtype != torch.bool):
        raise ValueError(f"starts must be a bool tensor [B, T] = {(B, T)}; got {starts.dtype} {tuple(starts.shape)}")


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64 (for exact tests); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def heads_first(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, T, H, ...] -> [B, H, T, ...] in ``dtype``, contiguous (so a chunk's arithmetic does not depend on T)."""
    return x.transpose(1, 2).to(dtype).contiguous()


def token_loop(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, state: Tensor, starts: Tensor | None,
               scale: float) -> tuple[Tensor, Tensor]:
    """The rule step by step (q, k [B,H,T,dk]; v [B,H,T,dv]; alpha = exp(g) [B,H,T,1 or dk]; beta [B,H,T]; state
    [B,H,dk,dv]; starts [B,T] or None) -> (o [B,T,H,dv], final state), in the inputs' dtype."""
    B, H, T, _ = k.shape
    out = []
    for t in range(T):
        if starts is not None:  # a new document: forget the state entering step t
            state = torch.where(starts[:, t, None, None, None], torch.zeros_like(state), state)
        k_t = k[:, :, t].unsqueeze(-1)  # [B, H, dk, 1]
        state = alpha[:, :, t, :, None] * state
        predicted = (k_t.transpose(-1, -2) @ state).squeeze(-2)  # S^T k: what the state recalls for k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k_t * delta.unsqueeze(-2)
        out.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2) * scale)
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, v.shape[-1])
    return o, state


def _pad_to_chunks(x: Tensor | None, pad: int, dim: int) -> Tensor | None:
    """Zero-pad ``x`` by ``pad`` positions at the end of dimension ``dim`` (g = beta = 0 there: the state is kept)."""
    if x is None or not pad:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]
    return F.pad(x, widths)


def _chunk_masks(starts: Tensor | None, B: int, N: int, C: int, device: torch.device):
    """(pair, keep): pair [B or 1, 1, N or 1, C, C] bool, True where token i may see token j (j <= i, same
    document); keep [B, 1, N, C] bool (None without starts), True where token i still reads the state entering the
    chunk (no start at or before i within the chunk)."""
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    if starts is None:
        return causal, None
    seen = starts.reshape(B, N, C).cumsum(-1)  # starts at or before i within the chunk
    same_doc = seen.unsqueeze(-1) == seen.unsqueeze(-2)
    return (causal & same_doc).unsqueeze(1), (seen == 0).unsqueeze(1)


def _head_decays(q: Tensor | None, k: Tensor, k_beta: Tensor, g: Tensor, pair: Tensor, keep: Tensor | None):
    """One decay per head (g [B,H,N,C]): (system, attn or None, decay_in [..,C,1], decay_out [..,C,1],
    chunk_decay [..,1]); see :func:`chunked_scan`."""
    C = g.shape[-1]
    # Log decay from just after j to i: a cumulative sum over i of g_i [i > j], so it starts from an exact zero at j
    # (more accurate than the difference of two long prefix sums, and blind to anything before a document's start).
    after = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    log_decay = g.unsqueeze(-1).masked_fill(~after, 0).cumsum(-2)
    decay = log_decay.masked_fill(~pair, float("-inf")).exp()  # [B,H,N,C,C]: 0 off the same-document lower triangle
    decay_in = g.cumsum(-1).exp()  # chunk start -> i, for reading the state entering the chunk
    chunk_decay = decay_in[..., -1]
    decay_out = decay[..., -1, :]  # after j -> chunk end; 0 for tokens before the chunk's last start
    if keep is not None:
        decay_in, chunk_decay = decay_in * keep, chunk_decay * keep[..., -1]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    attn = None if q is None else (q @ k.transpose(-1, -2)) * decay
    return system, attn, decay_in.unsqueeze(-1), decay_out.unsqueeze(-1), chunk_decay.unsqueeze(-1)


def _suffix(g: Tensor, dim: int) -> Tensor:
    """sum of g over the positions after each one along ``dim`` (exclusive; 0 at the last), without cancellation."""
    inclusive = g.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([inclusive.narrow(dim, 1, g.size(dim) - 1), torch.zeros_like(inclusive.narrow(dim, 0, 1))], dim)


def _leaf_pairs(rows: list[Tensor], k: Tensor, g: Tensor) -> list[Tensor]:
    """:func:`_channel_pairs` of a few tokens: every pair's decay summed on its own (a ``[C, C, dk]`` tensor)."""
    C = g.shape[-2]
    opts = dict(dtype=torch.bool, device=g.device)
    after = torch.ones(C, C, **opts).triu(1)  # [j, m]: m > j
    within = g.transpose(-1, -2).unsqueeze(-3).masked_fill(~after[:, None, :], 0).cumsum(-1)  # [.., j, dk, i]
    lead = range(g.dim() - 2)
    k_within = within.permute(*lead, -1, -3, -2).exp() * k.unsqueeze(-3)  # [.., i, j, dk]; i < j: dropped below
    pairs = k_within @ torch.stack(rows, -1)  # [.., i, j, rows]
    causal = torch.ones(C, C, **opts).tril()
    return [pairs[..., n].masked_fill(~causal, 0) for n in range(len(rows))]


def _channel_pairs(rows: list[Tensor], k: Tensor, g: Tensor) -> list[Tensor]:
    """sum_d rows_i[d] k_j[d] exp(sum_{j < m <= i} g_m[d]) for j <= i (0 above the diagonal) for each of ``rows``
    ([.., C, dk]), with k, g [.., C, dk] (g <= 0): [.., C, C] each.

    The C tokens split into SPLIT sub-chunks: a pair across sub-chunks (j in J < I, i in I) factors at the start
    of I into exp(g over (start_I, i]) * exp(g over (j, start_I]), both <= 1, so one matmul per sub-chunk takes
    all of them; pairs within a sub-chunk recurse, down to LEAF tokens summed pair by pair. Every exponent is a sum
    of the g's it spans (no cancellation); factors of pairs outside the triangle are finite and dropped by masks."""
    *lead, C, dk = g.shape
    if C <= LEAF or C % SPLIT:
        return _leaf_pairs(rows, k, g)
    S, sub = SPLIT, C // SPLIT
    split = lambda x: x.reshape(*lead, S, sub, dk)
    gs = split(g)
    opts = dict(dtype=torch.bool, device=g.device)
    into = gs.cumsum(-2)  # start of the sub-chunk -> i (inclusive)
    out_of = _suffix(gs, -2)  # after j -> end of its sub-chunk
    later = torch.ones(S, S, **opts).triu(1)  # [J, s]: s > J
    up_to = into[..., -1, :].unsqueeze(-3).masked_fill(~later[..., None], 0).cumsum(-2)  # [.., J, s]: J < s' <= s
    between = torch.cat([torch.zeros_like(up_to[..., :1, :]), up_to[..., :-1, :]], -2)  # [.., J, I]: J < s < I
    to_start = out_of.unsqueeze(-4) + between.transpose(-3, -2).unsqueeze(-2)  # [.., I, J, sub, dk]
    k_to_start = (k.unsqueeze(-3) * to_start.reshape(*lead, S, C, dk).exp()).transpose(-1, -2)  # [.., I, dk, C]
    inside = _channel_pairs([split(r) for r in rows], split(k), gs)  # [.., S, sub, sub] each
    earlier = torch.ones(S, S, **opts).tril(-1)[:, None, :, None]  # [I, i, J, j]: J < I
    on_block = torch.eye(S, dtype=torch.bool, device=g.device)[:, None, :, None]  # [I, i, J, j]: J == I
    out = []
    for r, own in zip(rows, inside):
        across = ((split(r) * into.exp()) @ k_to_start).reshape(*lead, S, sub, S, sub)
        pairs = torch.where(earlier, across, own.unsqueeze(-2).masked_fill(~on_block, 0))
        out.append(pairs.reshape(*lead, C, C))
    return out


def _channel_decays(q: Tensor | None, k: Tensor, k_beta: Tensor, g: Tensor, pair: Tensor, keep: Tensor | None):
    """One decay per key channel (g [B,H,N,C,dk]): as :func:`_head_decays`, decays [..,C,dk] and [..,dk]."""
    pairs = _channel_pairs([k_beta] if q is None else [k_beta, q], k, g)
    if keep is not None:  # documents: nothing crosses a start
        pairs = [p.masked_fill(~pair, 0) for p in pairs]
    system, attn = pairs[0], (pairs[1] if q is not None else None)
    decay_in = g.cumsum(-2).exp()  # chunk start -> i
    chunk_decay = decay_in[..., -1, :]
    out_log = _suffix(g, -2)  # after j -> chunk end
    if keep is not None:
        out_log = out_log.masked_fill(~pair[..., -1, :, None], float("-inf"))  # tokens before the chunk's last start
        decay_in, chunk_decay = decay_in * keep[..., None], chunk_decay * keep[..., -1, None]
    return system, attn, decay_in, out_log.exp(), chunk_decay


def chunked_scan(q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                 starts: Tensor | None, chunk_size: int) -> tuple[Tensor | None, Tensor]:
    """The chunked rule on heads-first tensors (q [B,H,T,dk] already scaled, or None for the state only; k
    [B,H,T,dk]; v [B,H,T,dv]; g [B,H,T,1] (one decay per head) or [B,H,T,dk]; beta [B,H,T]; state [B,H,dk,dv];
    starts [B,T] bool or None), all in the compute dtype. Returns (o [B,H,T,dv] or None, final state)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens; got {chunk_size}")
    B, H, T, dk = k.shape
    dv, C = v.shape[-1], chunk_size
    pad = -T % C
    q, k, v, g = (_pad_to_chunks(x, pad, 2) for x in (q, k, v, g))
    beta, starts = _pad_to_chunks(beta, pad, 2), _pad_to_chunks(starts, pad, 1)
    N = (T + pad) // C
    k, v, g = k.reshape(B, H, N, C, dk), v.reshape(B, H, N, C, dv), g.reshape(B, H, N, C, g.shape[-1])
    beta = beta.reshape(B, H, N, C)
    q = None if q is None else q.reshape(B, H, N, C, dk)
    pair, keep = _chunk_masks(starts, B, N, C, k.device)
    k_beta = k * beta.unsqueeze(-1)
    if g.shape[-1] == 1:
        system, attn, decay_in, decay_out, chunk_decay = _head_decays(q, k, k_beta, g.squeeze(-1), pair, keep)
    else:
        system, attn, decay_in, decay_out, chunk_decay = _channel_decays(q, k, k_beta, g, pair, keep)

    # UT transform: (I + A) [u | w] = [beta v | beta decay_in k] with A_ij = beta_i k_i.k_j decayed (i > j); then
    # the tokens' state writes are v_new = u - w S, S being the state entering the chunk.
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * decay_in], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    k_out = (k * decay_out).transpose(-1, -2)  # [B,H,N,dk,C]

    entering, writes = [], []
    # Only the [dk, dv] state crosses chunk boundaries. unbind, not indexing: its backward stacks the chunks'
    # gradients once, where each index's would fill a full-size zero tensor (quadratic in the chunks).
    for u_n, w_n, decay_n, k_n in zip(u.unbind(2), w.unbind(2), chunk_decay[..., None].unbind(2), k_out.unbind(2)):
        entering.append(state)
        v_new = u_n - w_n @ state
        writes.append(v_new)
        state = decay_n * state + k_n @ v_new
    if q is None:
        return None, state
    o = (q * decay_in) @ torch.stack(entering, 2) + attn @ torch.stack(writes, 2)
    return o.reshape(B, H, N * C, dv)[:, :, :T], state
