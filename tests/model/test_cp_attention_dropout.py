"""Attention dropout keyed by position: element (sample, global head, query index, key index, layer) ->
keep/drop, so every split of the sequence (context parallelism), of the heads (tensor parallelism,
the all-to-all's head split) and of the batch sees the bits of the whole sequence's mask; and every
exchange (p2p ring, a2a, allgather, a2a+p2p) with dropout equals the one-process attention with that
mask, output and gradients, in fp64 to 1e-12. With the kernels' own masks (--dropout-rng stream, the
default: Megatron's), the masks scale the probabilities at the drop rate and every exchange's gradients
are those of the masks its forward drew (against central differences of forwards from the same stream)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megazero.model.attention.core import core_attention
from megazero.model.attention.cp.exchanges import SequenceShard, a2a_attention, allgather_attention
from megazero.model.attention.cp.hierarchical import Hierarchy, hierarchical_attention
from megazero.model.attention.cp.layout import balanced_document_layout, split_for_rank, zigzag_layout
from megazero.model.keyed_dropout import AttentionDropout, sample_keys
from megazero.model.attention.cp.ring import ring_attention
from megazero.model.attention.block_kernels import _MathKernel
from tests.distributed import run_distributed
from tests.model.test_cp_hierarchical import _groups

P = 0.25
S, B, HEADS, GROUPS, D = 32, 2, 4, 2, 8


def _dropout(heads=range(HEADS), layer: int = 3, ids=(5, 9)) -> AttentionDropout:
    return AttentionDropout(P, sample_keys(11, torch.tensor(ids)), torch.tensor(list(heads)), layer)


@pytest.mark.parametrize("cp", [2, 4])
def test_masks_of_any_split_are_blocks_of_the_whole_sequence_mask(cp):
    whole = _dropout(range(8)).keep(torch.arange(64), torch.arange(64))  # [b, h, S, S]
    layout = zigzag_layout(64, cp)
    for r in range(cp):
        rows = layout.positions(r)
        for j in range(cp):  # the ring: this rank's queries against rank j's keys
            cols = layout.positions(j)
            assert torch.equal(_dropout(range(8)).keep(rows, cols), whole[:, :, rows][:, :, :, cols])
        # tensor parallelism (or the all-to-all) holds a slice of the heads, data parallelism of the samples
        part = _dropout(range(8)).select(slice(1, 2), slice(4 + r % 2 * 2, 6 + r % 2 * 2))
        assert torch.equal(part.keep(rows, torch.arange(64)), whole[1:2, 4 + r % 2 * 2:6 + r % 2 * 2, rows])
        assert torch.equal(_dropout(range(4 + r % 2 * 2, 6 + r % 2 * 2), ids=(9,)).keep(rows, torch.arange(64)),
                           whole[1:2, 4 + r % 2 * 2:6 + r % 2 * 2, rows])


def test_drop_rate_independence_and_sites():
    m = _dropout(range(8), ids=range(4)).keep(torch.arange(256), torch.arange(256)).float()
    n = m.numel()
    assert abs(m.mean().item() - (1 - P)) < 4 * (P * (1 - P) / n) ** 0.5
    for a, b in ((m[..., :-1], m[..., 1:]), (m[:, :, :-1], m[:, :, 1:]), (m[:, :-1], m[:, 1:]), (m[:-1], m[1:])):
        corr = ((a - a.mean()) * (b - b.mean())).mean() / a.var()
        assert abs(corr.item()) < 0.01, corr
    base = _dropout().keep(torch.arange(64), torch.arange(64))
    other = _dropout(layer=4).keep(torch.arange(64), torch.arange(64))
    agree = (base == other).float().mean().item()
    assert abs(agree - (P * P + (1 - P) ** 2)) < 0.03, agree  # another layer: independent coins


def _reference(q, k, v, dropout, allowed):
    """The explicit formula with the whole sequence's mask: q [s, b, h, d], k/v [s, b, g, d] -> [s, b, h*d]."""
    s, b, h, d = q.shape
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(h // t.size(1), dim=1) for t in (kt, vt))
    scores = (qt @ kt.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout is not None:
        probs = probs * dropout.keep(torch.arange(s), torch.arange(s)) / (1 - dropout.p)
    return (probs @ vt).permute(2, 0, 1, 3).reshape(s, b, h * d)


def _inputs(seed: int = 2, seq: int = S):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, B, n, D, generator=g, dtype=torch.float64).requires_grad_()
               for n in (HEADS, GROUPS, GROUPS))
    return q, k, v, torch.randn(seq, B, HEADS * D, generator=g, dtype=torch.float64)


