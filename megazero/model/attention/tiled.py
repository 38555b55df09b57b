"""Attention computed as dense blocks merged by their log-sum-exp: the engine under the context-parallel
exchanges (the ring's steps, the all-gather's chunks) and under one rank's sliding windows and sinks.

A caller plans the blocks (:func:`~megazero.model.attention.cp.layout.plan_blocks`: the causal, per-document
and windowed pairs that are unmasked, nothing fully masked) and a block kernel
(:mod:`~megazero.model.attention.block_kernels`) computes each: out and log-sum-exp forward, and in backward
the block's gradients from the *merged* out and log-sum-exp (FlashAttention's recurrence), so no block's
scores outlive it. A block cut by a window's edge runs in the math kernel, which masks it; sinks are one
rescale after the last merge (:mod:`~megazero.model.attention.sinks`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch

from megazero.model.attention.block_kernels import MATH_KERNEL, acc_dtype, block_kernel
from megazero.model.attention.cp.layout import Block, Run, plan_blocks
from megazero.model.attention.sinks import add_sinks, sinks_grad
from megazero.model.keyed_dropout import AttentionDropout
from megazero.mpu.random import get_rng_tracker

__all__ = ["block_attention", "dense_attention", "bhsd", "merge_block", "kernel_for_block", "with_sinks", "drawing",
           "on_device", "choose_kernel"]


def bhsd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, heads, d]`` -> the kernels' ``[b, heads, s, d]`` (a view)."""
    return t.permute(1, 2, 0, 3)


def merge_block(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk: Block, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running rows: weights exp(lse_i - lse_new) <= 1, so nothing overflows."""
    rows = slice(blk.q_lo, blk.q_hi)
    old = acc_lse[:, :, rows]
    new = torch.logaddexp(old, lse.to(acc_lse.dtype))
    w_old, w_new = torch.exp(old - new), torch.exp(lse - new)
    if blk.band is not None:  # a window's edge may leave a row no key yet (new = -inf): weigh it 0, not NaN
        w_old, w_new = (torch.where(torch.isinf(new), torch.zeros_like(w), w) for w in (w_old, w_new))
    acc_out[:, :, rows] = acc_out[:, :, rows] * w_old.unsqueeze(-1) + out.to(acc_out.dtype) * w_new.unsqueeze(-1)
    acc_lse[:, :, rows] = new


def kernel_for_block(kernel, blk: Block) -> tuple[object, dict]:
    """The kernel that computes ``blk`` and its extra arguments: a block cut by a window's edge
    (``band``) runs in the math kernel, the one that masks it; any other in ``kernel``."""
    if blk.band is None:
        return kernel, {}
    return MATH_KERNEL, {"band": blk.band}


def with_sinks(acc_out: torch.Tensor, acc_lse: torch.Tensor, sinks: Optional[torch.Tensor]):
    """The merged rows with the sinks' rescale (:mod:`~megazero.model.attention.sinks`), if any."""
    return (acc_out, acc_lse) if sinks is None else add_sinks(acc_out, acc_lse, sinks)


def drawing(dropout_p: float, device):
    """Where a block kernel's own dropout masks are drawn: the model-parallel stream on ``device``, as
    ``core_attention``'s (tensor-parallel ranks draw apart; recompute replays the stream)."""
    return get_rng_tracker().fork(device=device) if dropout_p > 0.0 else contextlib.nullcontext()


def on_device(host: list[torch.Tensor], device) -> list[torch.Tensor]:
    """``host`` index tensors on ``device`` in one copy, pinned on CUDA so that it does not wait for the GPU."""
    flat = torch.cat(host)
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split([t.numel() for t in host]))


class _BlockAttention(torch.autograd.Function):
    """Attention of local queries against key/values already at hand (gathered), block by block;
    ``positions`` (query, key) and ``dropout`` for keyed dropout, ``mask`` ``[b | 1, 1, n, m]``,
    ``dropout_p`` for the kernel's own masks, ``sinks`` ``[heads]`` (or None)."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, kernel, positions, dropout, mask, dropout_p, sinks):
        s, b, h, dv = *q.shape[:3], v.size(3)
        acc = acc_dtype(q.dtype)
        acc_out = torch.zeros(b, h, s, dv, dtype=acc, device=q.device)
        acc_lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        qt, kt, vt = bhsd(q), bhsd(k), bhsd(v)
        ctx.blocks, ctx.scale, ctx.kernel, ctx.positions, ctx.dropout, ctx.mask = (blocks, scale, kernel, positions,
                                                                                  dropout, mask)
        ctx.dropout_p, ctx.rngs = dropout_p, []
        for blk in blocks:
            kern, extra = kernel_for_block(kernel, blk)
            with drawing(dropout_p, q.device):
                o, lse, rng = kern.forward(qt[:, :, blk.q_lo:blk.q_hi], kt[:, :, blk.k_lo:blk.k_hi],
                                           vt[:, :, blk.k_lo:blk.k_hi], blk.causal, scale, dropout_p,
                                           **_extras(ctx, blk), **extra)
            ctx.rngs.append(rng)
            merge_block(acc_out, acc_lse, blk, o, lse)
        acc_out, acc_lse = with_sinks(acc_out, acc_lse, sinks)
        out = acc_out.to(q.dtype).permute(2, 0, 1, 3).reshape(s, b, h * dv)
        ctx.save_for_backward(q, k, v, out, acc_lse if acc == torch.float64 else acc_lse.float(),
                              *(() if sinks is None else (sinks,)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        s, b, h, d = q.shape
        v_dim = v.size(3)
        acc = acc_dtype(q.dtype)
        qt, kt, vt = bhsd(q), bhsd(k), bhsd(v)
        dot, ot = bhsd(grad_out.reshape(s, b, h, v_dim)), bhsd(out.reshape(s, b, h, v_dim))
        dq = torch.zeros(b, h, s, d, dtype=acc, device=q.device)
        dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (k, v))
        dkt, dvt = bhsd(dk), bhsd(dv)
        for blk, rng in zip(ctx.blocks, ctx.rngs):
            rows, cols = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
            kern, extra = kernel_for_block(ctx.kernel, blk)
            g = kern.backward(dot[:, :, rows], qt[:, :, rows], kt[:, :, cols], vt[:, :, cols], ot[:, :, rows],
                              lse[:, :, rows], blk.causal, ctx.scale, ctx.dropout_p, rng, **_extras(ctx, blk), **extra)
            dq[:, :, rows] += g[0]
            dkt[:, :, cols] += g[1]
            dvt[:, :, cols] += g[2]
        d_sinks = sinks_grad(dot, ot, lse, sinks[0]) if sinks else None
        return (dq.to(q.dtype).permute(2, 0, 1, 3), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                None, None, d_sinks)


def _extras(ctx, blk: Block) -> dict:
    """The math kernel's dropout and mask arguments for ``blk``; none when there are neither."""
    extras = {}
    if ctx.dropout is not None:
        q_pos, k_pos = ctx.positions
        extras.update(dropout=ctx.dropout, positions=(q_pos[blk.q_lo:blk.q_hi], k_pos[blk.k_lo:blk.k_hi]))
    if ctx.mask is not None:
        extras["mask"] = ctx.mask[..., blk.q_lo:blk.q_hi, blk.k_lo:blk.k_hi]
    return extras


