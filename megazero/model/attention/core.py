"""Core (causal) attention: softmax(Q K^T / sqrt(d)) V on this rank's heads.

Three interchangeable backends compute the same function:

* ``flash``: ``flash_attn_func`` (needs flash-attn, CUDA and fp16/bf16, no explicit mask, no sinks);
* ``sdpa``:  ``torch.nn.functional.scaled_dot_product_attention``;
* ``math``:  the explicit formula, the reference the others are tested against.

A sliding ``window`` (a query at i sees the keys i - window .. i) and attention ``sinks`` (a logit per
head in every softmax, :mod:`~megazero.model.attention.sinks`) are part of the function: ``math``
masks and appends them; ``flash`` takes the window as flash-attn's ``window_size``; ``sdpa`` (and
``auto`` off flash) computes them with the ring's block kernels on one rank
(:func:`~megazero.model.attention.tiled.block_attention`), only the blocks the window
reaches, so time and memory grow with the window, not the sequence.

``auto`` picks flash when it can run and sdpa otherwise. Heads are partitioned
over TP ranks, so attention dropout must differ per rank: it runs inside the
model-parallel RNG fork (``mpu.get_rng_tracker().fork()``). Dropout keyed by position
(``dropout``) is computed by the explicit formula in tiles instead (``ring_attention.dense_attention``),
with masks that do not depend on the layout.

Shapes: q ``[s, b, heads, dqk]``, k ``[s, b, groups, dqk]``, v ``[s, b, groups, dv]`` (GQA when
groups < heads; query head ``i`` reads key/value group ``i // (heads // groups)``; dv may differ from
dqk, as in multi-latent attention); output ``[s, b, heads * dv]``. The softmax scale is 1/sqrt(dqk).
``attention_mask`` (optional) is boolean ``[b, 1, s, s]`` or ``[s, s]`` with True = masked
out, applied *in addition to* the causal mask (a Megatron-style mask that already
contains causality works unchanged). A row with every position masked gives NaN.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megazero.model.keyed_dropout import AttentionDropout
from megazero.model.attention.tiled import block_attention
from megazero.model.attention.sinks import softmax_with_sinks
from megazero.mpu.random import get_rng_tracker

__all__ = ["core_attention", "resolve_backend", "flash_attn_available"]


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(requested: str, q: torch.Tensor, has_mask: bool, has_sinks: bool = False) -> str:
    """The backend that will run for ``requested`` ('auto'|'flash'|'sdpa'|'math') on this input."""
    flash_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not has_mask and not has_sinks
    if requested == "auto":
        return "flash" if flash_ok and flash_attn_available() else "sdpa"
    if requested == "flash":
        problems = []
        if not flash_attn_available():
            problems.append("flash-attn is not installed (pip install flash-attn)")
        if not q.is_cuda:
            problems.append(f"tensors are on {q.device}, flash-attn needs CUDA")
        if q.dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"dtype is {q.dtype}, flash-attn needs float16 or bfloat16")
        if has_mask:
            problems.append("an explicit attention_mask was given, flash-attn supports only the causal mask")
        if has_sinks:
            problems.append("the attention has sinks (--softmax-type), which flash-attn's kernels do not take")
        if problems:
            raise RuntimeError("attention_backend='flash' cannot run: " + "; ".join(problems)
                               + ". Use attention_backend='auto' to fall back to sdpa.")
        return "flash"
    if requested in ("sdpa", "math"):
        return requested
    raise ValueError(f"unknown attention backend {requested!r}; use 'auto', 'flash', 'sdpa' or 'math'")


def _masked_out(s: int, device, attention_mask: Optional[torch.Tensor], window: Optional[int] = None) -> torch.Tensor:
    """Boolean mask, True where attention is forbidden: causal (and beyond the ``window``) plus the user mask."""
    causal = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)
    if window is not None:
        causal |= torch.ones(s, s, dtype=torch.bool, device=device).tril_(-window - 1)
    return causal if attention_mask is None else causal | attention_mask.to(torch.bool)


def _repeat_kv(k: torch.Tensor, n_heads: int) -> torch.Tensor:
    groups = k.size(2)
    return k if groups == n_heads else k.repeat_interleave(n_heads // groups, dim=2)


def _math(q, k, v, dropout_p, attention_mask, window=None, sinks=None):
    s, b, n, d = q.shape  # d: the query/key width, which sets the scale
    k, v = _repeat_kv(k, n), _repeat_kv(v, n)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [b, n, s, s]
    scores = scores.masked_fill(_masked_out(s, q.device, attention_mask, window), float("-inf"))
    if sinks is not None:
        probs = softmax_with_sinks(scores.float(), sinks).to(q.dtype)
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)  # [b, n, s, dv]


def _one_width(q, k, v):
    """``(q, k, v)`` padded with zeros to one head width, for kernels that want it (flash-attn, and sdpa's
    flash backend, which sdpa skips otherwise for the explicit formula and its [s, s] scores). V's zero
    columns give zero output columns and Q/K's add nothing to the scores; the output is trimmed to V's
    width by the caller and the scale must stay 1/sqrt(the real q/k width)."""
    width = max(q.size(-1), v.size(-1))
    return tuple(t if t.size(-1) == width else F.pad(t, (0, width - t.size(-1))) for t in (q, k, v))


def _sdpa(q, k, v, dropout_p, attention_mask):
    s, b, n, d = q.shape
    dv = v.size(-1)
    k, v = _repeat_kv(k, n), _repeat_kv(v, n)
    scale = None
    if dv != d:
        q, k, v = _one_width(q, k, v)
        scale = 1.0 / math.sqrt(d)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, width]
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    else:
        allowed = ~_masked_out(s, q.device, attention_mask)  # sdpa's boolean mask means "may attend"
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)
    return out if dv == d else out[..., :dv]  # [b, n, s, dv]


def _flash(q, k, v, dropout_p, window=None):
    """flash-attn wants one head width (:func:`_one_width`); the output is trimmed to V's width. Its
    ``window_size`` (left, right) is the sliding window's (-1: unbounded)."""
    from flash_attn import flash_attn_func

    dqk, dv = q.size(-1), v.size(-1)
    kw = dict(dropout_p=dropout_p, causal=True)
    if window is not None:  # flash-attn >= 2.3
        kw["window_size"] = (window, 0)
    if dqk == dv:
        out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), **kw)
        return out.transpose(0, 1)  # [s, b, n, d]
    q, k, v = _one_width(q, k, v)
    out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), softmax_scale=1.0 / math.sqrt(dqk),
                          **kw)
    return out.transpose(0, 1)[..., :dv]  # [s, b, n, dv]


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto",
                   dropout_p: float = 0.0, attention_mask: Optional[torch.Tensor] = None,
                   dropout: Optional[AttentionDropout] = None, window: Optional[int] = None,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this rank's heads: q ``[s, b, heads, dqk]``, k ``[s, b, groups, dqk]``, v
    ``[s, b, groups, dv]`` -> ``[s, b, heads * dv]``, scaled by 1/sqrt(dqk) (pre-scale q for another scale).

    Pass ``dropout_p=0`` in eval mode; a positive ``dropout_p`` (the backend's own masks) needs the
    model-parallel RNG to be seeded (``mpu.model_parallel_manual_seed``). ``dropout``: attention
    dropout keyed by position instead (:class:`~megazero.model.keyed_dropout.AttentionDropout`), computed
    by the explicit formula in tiles whatever ``backend`` says (positions ``0 .. s-1``). ``window``: a
    query at i sees only the keys i - window .. i; ``sinks`` ``[heads]``: this rank's heads' sink logits.
    """
    if q.dim() != 4 or k.shape[:2] != q.shape[:2] or k.size(3) != q.size(3) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"expected q [s, b, heads, dqk], k [s, b, groups, dqk] and v [s, b, groups, dv]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    s, b, n = q.shape[:3]
    d = v.size(-1)
    if window is not None and window < 0:
        raise ValueError(f"a sliding window reaches back {window} keys; give a window >= 0 (or None: no window)")
    if window is not None and window >= s - 1:
        window = None  # the window holds the whole sequence
    if sinks is not None and tuple(sinks.shape) != (n,):
        raise ValueError(f"sinks must hold one logit per query head of q, [{n}]; got {tuple(sinks.shape)}")
    if dropout is not None and dropout_p > 0.0:
        raise ValueError("give attention dropout once: dropout_p (the backend's masks) or dropout (keyed)")
    chosen = "keyed" if dropout is not None else resolve_backend(backend, q, attention_mask is not None,
                                                                 sinks is not None)
    if chosen in ("keyed", "sdpa") and (dropout is not None or window is not None or sinks is not None):
        run = ((0, 0, s),)  # one sequence, positions 0 .. s-1; the window's blocks only (drawn masks: forked there)
        return block_attention(q, k, v, run, run, dropout=dropout, dropout_p=dropout_p, window=window, sinks=sinks,
                               mask=attention_mask)
    rng = get_rng_tracker().fork(device=q.device) if dropout_p > 0.0 else contextlib.nullcontext()
    with rng:
        if chosen == "flash":
            return _flash(q, k, v, dropout_p, window).reshape(s, b, n * d)
        if chosen == "sdpa":
            out = _sdpa(q, k, v, dropout_p, attention_mask)
        else:
            out = _math(q, k, v, dropout_p, attention_mask, window, sinks)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)
