"""Ring (``p2p``) context-parallel attention: exact causal attention of a sequence split over a CP group.

Each of the ``P`` ranks of ``group`` holds some tokens of the sequence (a :class:`~megazero.model.attention.cp.layout.CPLayout`,
normally the balanced zigzag or per-document layout) as q ``[s_local, b, heads, dqk]``, k
``[s_local, b, groups, dqk]`` and v ``[s_local, b, groups, dv]`` (dv may differ from dqk). Forward: ``P``
steps; at each the local queries attend to the key/value block of one rank (only the sub-blocks the
causal / document mask leaves unmasked, planned by :func:`~megazero.model.attention.cp.layout.plan_blocks`), and
the partial results are merged in fp32 (fp64 for fp64 inputs) by their log-sum-exp; meanwhile
``batch_isend_irecv`` passes the key/value block on to the next rank, so at most two blocks (the one
computed, the one arriving) are alive besides the local one.
Backward runs the ring again, recomputing each block from the saved local q, k, v, output and LSE,
and passes the dK/dV accumulators along with the blocks, so each rank ends with the gradients of its
own tokens. Sent: key/value blocks carry ``groups`` heads, not ``heads``, K at its width and V at its own.

The block kernel (:mod:`megazero.model.attention.block_kernels`) is chosen by device and dtype: torch's flash
op on CPU and on CUDA (fp16/bf16), its memory-efficient op for fp32 on CUDA, the explicit formula for
fp64; each holds one block's working set, never the (s/cp)^2 scores of a whole exchange. Attention
dropout with the kernels' own masks (``dropout_p``: Megatron's behaviour, masks that depend on the
layout) runs in the same kernels, drawn from the model-parallel stream, except on CPU, whose flash op
has none (the math kernel draws them there). With attention dropout keyed by position (``dropout``)
every block runs the math kernel, which applies the masks of the block's global positions and heads in
tiles of at most 4M score elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megazero.model.attention.block_kernels import acc_dtype
from megazero.model.attention.cp.halo import halo_attention, halo_of
from megazero.model.attention.cp.layout import Block, CPLayout, plan_blocks
from megazero.model.attention.sinks import sinks_grad
from megazero.model.attention.tiled import (bhsd, choose_kernel, drawing, kernel_for_block, merge_block, on_device,
                                            with_sinks)
from megazero.model.keyed_dropout import AttentionDropout

__all__ = ["ring_attention", "RingStats"]


@dataclass
class RingStats:
    """Counters a caller passes to :func:`ring_attention`; each call adds to them.

    Bytes are those handed to ``isend``: forward ``s_local * b * groups * (dqk + dv) * (P - 1)`` elements
    of the input dtype (the key and value blocks, each at its own head width); backward the same again
    plus the dK/dV accumulators once around the ring, ``s_local * b * groups * (dqk + dv) * P`` fp32
    (fp64) elements. Pairs are the query-key pairs of the blocks computed
    (:attr:`~megazero.model.attention.cp.layout.Block.pairs`)."""
    forward_bytes_sent: int = 0
    backward_bytes_sent: int = 0
    forward_pairs: int = 0
    backward_pairs: int = 0


def _count(stats: Optional[RingStats], **added: int) -> None:
    if stats is not None:
        for name, n in added.items():
            setattr(stats, name, getattr(stats, name) + n)


class _Ring:
    """Asynchronous exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
        self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size

    def exchange(self, tensors: tuple[torch.Tensor, ...], tag: int) -> tuple[tuple[torch.Tensor, ...], list, int]:
        """Start sending ``tensors`` on and receiving their successors; returns (buffers, works, bytes sent)."""
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i) for i, r in enumerate(received)]
        return received, dist.batch_isend_irecv(ops), sum(t.numel() * t.element_size() for t in tensors)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, rank, layouts, scale, kernel, stats, dropout, dropout_p, window, sinks):
        size = layouts[0].cp_size
        ctx.positions = _positions(layouts, q.device) if dropout is not None else None
        ctx.dropout, ctx.dropout_p, ctx.rngs = dropout, dropout_p, {}
        ring = _Ring(group, rank, size) if size > 1 else None
        s, b, h, dv = *q.shape[:3], v.size(3)
        acc = acc_dtype(q.dtype)
        acc_out = torch.zeros(b, h, s, dv, dtype=acc, device=q.device)
        acc_lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        qt, cur = bhsd(q), (k.contiguous(), v.contiguous())
        for step in range(size):
            if step < size - 1:  # the next block travels while this one is computed
                nxt, works, sent = ring.exchange(cur, tag=0)
                _count(stats, forward_bytes_sent=sent)
            kt, vt = bhsd(cur[0]), bhsd(cur[1])
            src = (rank - step) % size
            for i, (bs, layout) in enumerate(_by_sample(layouts)):
                for j, blk in enumerate(plan_blocks(layout.runs[rank], layout.runs[src], window)):
                    kern, extra = kernel_for_block(kernel, blk)
                    with drawing(dropout_p, q.device):
                        o, lse, ctx.rngs[src, i, j] = kern.forward(
                            qt[bs, :, blk.q_lo:blk.q_hi], kt[bs, :, blk.k_lo:blk.k_hi], vt[bs, :, blk.k_lo:blk.k_hi],
                            blk.causal, scale, dropout_p, **_keyed(ctx, i, bs, rank, src, blk), **extra)
                    merge_block(acc_out[bs], acc_lse[bs], blk, o, lse)
                    _count(stats, forward_pairs=blk.pairs)
            if step < size - 1:
                _wait(works)
                cur = nxt
        acc_out, acc_lse = with_sinks(acc_out, acc_lse, sinks)
        out = acc_out.to(q.dtype).permute(2, 0, 1, 3).reshape(s, b, h * dv)
        lse = acc_lse if acc == torch.float64 else acc_lse.float()
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.ring, ctx.rank, ctx.layouts, ctx.scale, ctx.kernel, ctx.stats = ring, rank, layouts, scale, kernel, stats
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        ring, rank, stats, size = ctx.ring, ctx.rank, ctx.stats, ctx.layouts[0].cp_size
        s, b, h, d = q.shape
        dv = v.size(3)
        acc = acc_dtype(q.dtype)
        qt, dot, ot = bhsd(q), bhsd(grad_out.reshape(s, b, h, dv)), bhsd(out.reshape(s, b, h, dv))
        dq = torch.zeros(b, h, s, d, dtype=acc, device=q.device)
        cur, dkv_works, dkv_in = (k.contiguous(), v.contiguous()), [], None
        for step in range(size):
            if step < size - 1:
                nxt, kv_works, sent = ring.exchange(cur, tag=0)
                _count(stats, backward_bytes_sent=sent)
            dkv = _block_grads(ctx, (rank - step) % size, cur, qt, dot, ot, lse, dq)
            if dkv_in is not None:  # the accumulators of this block from the ranks it has visited
                _wait(dkv_works)
                dkv[0].add_(dkv_in[0])
                dkv[1].add_(dkv_in[1])
            if ring is not None:  # P sends: the last one brings each rank's accumulators home
                dkv_in, dkv_works, sent = ring.exchange(dkv, tag=2)
                _count(stats, backward_bytes_sent=sent)
            if step < size - 1:
                _wait(kv_works)
                cur = nxt
        if ring is not None:
            _wait(dkv_works)
            dkv = dkv_in
        dq = dq.to(q.dtype).permute(2, 0, 1, 3)
        d_sinks = sinks_grad(dot, ot, lse, sinks[0]) if sinks else None
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None, None, None, d_sinks


