"""The halo exchange of sliding-window attention under context parallelism: each rank receives, from each
other rank, only the keys and values its queries' windows reach, instead of every block around the ring.

With a window shorter than a zigzag chunk, rank r's queries reach back into chunk r-1 (held by rank r-1)
and chunk 2P-2-r (held by rank r+1), and only the last ``window`` keys of each: two slices of ``window``
tokens instead of P-1 blocks of ``S/P``. Every rank computes the whole pattern from the layouts
(:func:`halo_of`, no communication): for each pair of ranks, the range of the source's storage that any
block of the destination's plan reads. One ``batch_isend_irecv`` sends the slices, the rank's own blocks
are computed meanwhile, then the received ones; backward sends each slice's dK/dV back to its owner.
The ring stays where a rank could need more than two shards' worth of keys (a window as long as a shard,
or many short documents): the two hold the same peak memory there and the ring overlaps more.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megazero.model.attention.block_kernels import acc_dtype
from megazero.model.attention.cp.layout import Block, CPLayout, plan_blocks
from megazero.model.attention.sinks import sinks_grad
from megazero.model.attention.tiled import bhsd, drawing, kernel_for_block, merge_block, with_sinks

__all__ = ["Halo", "halo_of", "halo_attention"]


@dataclass(frozen=True)
class Halo:
    """One rank's exchange: ``recv`` (source, lo, hi): the slice ``[lo, hi)`` of the source's storage its
    blocks read; ``send`` (destination, lo, hi): the slice of its own storage a destination reads."""

    recv: tuple[tuple[int, int, int], ...]
    send: tuple[tuple[int, int, int], ...]


def _reach(layouts: tuple[CPLayout, ...], dst: int, src: int, window: int) -> Optional[tuple[int, int]]:
    """The storage range of ``src``'s keys that ``dst``'s blocks read, over every sample (None: none)."""
    cols = [(b.k_lo, b.k_hi) for x in layouts for b in plan_blocks(x.runs[dst], x.runs[src], window)]
    return (min(c[0] for c in cols), max(c[1] for c in cols)) if cols else None


@functools.lru_cache(maxsize=256)
def halo_of(layouts: tuple[CPLayout, ...], rank: int, window: int) -> Optional[Halo]:
    """Rank ``rank``'s halo exchange for ``window``, or None (the ring) where a rank could need more than two
    shards' worth of the others' keys: each of a rank's runs reaches back at most ``window + 1`` keys, so
    the bound is its runs times that, the same decision on every rank without planning theirs."""
    p, local = layouts[0].cp_size, layouts[0].local_len
    if max(len(x.runs[r]) for x in layouts for r in range(p)) * (window + 1) > 2 * local:
        return None
    recv = tuple((s, *r) for s in range(p) if s != rank for r in [_reach(layouts, rank, s, window)] if r)
    send = tuple((d, *r) for d in range(p) if d != rank for r in [_reach(layouts, d, rank, window)] if r)
    return Halo(recv, send)


def _exchange(group, pairs, tensors, buffers, tag: int) -> tuple[list, int]:
    """Post one batch: send ``tensors[i]`` to each peer of ``pairs`` (peer, ...) and receive ``buffers``."""
    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    ops = [dist.P2POp(dist.isend, t, peer(d), group, tag + n) for (d, *_), ts in zip(pairs[0], tensors)
           for n, t in enumerate(ts)]
    ops += [dist.P2POp(dist.irecv, t, peer(s), group, tag + n) for (s, *_), ts in zip(pairs[1], buffers)
            for n, t in enumerate(ts)]
    sent = sum(t.numel() * t.element_size() for ts in tensors for t in ts)
    return (dist.batch_isend_irecv(ops) if ops else []), sent


def _blocks(ctx, src: int, lo: int):
    """(sample slice, layout index, block index, block, block in the received slice's columns)."""
    layouts = ctx.layouts
    samples = [(slice(None), 0)] if len(layouts) == 1 else [(slice(i, i + 1), i) for i in range(len(layouts))]
    for bs, i in samples:
        for j, blk in enumerate(plan_blocks(layouts[i].runs[ctx.rank], layouts[i].runs[src], ctx.window)):
            yield bs, i, j, blk, Block(blk.q_lo, blk.q_hi, blk.k_lo - lo, blk.k_hi - lo, blk.causal, blk.band)


def _keyed(ctx, i: int, bs: slice, src: int, blk: Block) -> dict:
    if ctx.dropout is None:
        return {}
    pos = ctx.positions[i]
    return dict(dropout=ctx.dropout.select(bs),
                positions=(pos[ctx.rank][blk.q_lo:blk.q_hi], pos[src][blk.k_lo:blk.k_hi]))


def _count(stats, **added: int) -> None:
    if stats is not None:
        for name, n in added.items():
            setattr(stats, name, getattr(stats, name) + n)


class _HaloAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, rank, layouts, halo, scale, kernel, stats, dropout, dropout_p, window, sinks,
                positions):
        ctx.group, ctx.rank, ctx.layouts, ctx.halo, ctx.scale, ctx.kernel, ctx.stats = (group, rank, layouts, halo,
                                                                                         scale, kernel, stats)
        ctx.dropout, ctx.dropout_p, ctx.window, ctx.positions, ctx.rngs = dropout, dropout_p, window, positions, {}
        s, b, h, dv = *q.shape[:3], v.size(3)
        got = [(k.new_empty(hi - lo, *k.shape[1:]), v.new_empty(hi - lo, *v.shape[1:])) for _, lo, hi in halo.recv]
        works, sent = _exchange(group, (halo.send, halo.recv),
                                [(k[lo:hi].contiguous(), v[lo:hi].contiguous()) for _, lo, hi in halo.send], got, 0)
        _count(stats, forward_bytes_sent=sent)
        acc = acc_dtype(q.dtype)
        acc_out = torch.zeros(b, h, s, dv, dtype=acc, device=q.device)
        acc_lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        qt = bhsd(q)
        for n, (src, lo, kv) in enumerate([(rank, 0, (k, v))] + [(r[0], r[1], g) for r, g in zip(halo.recv, got)]):
            if n == 1:
                for w in works:  # the rank's own blocks ran while the halos travelled
                    w.wait()
            kt, vt = bhsd(kv[0]), bhsd(kv[1])
            for bs, i, j, blk, cut in _blocks(ctx, src, lo):
                kern, extra = kernel_for_block(kernel, cut)
                with drawing(dropout_p, q.device):
                    o, lse, ctx.rngs[src, i, j] = kern.forward(
                        qt[bs, :, cut.q_lo:cut.q_hi], kt[bs, :, cut.k_lo:cut.k_hi], vt[bs, :, cut.k_lo:cut.k_hi],
                        cut.causal, scale, dropout_p, **_keyed(ctx, i, bs, src, blk), **extra)
                merge_block(acc_out[bs], acc_lse[bs], cut, o, lse)
                _count(stats, forward_pairs=blk.pairs)
        if not halo.recv:
            for w in works:
                w.wait()
        acc_out, acc_lse = with_sinks(acc_out, acc_lse, sinks)
        out = acc_out.to(q.dtype).permute(2, 0, 1, 3).reshape(s, b, h * dv)
        lse = acc_lse if acc == torch.float64 else acc_lse.float()
        ctx.save_for_backward(q, k, v, out, lse, *(t for kv in got for t in kv), *(() if sinks is None else (sinks,)))
        ctx.has_sinks = sinks is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sinks = rest.pop() if ctx.has_sinks else None
        got = [(rest[2 * n], rest[2 * n + 1]) for n in range(len(ctx.halo.recv))]
        s, b, h, d = q.shape
        acc = acc_dtype(q.dtype)
        qt, dot, ot = bhsd(q), bhsd(grad_out.reshape(s, b, h, v.size(3))), bhsd(out.reshape(s, b, h, v.size(3)))
        dq = torch.zeros(b, h, s, d, dtype=acc, device=q.device)
        grads = []
        for src, lo, kv in [(ctx.rank, 0, (k, v))] + [(r[0], r[1], g) for r, g in zip(ctx.halo.recv, got)]:
            dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in kv)
            kt, vt, dkt, dvt = bhsd(kv[0]), bhsd(kv[1]), bhsd(dk), bhsd(dv)
            for bs, i, j, blk, cut in _blocks(ctx, src, lo):
                rows, cols = slice(cut.q_lo, cut.q_hi), slice(cut.k_lo, cut.k_hi)
                kern, extra = kernel_for_block(ctx.kernel, cut)
                g = kern.backward(dot[bs, :, rows], qt[bs, :, rows], kt[bs, :, cols], vt[bs, :, cols], ot[bs, :, rows],
                                  lse[bs, :, rows], cut.causal, ctx.scale, ctx.dropout_p, ctx.rngs[src, i, j],
                                  **_keyed(ctx, i, bs, src, blk), **extra)
                dq[bs, :, rows] += g[0]
                dkt[bs, :, cols] += g[1]
                dvt[bs, :, cols] += g[2]
                _count(ctx.stats, backward_pairs=blk.pairs)
            grads.append((dk, dv))
        (dk, dv), theirs = grads[0], grads[1:]
        back = [(dk.new_empty(hi - lo, *dk.shape[1:]), dv.new_empty(hi - lo, *dv.shape[1:]))
                for _, lo, hi in ctx.halo.send]
        works, sent = _exchange(ctx.group, (ctx.halo.recv, ctx.halo.send), theirs, back, 2)
        _count(ctx.stats, backward_bytes_sent=sent)
        for w in works:
            w.wait()
        for (_, lo, hi), (gk, gv) in zip(ctx.halo.send, back):  # my keys' gradients from the ranks that read them
            dk[lo:hi] += gk
            dv[lo:hi] += gv
        d_sinks = sinks_grad(dot, ot, lse, sinks) if sinks is not None else None
        return (dq.to(q.dtype).permute(2, 0, 1, 3), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None,
                None, None, None, None, d_sinks, None)


def halo_attention(q, k, v, group, rank: int, layouts: tuple[CPLayout, ...], halo: Halo, scale: float, kernel, stats,
                   dropout, dropout_p: float, window: int, sinks, positions) -> torch.Tensor:
    """:func:`~megazero.model.attention.cp.ring.ring_attention`'s function by the halo exchange (its
    arguments already checked and resolved there)."""
    return _HaloAttention.apply(q, k, v, group, rank, layouts, halo, scale, kernel, stats, dropout, dropout_p, window,
                                sinks, positions)
