"""The Mamba-2 selective state space scan (state space duality, SSD), chunked, in pure PyTorch.

Per head h with scalar ``A_h < 0`` and a state ``S [P, N]``:

    S_t = exp(Δ_t A_h) S_{t-1} + Δ_t x_t B_tᵀ,        y_t = S_t C_t + D_h x_t

``B`` and ``C`` belong to groups: head h reads group ``h // (H / G)`` (transformers' ``repeat_interleave``).
``chunk_ssd_scan`` computes this in chunks of ``chunk_size`` tokens: inside a chunk as a masked
attention-like product (the decay matrix ``L[l, s] = exp(Δ_{s+1} A + ... + Δ_l A)``), between chunks by a short
loop over chunks (not tokens) that carries the state. ``recurrent_ssd_scan`` is the step-by-step reference and the
one-token decoding step. ``ssd_transition`` gives the scalar per head that maps a piece's initial state onto its
final state, so pieces of a sequence (context parallel ranks) can be scanned from zero and combined.

Packed documents (``starts``): a start at t drops the state before t. The chunked scan zeroes every cross-document
term by multiplying with exact zeros (masked decay matrix, masked carried state, masked chunk decay), so a
document's outputs and final state do not depend, bit for bit, on the inputs of the documents before it.

Everything is computed in fp32 (float64 when ``x`` is float64); ``y`` is returned in ``x``'s dtype and the state
in the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_ssd_scan", "recurrent_ssd_scan", "ssd_delta", "ssd_transition"]


def ssd_delta(dt: Tensor, dt_bias: Tensor, *, dt_limit: tuple[float, float] = (0.0, math.inf)) -> Tensor:
    """Δ = softplus(dt + dt_bias), clamped to ``dt_limit`` like transformers' ``mamba2_chunk_scan`` (the default
    ``(0, inf)`` changes nothing). dt [..., H], dt_bias [H]. Computed and returned in fp32 (float64 given float64):
    transformers' torch path adds and softpluses in dt's dtype (bf16 in a bf16 model), mamba_ssm's kernels in fp32
    as here; the two agree exactly for fp32 dt."""
    dtype = _compute_dtype(dt)
    delta = F.softplus(dt.to(dtype) + dt_bias.to(dtype))
    if dt_limit != (0.0, math.inf):
        delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])
    return delta


def chunk_ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
                   initial_state: Tensor | None = None, starts: Tensor | None = None,
                   chunk_size: int = 128) -> tuple[Tensor, Tensor]:
    """x [b,T,H,P], dt [b,T,H] (already softplus'ed Δ, > 0), A [H] (negative), B,C [b,T,G,N] with H % G == 0, D [H] or None.
    initial_state [b,H,P,N] (None: zeros). starts [b,T] bool: True where a new document begins at t (the state before t is
    dropped; a start at t=0 drops initial_state). Returns (y [b,T,H,P] in x's dtype, final_state [b,H,P,N] fp32).
    Computes in fp32 (float64 when given float64).

    T need not be a multiple of ``chunk_size``: the tail is padded with Δ = 0 (no decay, no input). Chunks are
    ``min(chunk_size, T)`` tokens long."""
    b, T, H, P, G, N = _check(x, dt, A, B, C, D, initial_state, starts)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    dtype = _compute_dtype(x)
    state = _initial(initial_state, x, b, H, P, N, dtype)
    if T == 0:
        return x.new_empty(x.shape), state
    Q = min(chunk_size, T)
    pad = (-T) % Q
    c, R = (T + pad) // Q, H // G

    # Chunked views; heads split as (G, R) so a group's B and C serve its R heads without being repeated, and kept
    # token-major ([b,c,Q,G,R,P], x's layout) where a product can fold the R heads into one matrix:
    # a [b,c,G,R,Q], xdt [b,c,Q,G,R,P], Bq/Cq [b,c,G,Q,N].
    a = F.pad(dt.to(dtype) * A.to(dtype), (0, 0, 0, pad)).view(b, c, Q, G, R).permute(0, 1, 3, 4, 2)
    xdt = F.pad(x.to(dtype) * dt.to(dtype)[..., None], (0, 0, 0, 0, 0, pad)).view(b, c, Q, G, R, P)
    Bq = F.pad(B.to(dtype), (0, 0, 0, 0, 0, pad)).view(b, c, Q, G, N).transpose(2, 3)
    Cq = F.pad(C.to(dtype), (0, 0, 0, 0, 0, pad)).view(b, c, Q, G, N).transpose(2, 3)

    # Intra-chunk decay, kept transposed (Lt[s, l] = L[l, s]) so its cumulative sum runs along the contiguous last
    # dim: L[l, s] = exp(a_{s+1} + ... + a_l) for s <= l in the same document, else exactly 0.
    Lt = torch.exp(_segsum_t(a)) * _pair_mask_t(starts, b, T, pad, c, Q, x.device, dtype)  # [b,c,G,R,Q,Q]
    y_diag = ((Bq @ Cq.transpose(-1, -2))[:, :, :, None] * Lt).transpose(-1, -2) @ xdt.permute(0, 1, 3, 4, 2, 5)

    # What each chunk adds to the state at its end (L's last row: decay to the chunk end, 0 before the last start).
    to_end = xdt * Lt[..., -1].permute(0, 1, 4, 2, 3)[..., None]
    chunk_states = (to_end.view(b, c, Q, G, R * P).permute(0, 1, 3, 4, 2) @ Bq).view(b, c, G, R, P, N)

    # Decay of a state across the chunk, and onto each of its tokens; exactly 0 across a start.
    carry = torch.exp(a.cumsum(-1))
    if starts is not None:
        before_start = (F.pad(starts, (0, pad)).view(b, c, Q).cumsum(-1) == 0).to(dtype)[:, :, None, None, :]
        carry = carry * before_start
    chunk_decay = carry[..., -1]  # [b,c,G,R]

    # Loop over chunks (T / chunk_size steps): the state entering each chunk. A sequential sum makes a split at a
    # chunk boundary, continued from the first part's final state, repeat the whole run's arithmetic.
    # unbind, not indexing: its backward stacks the gradients once instead of a full-size zero tensor per chunk.
    state = state.view(b, G, R, P, N)
    entering = []
    for decay, added in zip(chunk_decay[..., None, None].unbind(1), chunk_states.unbind(1)):
        entering.append(state)
        state = decay * state + added
    entering = torch.stack(entering, dim=1).view(b, c, G, R * P, N)

    y_off = (Cq @ entering.transpose(-1, -2)).view(b, c, G, Q, R, P) * carry.transpose(-1, -2)[..., None]
    y = (y_diag.permute(0, 1, 4, 2, 3, 5) + y_off.transpose(2, 3)).reshape(b, c * Q, H, P)[:, :T]
    if D is not None:
        y = y + x.to(dtype) * D.to(dtype)[:, None]
    return y.to(x.dtype), state.reshape(b, H, P, N)


def recurrent_ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
                       initial_state: Tensor | None = None, starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The same step by step: the reference, and one decoding step when T == 1.

    Shapes, dtypes and ``starts`` as in ``chunk_ssd_scan``; a Python loop over the T tokens."""
    b, T, H, P, G, N = _check(x, dt, A, B, C, D, initial_state, starts)
    dtype = _compute_dtype(x)
    state = _initial(initial_state, x, b, H, P, N, dtype)
    R = H // G
    xs, dts, A = x.to(dtype), dt.to(dtype), A.to(dtype)
    Bh = B.to(dtype).repeat_interleave(R, dim=2)  # [b,T,H,N]
    Ch = C.to(dtype).repeat_interleave(R, dim=2)
    keep = None if starts is None else (~starts).to(dtype)
    ys = []
    for t in range(T):
        if keep is not None:
            state = state * keep[:, t, None, None, None]
        decay = torch.exp(dts[:, t] * A)[..., None, None]  # [b,H,1,1]
        state = decay * state + (dts[:, t, :, None] * xs[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state @ Ch[:, t, :, :, None]).squeeze(-1))
    y = torch.stack(ys, dim=1) if ys else xs.new_empty(xs.shape)
    if D is not None:
        y = y + xs * D.to(dtype)[:, None]
    return y.to(x.dtype), state


def ssd_transition(dt: Tensor, A: Tensor, *, starts: Tensor | None = None) -> Tensor:
    """M [b,H] fp32 with final_state(S0) == M[...,None,None] * S0 + final_state(0): exp(sum_t Δ_t A), 0 where starts has any True.

    dt [b,T,H] (Δ), A [H]; float64 when dt is float64. Equality holds up to rounding: the scan multiplies its
    decays chunk by chunk, this exponentiates one sum."""
    dtype = _compute_dtype(dt)
    M = torch.exp((dt.to(dtype) * A.to(dtype)).sum(dim=1))
    if starts is not None:
        M = M * (~starts.any(dim=1)).to(dtype)[:, None]
    return M


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _initial(initial_state: Tensor | None, x: Tensor, b: int, H: int, P: int, N: int, dtype: torch.dtype) -> Tensor:
    if initial_state is None:
        return torch.zeros(b, H, P, N, dtype=dtype, device=x.device)
    return initial_state.to(dtype)


def _segsum_t(a: Tensor) -> Tensor:
    """a [..., Q] -> [..., Q, Q] with out[..., s, l] = a[s+1] + ... + a[l] for s < l, and 0 on and below the diagonal.

    Each entry is a cumulative sum started at s (not a difference of two prefix sums), so a decay near 1 keeps its
    precision however long the chunk: transformers' ``segment_sum`` transposed (its cumulative sum along the last,
    contiguous dim is several times faster forward and backward on CPU), with 0 instead of -inf where masked (the
    mask that multiplies ``exp`` of it removes those)."""
    Q = a.size(-1)
    above = torch.ones(Q, Q, dtype=torch.bool, device=a.device).triu(1)
    return a[..., None, :].expand(*a.shape[:-1], Q, Q).masked_fill(~above, 0).cumsum(dim=-1)


def _pair_mask_t(starts: Tensor | None, b: int, T: int, pad: int, c: int, Q: int, device: torch.device,
                 dtype: torch.dtype) -> Tensor:
    """[b or 1, c or 1, 1, 1, Q, Q]: at [s, l] 1 where s <= l and tokens l, s are in the same document, else 0."""
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).triu()
    if starts is None:
        return causal.to(dtype)
    doc = F.pad(starts.to(torch.int32), (0, pad)).cumsum(dim=1).view(b, c, Q)
    same = (doc[..., :, None] == doc[..., None, :]) & causal
    return same.to(dtype)[:, :, None, None]


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, initial_state: Tensor | None,
           starts: Tensor | None) -> tuple[int, int, int, int, int, int]:
    if x.dim() != 4 or B.dim() != 4:
        raise ValueError(f"x must be [b,T,H,P] and B, C [b,T,G,N]; got x {tuple(x.shape)}, B {tuple(B.shape)}")
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    shapes = {"dt": (dt, (b, T, H)), "A": (A, (H,)), "B": (B, (b, T, G, N)), "C": (C, (b, T, G, N)),
              "D": (D, (H,)), "initial_state": (initial_state, (b, H, P, N)), "starts": (starts, (b, T))}
    for name, (t, want) in shapes.items():
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want} from x {tuple(x.shape)} and "
                             f"B {tuple(B.shape)}")
    if G == 0 or H % G:
        raise ValueError(f"the {H} heads must split evenly into the {G} B/C groups (H % G == 0)")
    if starts is not None and starts.dtype != torch.bool:
        raise ValueError(f"starts must be a bool tensor (True where a document begins), got {starts.dtype}")
    return b, T, H, P, G, N