def _run_positions(runs: Sequence[Run]) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + n) for _, start, n in runs])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Sequence[Run],
                    k_runs: Sequence[Run], *, softmax_scale: Optional[float] = None,
                    kernel: str = "auto", dropout: Optional[AttentionDropout] = None,
                    dropout_p: float = 0.0, window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                    mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (per-document) attention of queries q ``[n, b, heads, dqk]`` holding the tokens ``q_runs``
    against k ``[m, b, groups, dqk]`` and v ``[m, b, groups, dv]`` holding ``k_runs`` (e.g. every rank's,
    gathered), computed by the ring's block kernels and merged by log-sum-exp: no ``[n, m]`` mask or
    scores. ``dropout``: keyed attention dropout (the math kernel, masks from the runs' positions);
    ``dropout_p``: the kernels' own masks, from the model-parallel stream. ``window``: each query sees
    the ``window`` keys before it and itself (only the blocks the window reaches are computed);
    ``sinks`` ``[heads]``: a sink logit per head; ``mask`` ``[b | 1, 1, n, m]`` (True = masked, the math
    kernel applies it). Returns ``[n, b, heads * dv]``."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.size(3))
    positions = (tuple(on_device([_run_positions(q_runs), _run_positions(k_runs)], q.device))
                 if dropout is not None else None)
    if mask is not None:
        mask = mask.to(torch.bool).reshape(-1, 1, *mask.shape[-2:]) if mask.dim() != 4 else mask.to(torch.bool)
    return _BlockAttention.apply(q, k, v, tuple(plan_blocks(tuple(q_runs), tuple(k_runs), window)), scale,
                                 choose_kernel("math" if mask is not None else kernel, q, v, dropout, dropout_p), positions,
                                 dropout, mask, dropout_p, sinks)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: Optional[AttentionDropout], *,
                    positions: Optional[tuple[torch.Tensor, torch.Tensor]] = None, causal: bool = True,
                    mask: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of q ``[n, b, heads, dqk]`` against k ``[m, b, groups, dqk]`` and v ``[m, b, groups, dv]``
    by the math kernel's tiles (no ``[n, m]`` scores held), with keyed ``dropout``, drawn masks
    (``dropout_p``, from the model-parallel stream) or none: ``causal``
    (n == m, the same tokens in increasing order) and/or ``mask`` (``[b | 1, 1, n, m]`` or ``[n, m]``,
    True = masked), ``sinks`` ``[heads]``. ``positions``: the queries' and keys' indices in the whole
    sequence (for dropout's masks). Returns ``[n, b, heads * dv]``."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.size(3))
    if mask is not None:
        mask = mask.to(torch.bool).reshape(-1, 1, *mask.shape[-2:]) if mask.dim() != 4 else mask.to(torch.bool)
    blocks = (Block(0, q.size(0), 0, k.size(0), causal),)
    return _BlockAttention.apply(q, k, v, blocks, scale, choose_kernel("math", q, v, dropout, dropout_p), positions, dropout,
                                 mask, dropout_p, sinks)


def choose_kernel(name: str, q: torch.Tensor, v: torch.Tensor, dropout: Optional[AttentionDropout], dropout_p: float):
    """The block kernel for ``name``: with keyed dropout the math kernel, the one that applies its masks;
    with ``dropout_p`` one that draws its own."""
    if dropout is not None and dropout_p > 0.0:
        raise ValueError("give attention dropout once: dropout_p (the kernels' masks) or dropout (keyed)")
    if dropout is None:
        return block_kernel(name, q, v.size(-1), dropout=dropout_p > 0.0)
    if name not in ("auto", "math"):
        raise ValueError(f"keyed attention dropout runs in the math block kernel; kernel {name!r} draws no keyed "
                         "masks: pass kernel 'auto' or 'math'")
    return block_kernel("math", q)
