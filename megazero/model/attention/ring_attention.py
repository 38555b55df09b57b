"""Ring (``p2p``) context-parallel attention: exact causal attention of a sequence split over a CP group.

Each of the ``P`` ranks of ``group`` holds some tokens of the sequence (a :class:`~megazero.model.cp_layout.CPLayout`,
normally the balanced zigzag or per-document layout) as q ``[s_local, b, heads, dqk]``, k
``[s_local, b, groups, dqk]`` and v ``[s_local, b, groups, dv]`` (dv may differ from dqk). Forward: ``P``
steps; at each the local queries attend to the key/value block of one rank (only the sub-blocks the
causal / document mask leaves unmasked, planned by :func:`~megazero.model.cp_layout.plan_blocks`), and
the partial results are merged in fp32 (fp64 for fp64 inputs) by their log-sum-exp; meanwhile
``batch_isend_irecv`` passes the key/value block on to the next rank, so at most two blocks (the one
computed, the one arriving) are alive besides the local one.
Backward runs the ring again, recomputing each block from the saved local q, k, v, output and LSE,
and passes the dK/dV accumulators along with the blocks, so each rank ends with the gradients of its
own tokens. Sent: key/value blocks carry ``groups`` heads, not ``heads``, K at its width and V at its own.

The block kernel (:mod:`megazero.model.attention.ring_kernels`) is chosen by device and dtype: torch's flash
op on CPU and on CUDA (fp16/bf16), its memory-efficient op for fp32 on CUDA, the explicit formula for
fp64; each holds one block's working set, never the (s/cp)^2 scores of a whole exchange. Attention
dropout with the kernels' own masks (``dropout_p``: Megatron's behaviour, masks that depend on the
layout) runs in the same kernels, drawn from the model-parallel stream, except on CPU, whose flash op
has none (the math kernel draws them there). With attention dropout keyed by position (``dropout``)
every block runs the math kernel, which applies the masks of the block's global positions and heads in
tiles of at most 4M score elements.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megazero.model.attention.cp_layout import Block, CPLayout, Run, plan_blocks
from megazero.model.keyed_dropout import AttentionDropout
from megazero.model.attention.ring_kernels import acc_dtype, block_kernel
from megazero.model.attention.sinks import add_sinks, sinks_grad
from megazero.mpu.random import get_rng_tracker

__all__ = ["ring_attention", "block_attention", "dense_attention", "RingStats"]


@dataclass
class RingStats:
    """Counters a caller passes to :func:`ring_attention`; each call adds to them.

    Bytes are those handed to ``isend``: forward ``s_local * b * groups * (dqk + dv) * (P - 1)`` elements
    of the input dtype (the key and value blocks, each at its own head width); backward the same again
    plus the dK/dV accumulators once around the ring, ``s_local * b * groups * (dqk + dv) * P`` fp32
    (fp64) elements. Pairs are the query-key pairs of the blocks computed
    (:attr:`~megazero.model.cp_layout.Block.pairs`)."""
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


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, heads, d]`` -> the kernels' ``[b, heads, s, d]`` (a view)."""
    return t.permute(1, 2, 0, 3)


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk: Block, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running rows: weights exp(lse_i - lse_new) <= 1, so nothing overflows."""
    rows = slice(blk.q_lo, blk.q_hi)
    old = acc_lse[:, :, rows]
    new = torch.logaddexp(old, lse.to(acc_lse.dtype))
    w_old, w_new = torch.exp(old - new), torch.exp(lse - new)
    if blk.band is not None:  # a window's edge may leave a row no key yet (new = -inf): weigh it 0, not NaN
        w_old, w_new = (torch.where(torch.isinf(new), torch.zeros_like(w), w) for w in (w_old, w_new))
    acc_out[:, :, rows] = acc_out[:, :, rows] * w_old.unsqueeze(-1) + out.to(acc_out.dtype) * w_new.unsqueeze(-1)
    acc_lse[:, :, rows] = new


def _for_block(kernel, blk: Block) -> tuple[object, dict]:
    """The kernel that computes ``blk`` and its extra arguments: a block cut by a window's edge
    (``band``) runs in the math kernel, the one that masks it; any other in ``kernel``."""
    if blk.band is None:
        return kernel, {}
    return block_kernel("math", torch.empty(0)), {"band": blk.band}


def _finish(acc_out: torch.Tensor, acc_lse: torch.Tensor, sinks: Optional[torch.Tensor]):
    """The merged rows with the sinks' rescale (:mod:`~megazero.model.attention.sinks`), if any."""
    return (acc_out, acc_lse) if sinks is None else add_sinks(acc_out, acc_lse, sinks)


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
        qt, cur = _bhsd(q), (k.contiguous(), v.contiguous())
        for step in range(size):
            if step < size - 1:  # the next block travels while this one is computed
                nxt, works, sent = ring.exchange(cur, tag=0)
                _count(stats, forward_bytes_sent=sent)
            kt, vt = _bhsd(cur[0]), _bhsd(cur[1])
            src = (rank - step) % size
            for i, (bs, layout) in enumerate(_by_sample(layouts)):
                for j, blk in enumerate(plan_blocks(layout.runs[rank], layout.runs[src], window)):
                    kern, extra = _for_block(kernel, blk)
                    with _drawing(dropout_p, q.device):
                        o, lse, ctx.rngs[src, i, j] = kern.forward(
                            qt[bs, :, blk.q_lo:blk.q_hi], kt[bs, :, blk.k_lo:blk.k_hi], vt[bs, :, blk.k_lo:blk.k_hi],
                            blk.causal, scale, dropout_p, **_keyed(ctx, i, bs, rank, src, blk), **extra)
                    _merge(acc_out[bs], acc_lse[bs], blk, o, lse)
                    _count(stats, forward_pairs=blk.pairs)
            if step < size - 1:
                _wait(works)
                cur = nxt
        acc_out, acc_lse = _finish(acc_out, acc_lse, sinks)
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
        qt, dot, ot = _bhsd(q), _bhsd(grad_out.reshape(s, b, h, dv)), _bhsd(out.reshape(s, b, h, dv))
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


