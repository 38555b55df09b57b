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
segments computed apart (context parallelism) can be chained: ``S_end = M @ S_in + S_end(S_in = 0)``. The token
loop and the chunk scan are ``delta_core.py``'s, shared with Kimi Delta Attention (``kda_rule.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .delta_core import check_inputs, chunked_scan, compute_dtype, heads_first, token_loop

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_transition"]


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               scale: float | None = None, initial_state: Tensor | None = None,
                               starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule step by step: the reference, and one decoding step when T == 1.

    Same arguments and results as :func:`chunk_gated_delta_rule`; computes in float64 when q is float64, else in
    float32 (the returned state has that dtype)."""
    check_inputs(q, k, v, g, beta, initial_state, starts, per_channel=False)
    B, T, H, dk = k.shape
    dtype, out_dtype = compute_dtype(q), v.dtype
    scale = dk ** -0.5 if scale is None else scale
    q, k, v = (heads_first(x, dtype) for x in (q, k, v))
    alpha, beta = heads_first(g, dtype).exp().unsqueeze(-1), heads_first(beta, dtype)
    state = k.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    o, state = token_loop(q, k, v, alpha, beta, state, starts, scale)
    return o.to(out_dtype), state


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                           initial_state: Tensor | None = None, starts: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule, chunk by chunk (differentiable).

    q, k [B, T, H, dk]; v [B, T, H, dv]; g [B, T, H] (log decay, <= 0); beta [B, T, H]. q and k are already
    normalised (no l2norm here); q is multiplied by ``scale`` (default dk ** -0.5). initial_state [B, H, dk, dv]
    (None: zeros). starts [B, T] bool: True where a document begins (the state entering t is zeroed; a start at
    t = 0 drops initial_state). T need not divide by ``chunk_size``. Returns (o [B, T, H, dv] in v's dtype, final
    state [B, H, dk, dv]); computes in float32, or float64 when q is float64 (the state then is float64)."""
    check_inputs(q, k, v, g, beta, initial_state, starts, per_channel=False)
    B, T, H, dk = k.shape
    dtype, out_dtype = compute_dtype(q), v.dtype
    scale = dk ** -0.5 if scale is None else scale
    state = k.new_zeros(B, H, dk, v.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    q, k, v, g, beta = (heads_first(x, dtype) for x in (q, k, v, g, beta))
    o, state = chunked_scan(q * scale, k, v, g.unsqueeze(-1), beta, state, starts, chunk_size)
    return o.transpose(1, 2).to(out_dtype), state


def gated_delta_transition(k: Tensor, g: Tensor, beta: Tensor, *, starts: Tensor | None = None,
                           chunk_size: int = 64) -> Tensor:
    """M [B, H, dk, dk] with final_state(initial_state=S0) == M @ S0 + final_state(initial_state=0) for the same
    k, g, beta, starts (and any q, v): the linear map a segment applies to the state entering it. M is exactly 0 for
    a batch row whose ``starts`` has any True. float32, or float64 when k is float64.

    S0 reaches the final state only through the product of the steps' (I - beta k k^T) exp(g), which v does not
    touch: M is the chunked rule's final state for v = 0 (of width dk) entering with S0 = I."""
    check_inputs(None, k, None, g, beta, None, starts, per_channel=False)
    B, T, H, dk = k.shape
    dtype = compute_dtype(k)
    k, g, beta = (heads_first(x, dtype) for x in (k, g, beta))
    identity = torch.eye(dk, dtype=dtype, device=k.device).expand(B, H, dk, dk)
    return chunked_scan(None, k, torch.zeros_like(k), g.unsqueeze(-1), beta, identity, starts, chunk_size)[1]