def _worst(got, want) -> float:
    return max(float((a - b).detach().abs().max()) for a, b in zip(got, want))


@pytest.mark.parametrize("tile", [1 << 22, 7 * 7 * B * HEADS])  # one tile, and 7 x 7 tiles with ragged edges
@pytest.mark.parametrize("causal", [True, False])
def test_math_kernel_tiles_apply_the_masks_forward_and_backward(tile, causal):
    q, k, v, _ = _inputs()
    qt, kt, vt = (t.detach().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    drop, pos = _dropout(), torch.arange(S)
    mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(1)) < 0.2
    mask[..., torch.arange(S), torch.arange(S)] = False  # every row keeps a key
    allowed = ~mask & (torch.ones(S, S, dtype=torch.bool).tril() if causal else True)
    ref = _reference(*(t.permute(2, 0, 1, 3) for t in (qt, kt, vt)), drop, allowed)
    ref = ref.reshape(S, B, HEADS, D).permute(1, 2, 0, 3)
    dout = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (qt, kt, vt), dout)
    kernel = _MathKernel(tile_elements=tile)
    out, lse, _ = kernel.forward(qt, kt, vt, causal, 1 / math.sqrt(D), dropout=drop, positions=(pos, pos), mask=mask)
    got = kernel.backward(dout, qt, kt, vt, out, lse, causal, 1 / math.sqrt(D), dropout=drop, positions=(pos, pos),
                          mask=mask)
    assert _worst([out], [ref]) < 1e-12
    assert _worst(got, want) < 1e-12


def test_core_attention_with_keyed_dropout_is_the_formula_and_tensor_parallel_heads_its_columns():
    q, k, v, go = _inputs()
    drop = _dropout()
    ref = _reference(q, k, v, drop, torch.ones(S, S, dtype=torch.bool).tril())
    want = torch.autograd.grad(ref, (q, k, v), go)
    out = core_attention(q, k, v, backend="sdpa", dropout=drop)
    assert _worst([out, *torch.autograd.grad(out, (q, k, v), go)], [ref, *want]) < 1e-12
    # tp 2: rank 1 holds query heads 2, 3 (KV group 1) and keys its masks by those global heads
    half = [t[:, :, sl].detach().requires_grad_() for t, sl in ((q, slice(2, 4)), (k, slice(1, 2)), (v, slice(1, 2)))]
    part = core_attention(*half, dropout=_dropout(range(2, 4)))
    assert _worst([part], [ref[:, :, 2 * D:]]) < 1e-12
    assert not torch.allclose(ref, _reference(q, k, v, None, torch.ones(S, S, dtype=torch.bool).tril()))


