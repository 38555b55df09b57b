"""The gated delta rule, the core of Gated DeltaNet (Qwen3-Next / Qwen3.5's linear-attention layers), in PyTorch.

Per batch row and head the state ``S`` is a ``[dk, dv]`` matrix; for t = 1..T

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = scale * S_t^T q_t

(the same recurrence as transformers' ``torch_recurrent_gated_delta_rule``; q and k arrive normalised). Inputs use
the ``[B, T, H, D]`` layout. ``starts[b, t]`` marks where a packed document begins: the state entering step t is
replaced by zero there, so nothing before a start reaches any output at or after it, exactly (masks, not large
negative decays).

:func:`chunk_gated_delta_rule` is the training form: within a chunk of ``C`` tokens the delta-rule updates are
condensed by the UT transform (one unit lower-triangular solve) into matmuls, and only the ``[dk, dv]`` state is
carried from chunk to chunk. :func:`recurrent_gated_delta_rule` is the token loop (the reference, and one decoding
step). :func:`gated_delta_transition` gives the linear map a segment applies to the state entering it, so that
segments computed apart (context parallelism) can be chained: ``S_end = M @ S_in + S_end(S_in = 0)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_transition"]


def _check(q: Tensor | None, k: Tensor, v: Tensor | None, g: Tensor, beta: Tensor,
           initial_state: Tensor | None, starts: Tensor | None) -> None:
    """Raise ValueError naming the first argument whose shape or dtype does not fit the others."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, dk] (the bshd layout); got shape {tuple(k.shape)}")
    B, T, H, dk = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q must have k's shape {tuple(k.shape)}; got {tuple(q.shape)}")
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be [B, T, H, dv] = [{B}, {T}, {H}, dv] like k; got {tuple(v.shape)} "
                         "(repeat grouped q/k heads to v's head count before calling)")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = {(B, T, H)}; got {tuple(x.shape)}")
    dv = v.shape[-1] if v is not None else dk
    if initial_state is not None and initial_state.shape != (B, H, dk, dv):
        raise ValueError(f"initial_state must be [B, H, dk, dv] = {(B, H, dk, dv)}; got {tuple(initial_state.shape)}")
    if starts is not None and (starts.shape != (B, T) or starts.dtype != torch.bool):
        raise ValueError(f"starts must be a bool tensor [B, T] = {(B, T)}; got {starts.dtype} {tuple(starts.shape)}")


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64 (for exact tests); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _heads_first(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, T, H, ...] -> [B, H, T, ...] in ``dtype``, contiguous (so a chunk's arithmetic does not depend on T)."""
    return x.transpose(1, 2).to(dtype).contiguous()


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               scale: float | None = None, initial_state: Tensor | None = None,
                               starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule step by step: the reference, and one decoding step when T == 1.

    Same arguments and results as :func:`chunk_gated_delta_rule`; computes in float64 when q is float64, else in
    float32 (the returned state has that dtype)."""
    _check(q, k, v, g, beta, initial_state, starts)
    B, T, H, dk = k.shape
    dtype, out_dtype = _compute_dtype(q), v.dtype
    scale = dk ** -0.5 if scale is None else scale
    q, k, v = (_heads_first(x, dtype) for x in (q, k, v))
    alpha, beta = _heads_first(g, dtype).exp(), _heads_first(beta, dtype)
    if initial_state is None:
        state = k.new_zeros(B, H, dk, v.shape[-1])
    else:
        state = initial_state.to(dtype)
    out = []
    for t in range(T):
        if starts is not None:  # a new document: forget the state entering step t
            state = torch.where(starts[:, t, None, None, None], torch.zeros_like(state), state)
        k_t = k[:, :, t].unsqueeze(-1)  # [B, H, dk, 1]
        state = alpha[:, :, t, None, None] * state
        predicted = (k_t.transpose(-1, -2) @ state).squeeze(-2)  # S^T k: what the state recalls for k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k_t * delta.unsqueeze(-2)
        out.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2) * scale)
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, H, v.shape[-1])
    return o.to(out_dtype), state


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


def _chunked_scan(q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                  starts: Tensor | None, chunk_size: int) -> tuple[Tensor | None, Tensor]:
    """The chunked gated delta rule on heads-first tensors (q [B,H,T,dk] already scaled, or None for the state
    only; k [B,H,T,dk]; v [B,H,T,dv]; g, beta [B,H,T]; state [B,H,dk,dv]; starts [B,T] bool or None), all in the
    compute dtype. Returns (o [B,H,T,dv] or None, final state)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens; got {chunk_size}")
    B, H, T, dk = k.shape
    dv, C = v.shape[-1], chunk_size
    pad = -T % C
    q, k, v = (_pad_to_chunks(x, pad, 2) for x in (q, k, v))
    g, beta, starts = _pad_to_chunks(g, pad, 2), _pad_to_chunks(beta, pad, 2), _pad_to_chunks(starts, pad, 1)
    N = (T + pad) // C
    k, v = k.reshape(B, H, N, C, dk), v.reshape(B, H, N, C, dv)
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    pair, keep = _chunk_masks(starts, B, N, C, k.device)

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

    # UT transform: (I + A) [u | w] = [beta v | beta decay_in k] with A_ij = beta_i k_i.k_j decay_ij (i > j); then
    # the tokens' state writes are v_new = u - w S, S being the state entering the chunk.
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * decay_in.unsqueeze(-1)], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    k_out = (k * decay_out.unsqueeze(-1)).transpose(-1, -2)  # [B,H,N,dk,C]

    entering, writes = [], []
    # Only the [dk, dv] state crosses chunk boundaries. unbind, not indexing: its backward stacks the chunks'
    # gradients once, where each index's would fill a full-size zero tensor (quadratic in the chunks).
    for u_n, w_n, decay_n, k_n in zip(u.unbind(2), w.unbind(2), chunk_decay[..., None, None].unbind(2),
                                      k_out.unbind(2)):
        entering.append(state)
        v_new = u_n - w_n @ state
        writes.append(v_new)
        state = decay_n * state + k_n @ v_new
    if q is None:
        return None, state
    q = q.reshape(B, H, N, C, dk)
    attn = (q @ k.transpose(-1, -2)) * decay
    o = (q * decay_in.unsqueeze(-1)) @ torch.stack(entering, 2) + attn @ torch.stack(writes, 2)
    return o.reshape(B, H, N * C, dv)[:, :, :T], state


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                           initial_state: Tensor | None = None, starts: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule, chunk by chunk (differentiable).

    q, k [B, T, H, dk]; v [B, T, H, dv]; g [B, T, H] (log decay, <= 0); beta [B, T, H]. q and k are already
    normalised (no l2norm here); q is multiplied by ``scale`` (default dk ** -0.5). initial_state [B, H, dk, dv]
    (None: zeros). starts [B, T] bool: True where a document begins (the state entering t is zeroed; a start at
    t = 0 drops initial_state). T need not divide by ``chunk_size``. Returns (o [B, T, H, dv] in v's dtype, final
    state [B, H, dk, dv]); computes in float32, or float64 when q is float64 (the state then is float64)."""
    _check(q, k, v, g, beta, initial_state, starts)
    B, T, H, dk = k.shape
    dtype, out_dtype = _compute_dtype(q), v.dtype
    scale = dk ** -0.5 if scale is None else scale
    state = k.new_zeros(B, H, dk, v.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    q, k, v, g, beta = (_heads_first(x, dtype) for x in (q, k, v, g, beta))
    o, state = _chunked_scan(q * scale, k, v, g, beta, state, starts, chunk_size)
    return o.transpose(1, 2).to(out_dtype), state


def gated_delta_transition(k: Tensor, g: Tensor, beta: Tensor, *, starts: Tensor | None = None,
                           chunk_size: int = 64) -> Tensor:
    """M [B, H, dk, dk] with final_state(initial_state=S0) == M @ S0 + final_state(initial_state=0) for the same
    k, g, beta, starts (and any q, v): the linear map a segment applies to the state entering it. M is exactly 0 for
    a batch row whose ``starts`` has any True. float32, or float64 when k is float64.

    S0 reaches the final state only through the product of the steps' exp(g) (I - beta k k^T), which v does not
    touch: M is the chunked rule's final state for v = 0 (of width dk) entering with S0 = I."""
    _check(None, k, None, g, beta, None, starts)
    B, T, H, dk = k.shape
    dtype = _compute_dtype(k)
    k, g, beta = (_heads_first(x, dtype) for x in (k, g, beta))
    identity = torch.eye(dk, dtype=dtype, device=k.device).expand(B, H, dk, dk)
    return _chunked_scan(None, k, torch.zeros_like(k), g, beta, identity, starts, chunk_size)[1]