def _drawing(dropout_p: float, device):
    """Where a block kernel's own dropout masks are drawn: the model-parallel stream on ``device``, as
    ``core_attention``'s (tensor-parallel ranks draw apart; recompute replays the stream)."""
    return get_rng_tracker().fork(device=device) if dropout_p > 0.0 else contextlib.nullcontext()


def _on_device(host: list[torch.Tensor], device) -> list[torch.Tensor]:
    """``host`` index tensors on ``device`` in one copy, pinned on CUDA so that it does not wait for the GPU."""
    flat = torch.cat(host)
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split([t.numel() for t in host]))


def _positions(layouts: tuple[CPLayout, ...], device) -> list[list[torch.Tensor]]:
    """Per layout, every rank's token positions (storage order) on ``device``: the dropout masks' keys."""
    p = layouts[0].cp_size
    flat = _on_device([layout.positions(r) for layout in layouts for r in range(p)], device)
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
    kt, vt, dkt, dvt = _bhsd(kv[0]), _bhsd(kv[1]), _bhsd(dk), _bhsd(dv)
    for i, (bs, layout) in enumerate(_by_sample(ctx.layouts)):
        for j, blk in enumerate(plan_blocks(layout.runs[ctx.rank], layout.runs[src], ctx.window)):
            rows, cols = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
            kern, extra = _for_block(ctx.kernel, blk)
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
        qt, kt, vt = _bhsd(q), _bhsd(k), _bhsd(v)
        ctx.blocks, ctx.scale, ctx.kernel, ctx.positions, ctx.dropout, ctx.mask = (blocks, scale, kernel, positions,
                                                                                  dropout, mask)
        ctx.dropout_p, ctx.rngs = dropout_p, []
        for blk in blocks:
            kern, extra = _for_block(kernel, blk)
            with _drawing(dropout_p, q.device):
                o, lse, rng = kern.forward(qt[:, :, blk.q_lo:blk.q_hi], kt[:, :, blk.k_lo:blk.k_hi],
                                           vt[:, :, blk.k_lo:blk.k_hi], blk.causal, scale, dropout_p,
                                           **_extras(ctx, blk), **extra)
            ctx.rngs.append(rng)
            _merge(acc_out, acc_lse, blk, o, lse)
        acc_out, acc_lse = _finish(acc_out, acc_lse, sinks)
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
        qt, kt, vt = _bhsd(q), _bhsd(k), _bhsd(v)
        dot, ot = _bhsd(grad_out.reshape(s, b, h, v_dim)), _bhsd(out.reshape(s, b, h, v_dim))
        dq = torch.zeros(b, h, s, d, dtype=acc, device=q.device)
        dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (k, v))
        dkt, dvt = _bhsd(dk), _bhsd(dv)
        for blk, rng in zip(ctx.blocks, ctx.rngs):
            rows, cols = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
            kern, extra = _for_block(ctx.kernel, blk)
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
    positions = (tuple(_on_device([_run_positions(q_runs), _run_positions(k_runs)], q.device))
                 if dropout is not None else None)
    if mask is not None:
        mask = mask.to(torch.bool).reshape(-1, 1, *mask.shape[-2:]) if mask.dim() != 4 else mask.to(torch.bool)
    return _BlockAttention.apply(q, k, v, tuple(plan_blocks(tuple(q_runs), tuple(k_runs), window)), scale,
                                 _kernel("math" if mask is not None else kernel, q, v, dropout, dropout_p), positions,
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
    return _BlockAttention.apply(q, k, v, blocks, scale, _kernel("math", q, v, dropout, dropout_p), positions, dropout,
                                 mask, dropout_p, sinks)


def _kernel(name: str, q: torch.Tensor, v: torch.Tensor, dropout: Optional[AttentionDropout], dropout_p: float):
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
    ``window``: sliding-window attention, a query at i sees the keys i - window .. i (a rank computes only
    the blocks the window reaches; every block still travels the ring). ``sinks`` ``[heads]``: one sink
    logit per head, applied once after the last merge (:mod:`~megazero.model.attention.sinks`).
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
    return _RingAttention.apply(q, k, v, group, rank, layouts, scale, _kernel(kernel, q, v, dropout, dropout_p),
                                stats, dropout, dropout_p, window, sinks)