def _exchange(kind: str):
    """One rank of a cp group: the exchange ``kind`` with keyed dropout against the one-process formula;
    returns the largest difference of output and gradients over this rank's rows."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    seq = 64 if kind in ("a2a+p2p", "balanced") else S
    q, k, v, go = _inputs(seq=seq)
    drop = _dropout()
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    layout = zigzag_layout(seq, cp)
    docs = None
    if kind in ("allgather+documents", "balanced"):
        cu = [0, 9, 30, seq] if kind == "balanced" else [0, 8, 24, seq]
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        docs = doc[:, None] != doc[None, :]
        allowed &= ~docs
        if kind == "balanced":
            layout = balanced_document_layout(cu, cp)
    ref = _reference(q, k, v, drop, allowed)
    want = torch.autograd.grad(ref, (q, k, v), go)
    local = [split_for_rank(t.detach(), rank, cp, layout=layout).requires_grad_() for t in (q, k, v)]
    shard = SequenceShard.from_rank_positions([layout.positions(r) for r in range(cp)], rank)
    if kind in ("p2p", "balanced"):
        out = ring_attention(*local, layout if kind == "p2p" else [layout] * B, None, dropout=drop)
    elif kind == "a2a":
        out = a2a_attention(*local, shard, None, dropout=drop)
    elif kind == "allgather":
        out = allgather_attention(*local, shard, None, layout=layout, dropout=drop)
    elif kind == "allgather+documents":
        out = allgather_attention(*local, shard, None, attention_mask=docs, dropout=drop)
    else:
        inner, outer = _groups(cp, 2)
        out = hierarchical_attention(*local, Hierarchy.build(seq, 2, cp // 2, inner, outer), dropout=drop)
    got = torch.autograd.grad(out, local, split_for_rank(go, rank, cp, layout=layout))
    return _worst([out, *got], [split_for_rank(t, rank, cp, layout=layout) for t in (ref.detach(), *want)])


@pytest.mark.parametrize("kind,world", [("p2p", 2), ("p2p", 4), ("a2a", 2), ("allgather", 2), ("allgather", 4),
                                        ("allgather+documents", 2), ("balanced", 2), ("a2a+p2p", 4)])
def test_every_exchange_with_keyed_dropout_equals_one_process(kind, world):
    assert max(run_distributed(world, _exchange, kind)) < 1e-12


def _a2a_kernel_masks():
    from megazero.mpu.random import model_parallel_manual_seed

    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, go = _inputs()
    layout = zigzag_layout(S, cp)
    local = [split_for_rank(t.detach(), rank, cp, layout=layout) for t in (q, k, v)]
    shard = SequenceShard.from_rank_positions([layout.positions(r) for r in range(cp)], rank)
    outs = []
    for p in (0.0, P, P):
        model_parallel_manual_seed(3, tp_rank=0)
        outs.append(a2a_attention(*local, shard, None, backend="sdpa", dropout_p=p))
    return not torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def test_a2a_takes_the_kernels_own_masks_from_the_model_parallel_stream():
    # --dropout-rng stream: Ulysses runs the fused kernel on the whole sequence, which draws its masks
    assert run_distributed(2, _a2a_kernel_masks) == [True, True]


# ---- the kernels' own masks (--dropout-rng stream, the default: Megatron's, masks follow the layout) ----

def _seeded(fn):
    """``fn`` run from the same model-parallel stream each time (a forward's masks are a function of it)."""
    from megazero.mpu.random import model_parallel_manual_seed

    def run(*args):
        model_parallel_manual_seed(3, tp_rank=0)
        return fn(*args)
    return run


def test_math_kernel_draws_masks_that_scale_the_probabilities():
    # One-hot values make the output the dropped probabilities themselves: out[i, j] = P_ij M_ij / (1 - p).
    from megazero.model.attention.tiled import block_attention
    from megazero.model.attention.block_kernels import _MathKernel, register_block_kernel

    register_block_kernel("math_7x7_tiles", _MathKernel(tile_elements=7 * 7 * HEADS))  # ragged tiles, several blocks
    seq, layout = 48, zigzag_layout(48, 2)
    q_runs, k_runs = layout.runs[0], sorted((r for runs in layout.runs for r in runs), key=lambda r: r[1])
    rows = layout.positions(0)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(rows.numel(), 1, HEADS, D, generator=g, dtype=torch.float64)
    k = torch.randn(seq, 1, GROUPS, D, generator=g, dtype=torch.float64)
    eye = torch.eye(seq, dtype=torch.float64)[:, None, None, :].expand(seq, 1, GROUPS, seq)
    attend = _seeded(lambda p: block_attention(q, k, eye, q_runs, k_runs, kernel="math_7x7_tiles", dropout_p=p)
                     .view(-1, HEADS, seq))
    probs, out = attend(0.0), attend(P)
    kept = out != 0
    assert torch.allclose(out[kept], probs[kept] / (1 - P), rtol=1e-12, atol=0)
    causal = (rows[:, None, None] >= torch.arange(seq)[None, None, :]).expand_as(out)
    assert torch.equal(probs != 0, causal)
    dropped = (causal & ~kept).sum().item() / causal.sum().item()
    assert abs(dropped - P) < 4 * (P * (1 - P) / causal.sum().item()) ** 0.5, dropped
    assert torch.equal(out, attend(P))  # the same stream, the same masks


def _directional_derivative(kind: str):
    """One cp rank with the kernels' own masks: the derivative of sum(out . go) over all ranks along a
    direction, from the gradients and from central differences of forwards drawn from the same stream
    (relative difference); they agree only if backward applies forward's masks in every block of every
    ring step and every tile."""
    from megazero.model.attention.block_kernels import _MathKernel, register_block_kernel

    register_block_kernel("math_5x5_tiles", _MathKernel(tile_elements=5 * 5 * B * HEADS))
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, go = _inputs()
    layout = zigzag_layout(S, cp)
    shard = SequenceShard.from_rank_positions([layout.positions(r) for r in range(cp)], rank)
    local = [split_for_rank(t.detach(), rank, cp, layout=layout) for t in (q, k, v)]
    gen = torch.Generator().manual_seed(9)
    direction = [split_for_rank(torch.randn(t.shape, generator=gen, dtype=t.dtype), rank, cp, layout=layout)
                 for t in (q, k, v)]
    go = split_for_rank(go, rank, cp, layout=layout)

    @_seeded
    def loss(*t):
        if kind == "p2p":
            out = ring_attention(*t, layout, None, kernel="math_5x5_tiles", dropout_p=P)
        elif kind == "allgather":
            out = allgather_attention(*t, shard, None, layout=layout, dropout_p=P)
        else:
            out = hierarchical_attention(*t, Hierarchy.build(S, 2, cp // 2, *_groups(cp, 2)), dropout_p=P)
        return (out * go).sum()

    x = [t.clone().requires_grad_() for t in local]
    analytic = sum((g_ * d).sum() for g_, d in zip(torch.autograd.grad(loss(*x), x), direction))
    eps = 1e-6
    plus = loss(*(t + eps * d for t, d in zip(local, direction)))
    minus = loss(*(t - eps * d for t, d in zip(local, direction)))
    both = torch.stack([analytic, (plus - minus) / (2 * eps)]).detach()
    dist.all_reduce(both)
    return (both[0] - both[1]).abs().item() / both[0].abs().item()


@pytest.mark.parametrize("kind,world", [("p2p", 2), ("allgather", 2), ("a2a+p2p", 4)])
def test_exchanges_with_the_kernels_own_masks_backpropagate_through_the_masks_they_drew(kind, world):
    assert max(run_distributed(world, _directional_derivative, kind)) < 1e-7


@pytest.mark.parametrize("name, dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
def test_cuda_kernels_draw_their_own_masks_and_replay_them_in_backward_on_meta(name, dtype):
    """torch's CUDA ops with dropout, on meta tensors: the Philox state forward returns is what backward
    takes (the values by scripts/gpu_check.sh)."""
    from megazero.model.attention.block_kernels import block_kernel

    q = torch.empty(2, 8, 40, 64, device="meta", dtype=dtype)
    k = torch.empty(2, 2, 40, 64, device="meta", dtype=dtype)
    kernel = block_kernel(name, q, dropout=True)
    out, lse, rng = kernel.forward(q, k, k, True, 0.125, 0.1)
    assert rng is not None and out.shape == q.shape
    dq, dk, dv = kernel.backward(torch.empty_like(out), q, k, k, out, lse, True, 0.125, 0.1, rng)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_auto_picks_a_kernel_that_draws_dropout():
    from megazero.model.attention.block_kernels import _KERNELS, block_kernel

    gpu = torch.empty(1, 4, 16, 64, device="meta", dtype=torch.bfloat16)  # the rehearsal's stand-in for CUDA
    assert block_kernel("auto", gpu, dropout=True) is _KERNELS["cuda_flash"]
    cpu = torch.empty(1, 4, 16, 64)
    assert block_kernel("auto", cpu) is _KERNELS["cpu_flash"]
    assert block_kernel("auto", cpu, dropout=True) is _KERNELS["math"]  # torch's CPU flash op has no dropout
    with pytest.raises(ValueError, match="applies no attention dropout"):
        block_kernel("cpu_flash", cpu, dropout=True)
