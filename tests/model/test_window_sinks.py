"""Sliding-window attention and attention sinks, against transformers' gpt-oss attention (its eager
formula with the sink column, and its sliding-window mask function): one process in every backend,
and every context-parallel exchange at cp 2 and 4 with windows shorter and longer than a shard, packed
documents on the ring. The blocks a rank computes cover exactly the window's pairs, once each."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

from megazero.model.attention.core import core_attention
from megazero.model.attention.cp.context import ContextParallel, context_parallel_attention
from megazero.model.attention.cp.hierarchical import Hierarchy
from megazero.model.attention.cp.layout import (plan_blocks, split_for_rank, work_per_rank, zigzag_document_layout,
                                                zigzag_layout)
from megazero.mpu import group_ranks
from tests.distributed import run_distributed

B, HEADS, D = 2, 4, 8


def _hf(q, k, v, window, sinks, cu=None):
    """transformers' gpt-oss eager attention ``[s, b, heads * d]`` (sinks None: a zero-weight sink, i.e.
    -inf), its mask from transformers' sliding-window function (HF's window W is megazero's W - 1)."""
    from transformers.masking_utils import sliding_window_causal_mask_function  # not in every rank's import
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s, b, h, d = q.shape
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    if window is None:
        allowed = j <= i
    else:
        allowed = sliding_window_causal_mask_function(window + 1)(0, 0, i, j)
    if cu is not None:
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        allowed = allowed & (doc[:, None] == doc[None, :])
    mask = torch.zeros(s, s, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    sink = sinks if sinks is not None else torch.full((h,), float("-inf"), dtype=q.dtype)
    module = types.SimpleNamespace(num_key_value_groups=h // k.size(2), sinks=sink, training=False)
    out, _ = eager_attention_forward(module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask, 1 / math.sqrt(d))
    return out.transpose(0, 1).reshape(s, b, h * v.size(3))


def _inputs(seq, groups, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, B, n, D, generator=g, dtype=dtype).requires_grad_() for n in (HEADS, groups, groups))
    sinks = torch.randn(HEADS, generator=g, dtype=dtype).requires_grad_()
    return q, k, v, sinks, torch.randn(seq, B, HEADS * D, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_core_attention_equals_transformers(dtype, backend):
    seq = 40
    q, k, v, sinks, grad = _inputs(seq, 2, dtype)
    tol = 1e-12 if dtype == torch.float64 and backend == "sdpa" else 2e-6
    for window in (None, 0, 3, 16, 60):
        for with_sinks in (False, True):
            sk = sinks if with_sinks else None
            leaves = (q, k, v) + ((sinks,) if with_sinks else ())
            want = _hf(q, k, v, window, sk)
            got = core_attention(q, k, v, backend=backend, window=window, sinks=sk)
            assert (got - want).abs().max() <= tol, (window, with_sinks)
            for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
                assert (a - b).abs().max() <= 5 * tol, (window, with_sinks)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_long_windows_split_into_fast_blocks_equal_transformers(dtype, tol):
    """300 tokens, windows of 150 and 200 keys: the window's edge is cut into fully visible blocks (in fp32
    torch's flash op) and 64-wide edge blocks (the math kernel)."""
    q, k, v, sinks, grad = _inputs(300, 2, dtype)
    for window in (150, 200):
        want = _hf(q, k, v, window, sinks)
        got = core_attention(q, k, v, backend="sdpa", window=window, sinks=sinks)
        assert (got - want).abs().max() <= tol
        for a, b in zip(torch.autograd.grad(got, (q, k, v, sinks), grad),
                        torch.autograd.grad(want, (q, k, v, sinks), grad)):
            assert (a - b).abs().max() <= 10 * tol


def _covered(layout, window):
    """[S, S] how many planned blocks compute each (query, key) pair over every rank's ring."""
    seen = torch.zeros(layout.seq_len, layout.seq_len, dtype=torch.long)
    for r in range(layout.cp_size):
        qpos = layout.positions(r)
        for j in range(layout.cp_size):
            kpos = layout.positions(j)
            for blk in plan_blocks(layout.runs[r], layout.runs[j], window):
                rows, cols = torch.arange(blk.q_hi - blk.q_lo)[:, None], torch.arange(blk.k_hi - blk.k_lo)[None, :]
                ok = torch.ones(rows.size(0), cols.size(1), dtype=torch.bool)
                if blk.causal:
                    ok &= cols <= rows
                if blk.band is not None:
                    ok &= cols >= rows + blk.band
                assert int(ok.sum()) == blk.pairs
                q_idx, k_idx = qpos[blk.q_lo:blk.q_hi], kpos[blk.k_lo:blk.k_hi]
                seen[q_idx[:, None].expand_as(ok)[ok], k_idx[None, :].expand_as(ok)[ok]] += 1
    return seen


@pytest.mark.parametrize("cp,cu,seq,windows", [
    (2, None, 64, (0, 1, 5, 7, 8, 20, 63)), (4, None, 64, (0, 1, 5, 7, 8, 20, 63)),
    (2, [0, 9, 30, 31, 64], 64, (0, 1, 5, 7, 8, 20, 63)), (4, [0, 50, 64], 64, (0, 1, 5, 7, 8, 20, 63)),
    (1, None, 600, (100, 257, 598)), (2, [0, 200, 600], 600, (150, 333)),  # edges split into fast blocks
])
def test_windowed_blocks_cover_the_window_once(cp, cu, seq, windows):
    layout = zigzag_layout(seq, cp) if cu is None else zigzag_document_layout(cu, cp)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    doc = torch.zeros(seq, dtype=torch.long) if cu is None else torch.repeat_interleave(
        torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    for window in windows:
        want = (j <= i) & (i - j <= window) & (doc[:, None] == doc[None, :])
        assert torch.equal(_covered(layout, window), want.long()), window
        assert sum(work_per_rank(layout, window)) == int(want.sum())  # the window's pairs, no more


def _groups(cp: int, a2a: int):
    lines = group_ranks(cp, 1, 1, cp, (a2a, cp // a2a))
    made = {kind: [dist.new_group(line) for line in lines[kind]] for kind in ("hcp_a2a", "hcp_p2p")}
    rank = dist.get_rank()
    return [next(g for g, line in zip(made[kind], lines[kind]) if rank in line) for kind in ("hcp_a2a", "hcp_p2p")]


def _references(groups, windows, cu, dtype):
    """Per case (window, inputs, sinks or None, output gradient, transformers' output and gradients),
    computed here: the ranks do not import transformers."""
    cases = []
    for window in windows:
        for with_sinks in (False, True):
            q, k, v, sinks, grad = _inputs(64, groups, dtype, seed=window or 0)
            sk = sinks if with_sinks else None
            want = _hf(q, k, v, window, sk, cu)
            wants = torch.autograd.grad(want, (q, k, v) + ((sinks,) if with_sinks else ()), grad)
            cases.append((window, [t.detach() for t in (q, k, v)], None if sk is None else sk.detach(), grad,
                          want.detach(), wants))
    return cases


def _cp_case(kind: str, cases, cu):
    cp, rank = dist.get_world_size(), dist.get_rank()
    seq = 64
    hierarchy = Hierarchy.build(seq, 2, cp // 2, *_groups(cp, 2)) if kind == "a2a+p2p" else None
    ctx = ContextParallel.from_layout(zigzag_layout(seq, cp), rank, None, kind, hierarchy=hierarchy)
    mask = None
    if cu is not None:
        ctx = ctx.with_documents([cu] * B)
        i = torch.arange(seq)
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        mask = (doc[:, None] != doc[None, :]) | (i[None, :] > i[:, None])
    worst = 0.0
    for window, qkv, sinks, grad, want, wants in cases:
        local = [split_for_rank(t, rank, cp).requires_grad_() for t in qkv]
        sk = None if sinks is None else sinks.clone().requires_grad_()
        out = context_parallel_attention(*local, ctx, backend="auto", window=window, sinks=sk,
                                         attention_mask=None if kind == "p2p" else mask)
        gots = torch.autograd.grad(out, local + ([] if sk is None else [sk]), split_for_rank(grad, rank, cp))
        worst = max(worst, float((out.detach() - split_for_rank(want, rank, cp)).abs().max()))
        for a, b in zip(gots[:3], wants[:3]):
            worst = max(worst, float((a - split_for_rank(b, rank, cp)).abs().max()))
        if sk is not None:  # each rank holds its rows' share of the sink's gradient: summed over the group
            d_sinks = gots[3].clone()
            dist.all_reduce(d_sinks)
            worst = max(worst, float((d_sinks - wants[3]).abs().max()))
    return worst


@pytest.mark.parametrize("world,kind", [(2, "p2p"), (4, "p2p"), (2, "a2a"), (4, "a2a"), (2, "allgather"),
                                        (4, "allgather"), (4, "a2a+p2p")])
def test_context_parallel_windows_and_sinks_equal_one_process(world, kind):
    """Windows of 3 keys (shorter than a zigzag chunk: 8 tokens at cp 4, 16 at cp 2; the ring's ranks
    exchange halos), 20 (longer than a chunk), 40 (the ring itself at cp 4) and the whole sequence; with and
    without sinks; GQA."""
    windows = (3, 20, 40, None)
    for groups in (2, 4):
        worst = run_distributed(world, _cp_case, kind, _references(groups, windows, None, torch.float32), None)
        assert max(worst) < 2e-5, worst
    if kind != "a2a+p2p":  # packed documents: the ring cuts its blocks at them, the others take the mask
        cu = [0, 9, 30, 31, 64]
        worst = run_distributed(world, _cp_case, kind, _references(2, (3, 20), cu, torch.float32), cu)
        assert max(worst) < 2e-5, worst


def test_a_short_window_exchanges_halos_and_a_long_one_the_ring():
    """Zigzag at cp 4, 64 tokens (chunks of 8): with a window of 3 keys rank r reads the last cell (window + 1
    = 4 keys) of chunk r-1 (rank r-1's first run) and of chunk 6-r (rank r+1's second run), nothing else; a
    window of 40 would have each rank read more than two shards, so the ring runs."""
    from megazero.model.attention.cp.halo import halo_of

    layout = (zigzag_layout(64, 4),)
    halo = halo_of(layout, 1, 3)
    assert halo.recv == ((0, 4, 8), (2, 12, 16))  # chunk 0's tail; chunk 5 (rank 2's second run)'s tail
    assert halo.send == ((0, 12, 16), (2, 4, 8))  # chunk 6's tail to rank 0, chunk 1's to rank 2
    assert halo_of(layout, 0, 3).recv == ((1, 12, 16),)  # chunk 0 starts the sequence; chunk 7 reads chunk 6
    assert halo_of(layout, 1, 40) is None


def _halo_bytes(window: int):
    from megazero.model.attention.cp.ring import RingStats, ring_attention

    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, _, grad = _inputs(64, 2, torch.float32)
    local = [split_for_rank(t.detach(), rank, cp).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, zigzag_layout(64, cp), None, stats=stats, window=window)
    out.backward(split_for_rank(grad, rank, cp))
    return stats.forward_bytes_sent, stats.backward_bytes_sent


def test_the_planner_counts_the_halo_a_middle_rank_sends():
    """cp 4, a window of 3 keys: a middle rank sends one cell of 4 keys to each neighbour and receives their
    gradients' worth back, what planner_traffic charges a layer; the ring would send 3 shards of 16."""
    from megazero.model.config import GPTConfig
    from megazero.observe.planner_traffic import cp_bytes_per_layer

    sent = run_distributed(4, _halo_bytes, 3)
    per_token = B * 2 * (D + D) * 4  # two KV groups, K and V, fp32
    assert sent[1] == sent[2] == (8 * per_token, 8 * per_token)
    assert sent[0][0] == sent[3][0] == 4 * per_token  # the sequence's ends have one neighbour to feed
    config = GPTConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, num_query_groups=2,
                       seq_length=64, max_position_embeddings=64, vocab_size=64, window_size=(3, 0))
    planned = cp_bytes_per_layer(config, tp=1, cp=4, seq_length=64, micro_batch_size=B, precision="fp32",
                                 recompute=None, kind="p2p", window=3)
    assert planned == sum(sent[1])
    ring = cp_bytes_per_layer(config, tp=1, cp=4, seq_length=64, micro_batch_size=B, precision="fp32",
                              recompute=None, kind="p2p")
    assert ring > 5 * planned