def _positions(layouts: tuple[CPLayout, ...], device) -> list[list[torch.Tensor]]:
    """Per layout, every rank's token positions (storage order) on ``device``: the dropout masks' keys."""
    p = layouts[0].cp_size
    flat = on_device([layout.positions(r) for layout in layouts for r in range(p)], device)
    return [flat[i * p:(i + 1) * p] for i in range(len(layouts))]


def _keyed(ctx, i: int, bs: slice, rank: int, src: int, blk: Block) -> dict:
    """The math kernel's dropout arguments for block ``blk`` of sample slice ``bs`` (layout ``i``)
    against rank ``src``'s keys; none without dropout."""
    if ctx.dropout is None:
        return {}
    pos = ctx.positions[i]
    return dict(dropout=ctx.dropout.select(bs), positions=(pos[rank][blk.q_lo:blk.q_hi], pos[src][blk.k_lo:blk.k_hi]))


def _block_grads(ctx, src: int, kv, qt, dot, ot, lse, dq) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the blocks' dq against rank ``src``'s key/value block ``kv`` into ``dq``; return that block's
    (dk, dv) ``[s, b, groups, dqk | dv]`` in fp32/fp64."""
    dk, dv = (torch.zeros(t.shape, dtype=dq.dtype, device=dq.device) for t in kv)
    kt, vt, dkt, dvt = bhsd(kv[0]), bhsd(kv[1]), bhsd(dk), bhsd(dv)
    for i, (bs, layout) in enumerate(_by_sample(ctx.layouts)):
        for j, blk in enumerate(plan_blocks(layout.runs[ctx.rank], layout.runs[src], ctx.window)):
            rows, cols = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
            kern, extra = kernel_for_block(ctx.kernel, blk)
            g = kern.backward(dot[bs, :, rows], qt[bs, :, rows], kt[bs, :, cols], vt[bs, :, cols],
                              ot[bs, :, rows], lse[bs, :, rows], blk.causal, ctx.scale, ctx.dropout_p,
                              ctx.rngs[src, i, j], **_keyed(ctx, i, bs, ctx.rank, src, blk), **extra)
            dq[bs, :, rows] += g[0]
            dkt[bs, :, cols] += g[1]
            dvt[bs, :, cols] += g[2]
            _count(ctx.stats, backward_pairs=blk.pairs)
    return dk, dv


def _by_sample(layouts: tuple[CPLayout, ...]):
    """(batch slice, layout) pairs: one layout for the whole batch, or one per sample (its documents)."""
    if len(layouts) == 1:
        return [(slice(None), layouts[0])]
    return [(slice(i, i + 1), layout) for i, layout in enumerate(layouts)]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout | Sequence[CPLayout],
                   group: Optional[dist.ProcessGroup] = None, *, softmax_scale: Optional[float] = None,
                   kernel: str = "auto", stats: Optional[RingStats] = None,
                   dropout: Optional[AttentionDropout] = None, dropout_p: float = 0.0,
                   window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (per-document, as ``layout`` says) attention of the whole sequence, computed on this rank's tokens.

    q ``[s_local, b, heads, dqk]``, k ``[s_local, b, groups, dqk]`` and v ``[s_local, b, groups, dv]`` hold
    the tokens ``layout`` assigns to this rank of ``group`` (``layout.cp_size`` ranks; None: the default
    group). ``layout`` is one layout for the batch, or one per sample (packed documents differ between
    samples), all placing the tokens alike.
    Returns ``[s_local, b, heads * dv]``, the rows of the full attention for those tokens; gradients flow
    to q, k, v. ``softmax_scale`` defaults to 1/sqrt(dqk). Every rank of the group must call it with the
    same layouts and shapes. ``dropout``: attention dropout keyed by position (the math block kernel;
    masks from the layouts' positions and the global heads ``dropout.heads``), the same masks at any layout.
    ``dropout_p``: attention dropout with the block kernels' own masks instead, drawn from the
    model-parallel stream (``mpu.model_parallel_manual_seed``), which depend on the layout (Megatron's).
    ``window``: sliding-window attention, a query at i sees the keys i - window .. i: a rank computes only
    the blocks the window reaches and, where each rank reads at most two shards' worth of the others' keys,
    receives only those (:mod:`~megazero.model.attention.cp.halo`) instead of the whole ring. ``sinks``
    ``[heads]``: one sink logit per head, applied once after the last merge (:mod:`~megazero.model.attention.sinks`).
    """
    layouts = (layout,) if isinstance(layout, CPLayout) else tuple(layout)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if len(layouts) not in (1, q.size(1)) or any(x.cp_size != layouts[0].cp_size or x.local_len != layouts[0].local_len
                                                  for x in layouts):
        raise ValueError(f"{len(layouts)} layouts for a batch of {q.size(1)}: give one layout, or one per sample "
                         f"with the same CP size and tokens per rank")
    layout = layouts[0]
    if layout.cp_size != size:
        raise ValueError(f"layout is for {layout.cp_size} context-parallel ranks but the group has {size}; "
                         f"build the layout with the group's size")
    if q.dim() != 4 or v.shape[:3] != k.shape[:3] or k.shape[:2] != q.shape[:2] or k.size(3) != q.size(3):
        raise ValueError(f"expected q [s, b, heads, dqk], k [s, b, groups, dqk] and v [s, b, groups, dv] with "
                         f"the same s, b, groups and q/k width; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.size(2) % k.size(2):
        raise ValueError(f"query heads {q.size(2)} are not a multiple of key/value groups {k.size(2)}")
    if q.size(0) != layout.local_len:
        raise ValueError(f"this rank holds {q.size(0)} tokens but the layout gives each rank {layout.local_len} "
                         f"(of {layout.seq_len}); split the sequence with split_for_rank and the same layout")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.size(3))
    if window is not None and window >= layout.seq_len - 1:
        window = None  # the window holds the whole sequence: plain causal attention
    kern = choose_kernel(kernel, q, v, dropout, dropout_p)
    halo = halo_of(layouts, rank, window) if window is not None and size > 1 else None
    if halo is not None:
        positions = _positions(layouts, q.device) if dropout is not None else None
        return halo_attention(q, k, v, group, rank, layouts, halo, scale, kern, stats, dropout, dropout_p, window, sinks,
                              positions)
    return _RingAttention.apply(q, k, v, group, rank, layouts, scale, kern, stats, dropout, dropout_p, window, sinks)
