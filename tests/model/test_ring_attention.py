"""Ring (p2p) context-parallel attention against one-process attention of the gathered sequence.

Each rank builds the same full q, k, v, computes the reference on the whole sequence, runs the ring on
its tokens and compares its rows of the output and of dq/dk/dv. Also: the pairs each rank computes,
bytes sent against the formula, and bytes saved for backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.model.attention.cp.layout import (balanced_document_layout, contiguous_layout, document_layout, split_for_rank,
                                      work_per_rank, zigzag_document_layout, zigzag_layout)
from megazero.model.attention.cp.ring import RingStats, ring_attention
from tests.distributed import run_distributed
from tests.helpers import assert_close, randn

B, HEADS, D = 2, 4, 16


def _doc_lengths(p: int) -> list[int]:
    """Four packed documents of unequal lengths, each a multiple of 2P: 32P tokens in all."""
    return [2 * p * n for n in (3, 5, 1, 7)]


def _layout(kind: str, seq: int, p: int):
    if kind == "causal":
        return zigzag_layout(seq, p), None
    if kind == "contiguous":  # the unbalanced baseline
        return contiguous_layout(seq, p), None
    cu = [0]
    for n in _doc_lengths(p):
        cu.append(cu[-1] + n)
    return document_layout(cu, p), cu


def _allowed(seq: int, cu) -> torch.Tensor:
    """[seq, seq] True where query i may attend key j: causal, and within one document."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril_()
    if cu is not None:
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        allowed &= doc[:, None] == doc[None, :]
    return allowed


def _reference(q, k, v, allowed, dtype):
    """One-process attention ``[s, b, heads * dv]``: SDPA in fp32 (bf16 inputs too), the explicit formula in fp64."""
    s, b, h, d = q.shape
    qt, kt, vt = (t.permute(1, 2, 0, 3).to(torch.promote_types(dtype, torch.float32)) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(h // t.size(1), dim=1) for t in (kt, vt))
    if dtype == torch.float64:
        scores = (qt @ kt.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vt
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed)
    return out.permute(2, 0, 1, 3).reshape(s, b, h * v.size(3))


def _inputs(seq, groups, dtype, dv=D):
    """q, k ``[seq, B, heads | groups, D]``, v ``[seq, B, groups, dv]`` and an output gradient."""
    shapes = ((1, HEADS, D), (2, groups, D), (3, groups, dv))
    q, k, v = (randn(seq, B, n, d, seed=s, dtype=dtype).requires_grad_() for s, n, d in shapes)
    return q, k, v, randn(seq, B, HEADS * dv, seed=4, dtype=dtype)


def _ring_case(kind, seq, groups, dtype, kernel, group_ranks=None, q_scale=1.0):
    """On every rank: max |ring - reference| of out, dq, dk, dv, and the ring's counters."""
    group, rank = None, dist.get_rank()
    if group_ranks is not None:  # several CP groups side by side: ranks are translated to global ones
        groups_made = [dist.new_group(r) for r in group_ranks]
        index = next(i for i, r in enumerate(group_ranks) if rank in r)
        group, rank = groups_made[index], group_ranks[index].index(rank)
    p = dist.get_world_size(group)
    layout, cu = _layout(kind, seq, p)
    q, k, v, grad = _inputs(seq, groups, dtype)
    q = (q.detach() * q_scale).requires_grad_()
    ref = _reference(q, k, v, _allowed(seq, cu), dtype)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)

    local = [split_for_rank(t.detach(), rank, p, 0, layout).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, layout, group, kernel=kernel, stats=stats)
    grads = torch.autograd.grad(out, local, split_for_rank(grad, rank, p, 0, layout))
    tol_out, tol_grad = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 2e-2)}[dtype]
    rtol = 1.6e-2 if dtype == torch.bfloat16 else 0.0  # two bf16 ulps
    tol_out *= q_scale
    errors = [_error(out, split_for_rank(ref.detach(), rank, p, 0, layout), "output", tol_out, rtol)]
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        if q_scale == 1:  # with huge logits the gradients are ill-conditioned: only finiteness is checked
            errors.append(_error(got, split_for_rank(want, rank, p, 0, layout), name, tol_grad, rtol))
        assert torch.isfinite(got).all(), name
    return errors, stats, work_per_rank(layout)[rank]


def _error(got, want, what, atol, rtol) -> float:
    """Max |got - want| in their own dtype (fp64 errors are below fp32's resolution); asserts <= atol."""
    want = want.detach().to(got.dtype)  # bf16: the fp32 reference rounded to bf16
    assert_close(got, want, what, atol, rtol)
    return float((got.detach().double() - want.double()).abs().max())


def _check(world, kind, groups, dtype=torch.float32, kernel="auto", seq=None):
    seq = seq or 32 * world
    results = run_distributed(world, _ring_case, kind, seq, groups, dtype, kernel)
    layout, cu = _layout(kind, seq, world)
    for errors, stats, work in results:
        assert stats.forward_pairs == stats.backward_pairs == work, "the ring computes the blocks planned"
    lengths = [seq] if cu is None else _doc_lengths(world)
    total = sum(n * (n + 1) // 2 for n in lengths)
    assert sum(r[1].forward_pairs for r in results) == total, "every unmasked pair once, no masked pair"
    return [max(r[0][i] for r in results) for i in range(4)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["causal", "documents"])
def test_ring_matches_one_process_sdpa(world, kind):
    for groups in (HEADS, 2, 1):
        _check(world, kind, groups)


def test_ring_on_8_ranks():
    for kind in ("causal", "documents"):
        for groups in (HEADS, 2):
            _check(8, kind, groups)
        _check(8, kind, 2, dtype=torch.float64)
    for one, ring, kv_block in run_distributed(8, _saved_case, 256, 2):
        assert ring <= one / 8 + 2 * kv_block, (one, ring, kv_block)


def test_unbalanced_contiguous_layout_is_exact_too():
    _check(4, "contiguous", 2)


@pytest.mark.parametrize("world", [2, 4])
def test_math_kernel_matches_too(world):
    _check(world, "documents", 2, kernel="math")


@pytest.mark.parametrize("world", [2, 4])
def test_fp64_within_1e_12(world):
    for kind in ("causal", "documents"):
        _check(world, kind, 2, dtype=torch.float64)


def test_bf16_against_fp32_attention():
    """bf16 blocks merged in fp32: bf16 rounding of the output and gradients only."""
    _check(4, "documents", 2, dtype=torch.bfloat16)


def test_two_cp_groups_side_by_side():
    """4 ranks as two CP groups of 2: the ring's neighbours are the group's ranks, not the world's."""
    results = run_distributed(4, _ring_case, "causal", 64, 2, torch.float32, "auto", [[0, 2], [1, 3]])
    assert all(stats.forward_bytes_sent > 0 for _, stats, _ in results)


def test_huge_logits_do_not_overflow_the_merge():
    """Logits in the thousands: exp() of them overflows fp32, the max-shifted merge does not."""
    for errors, _, _ in run_distributed(4, _ring_case, "documents", 128, 2, torch.float32, "auto", None, 1000.0):
        assert errors[0] <= 1e-3


# Packed documents of any lengths (no padding to 2P), different in each sample of the batch.
SAMPLE_DOCS = ([0, 5, 23, 24, 41, 64], [0, 37, 64])


def _sample_documents_case(groups, dtype):
    p, rank = dist.get_world_size(), dist.get_rank()
    seq = SAMPLE_DOCS[0][-1]
    layouts = [zigzag_document_layout(cu, p) for cu in SAMPLE_DOCS]
    q, k, v, grad = _inputs(seq, groups, dtype)
    refs = [_reference(*(t[:, i:i + 1] for t in (q, k, v)), _allowed(seq, cu), dtype) for i, cu in enumerate(SAMPLE_DOCS)]
    ref = torch.cat(refs, dim=1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    local = [split_for_rank(t.detach(), rank, p).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, layouts, kernel="auto", stats=stats)
    grads = torch.autograd.grad(out, local, split_for_rank(grad, rank, p))
    tol_out, tol_grad = (1e-12, 1e-12) if dtype == torch.float64 else (1e-6, 1e-5)
    _error(out, split_for_rank(ref.detach(), rank, p), "output", tol_out, 0.0)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _error(got, split_for_rank(want, rank, p), name, tol_grad, 0.0)
    return stats.forward_pairs


@pytest.mark.parametrize("world", [2, 4])
def test_each_sample_its_own_packed_documents_on_the_zigzag_placement(world):
    """Documents of any lengths, different per sample: the ring cuts the zigzag chunks at each sample's
    document boundaries; every unmasked pair of each sample once."""
    for dtype in (torch.float32, torch.float64):
        pairs = run_distributed(world, _sample_documents_case, 2, dtype)
        want = sum(n * (n + 1) // 2 for cu in SAMPLE_DOCS for n in torch.tensor(cu).diff().tolist())
        assert sum(pairs) == want, (pairs, want)


def _balanced_documents_case(groups, dv=D):
    """Each sample's documents balanced over the ranks: its own placement, gathered per sample."""
    p, rank = dist.get_world_size(), dist.get_rank()
    seq = SAMPLE_DOCS[0][-1]
    layouts = [balanced_document_layout(cu, p) for cu in SAMPLE_DOCS]
    q, k, v, grad = _inputs(seq, groups, torch.float32, dv)
    ref = torch.cat([_reference(*(t[:, i:i + 1] for t in (q, k, v)), _allowed(seq, cu), torch.float32)
                     for i, cu in enumerate(SAMPLE_DOCS)], dim=1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    index = torch.stack([x.positions(rank) for x in layouts], dim=1)  # [s_local, b]

    def mine(t):
        return t.gather(0, index.view(*index.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))

    local = [mine(t.detach()).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, layouts, stats=stats)
    grads = torch.autograd.grad(out, local, mine(grad))
    _error(out, mine(ref.detach()), "output", 2e-6, 0.0)  # against fp32 SDPA: a few ulps of each
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _error(got, mine(want), name, 1e-5, 0.0)
    return stats.forward_pairs


@pytest.mark.parametrize("world", [2, 4])
def test_documents_balanced_per_sample(world):
    want = sum(n * (n + 1) // 2 for cu in SAMPLE_DOCS for n in torch.tensor(cu).diff().tolist())
    for dv in (D, 8, 40):  # value heads as wide as the query/key heads, narrower, wider
        pairs = run_distributed(world, _balanced_documents_case, 2, dv)
        assert sum(pairs) == want and max(pairs) / (sum(pairs) / world) <= 1.05, pairs


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_document_layout_holds_s_over_cp_tokens_and_balances_the_work(cp):
    """Exponential document lengths (mean 512 to 8192 tokens) packed into 32K: every rank S/cp tokens,
    every token once, the busiest rank's causal work within 1.05 of the mean (zigzag placement: > 1.3)."""
    import random

    rng = random.Random(cp)
    worst = 0.0
    for mean in (512, 2048, 8192):
        for _ in range(5):
            cu = [0]
            while cu[-1] < 32768:
                cu.append(min(32768, cu[-1] + max(1, int(rng.expovariate(1 / mean)))))
            layout = balanced_document_layout(cu, cp)
            held = torch.cat([layout.positions(r) for r in range(cp)])
            assert all(len(layout.positions(r)) == 32768 // cp for r in range(cp))
            assert torch.equal(held.sort().values, torch.arange(32768))
            work = work_per_rank(layout)
            worst = max(worst, max(work) / (sum(work) / cp))
    assert worst <= 1.05, worst


def test_zigzag_document_layout_places_tokens_as_zigzag():
    for p in (1, 2, 4, 8):
        cu = [0, 3, 17, 18, 40, 64]
        docs, plain = zigzag_document_layout(cu, p), zigzag_layout(64, p)
        for r in range(p):
            assert torch.equal(docs.positions(r), plain.positions(r))
            assert all(cu[d] <= start and start + n <= cu[d + 1] for d, start, n in docs.runs[r])


def _bytes_case(seq, groups, dtype, dv=D):
    p, rank = dist.get_world_size(), dist.get_rank()
    layout = zigzag_layout(seq, p)
    q, k, v, grad = _inputs(seq, groups, dtype, dv)
    local = [split_for_rank(t.detach(), rank, p, 0, layout).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, layout, kernel="math", stats=stats)
    out.backward(split_for_rank(grad, rank, p, 0, layout))
    return stats


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_equal_the_formula(world):
    seq, groups = 16 * world, 2
    for dtype, dv in ((torch.float32, D), (torch.bfloat16, D), (torch.float32, 8)):  # dv: the value heads' width
        elem = torch.empty(0, dtype=dtype).element_size()
        block = seq // world * B * groups * (D + dv)  # elements of a key and a value block: groups heads, not HEADS
        for stats in run_distributed(world, _bytes_case, seq, groups, dtype, dv):
            assert stats.forward_bytes_sent == block * (world - 1) * elem
            # backward: the key/value blocks again, and the fp32 dK/dV accumulators once around the whole ring
            assert stats.backward_bytes_sent == block * (world - 1) * elem + block * world * 4


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _saved_case(seq, groups):
    p, rank = dist.get_world_size(), dist.get_rank()
    layout = zigzag_layout(seq, p)
    q, k, v, _ = _inputs(seq, groups, torch.float32)
    full = [t.detach().permute(1, 2, 0, 3).contiguous().requires_grad_() for t in (q, k, v)]
    one = _saved_bytes(lambda: F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True))
    local = [split_for_rank(t.detach(), rank, p, 0, layout).requires_grad_() for t in (q, k, v)]
    ring = _saved_bytes(lambda: ring_attention(*local, layout))
    return one, ring, 2 * local[1].numel() * local[1].element_size()


@pytest.mark.parametrize("world", [2, 4])
def test_saved_for_backward_is_the_share_of_one_process(world):
    for one, ring, kv_block in run_distributed(world, _saved_case, 32 * world, 2):
        assert one > 0 and ring <= one / world + 2 * kv_block, (one, ring, kv_block)


class _CountingKernel:
    """A registered kernel wrapping the math one: shows the hook reaches forward and backward."""

    def __init__(self):
        from megazero.model.attention.block_kernels import block_kernel
        self.inner, self.calls = block_kernel("math", torch.zeros(1, dtype=torch.float64)), []

    def forward(self, *args):
        self.calls.append("forward")
        return self.inner.forward(*args)

    def backward(self, *args):
        self.calls.append("backward")
        return self.inner.backward(*args)


def test_one_rank_strided_inputs_and_a_registered_kernel():
    """Without a process group the ring is one block: plain causal attention, here on views of a wider tensor."""
    from megazero.model.attention.block_kernels import register_block_kernel

    kernel = _CountingKernel()
    register_block_kernel("counting", kernel)
    wide = randn(32, B, HEADS + 4, D, seed=5).requires_grad_()
    q, k, v = wide[:, :, :HEADS], wide[:, :, HEADS:HEADS + 2], wide[:, :, HEADS + 2:]
    out = ring_attention(q, k, v, zigzag_layout(32, 1), kernel="counting")
    grad = randn(32, B, HEADS * D, seed=6)
    got = torch.autograd.grad(out, wide, grad)[0]
    ref = _reference(q, k, v, _allowed(32, None), torch.float32)
    want = torch.autograd.grad(ref, wide, grad)[0]
    _error(out, ref, "output", 1e-6, 0.0)
    _error(got, want, "grad", 1e-5, 0.0)
    assert kernel.calls == ["forward", "backward"]


def test_mismatched_inputs_are_refused():
    q, kv = torch.zeros(16, B, HEADS, D), torch.zeros(16, B, 3, D)
    with pytest.raises(ValueError, match="layout is for 2 context-parallel ranks but the group has 1"):
        ring_attention(q, q, q, zigzag_layout(32, 2))
    with pytest.raises(ValueError, match="query heads 4 are not a multiple of key/value groups 3"):
        ring_attention(q, kv, kv, zigzag_layout(16, 1))
    with pytest.raises(ValueError, match="this rank holds 16 tokens but the layout gives each rank 32"):
        ring_attention(q, q, q, zigzag_layout(32, 1))
    with pytest.raises(ValueError, match="unknown ring attention block kernel 'nope'"):
        ring_attention(q, q, q, zigzag_layout(16, 1), kernel="nope")


@pytest.mark.parametrize("device, dtype, head_dim, want", [
    ("cuda", torch.bfloat16, 128, "cuda_flash"), ("cuda", torch.float16, 64, "cuda_flash"),
    ("cuda", torch.bfloat16, 72 + 1, "cuda_efficient"), ("cuda", torch.float32, 128, "cuda_efficient"),
    ("cuda", torch.float64, 64, "math"), ("cpu", torch.float32, 64, "cpu_flash"),
    ("cpu", torch.bfloat16, 64, "cpu_flash"), ("cpu", torch.float64, 64, "math"), ("meta", torch.bfloat16, 64, "cuda_flash"),
    ("meta", torch.float32, 64, "cuda_efficient")])
def test_auto_kernel_by_device_and_dtype(device, dtype, head_dim, want):
    import types

    from megazero.model.attention.block_kernels import _KERNELS, block_kernel

    q = types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 4, 16, head_dim))
    assert block_kernel("auto", q) is _KERNELS[want]


@pytest.mark.parametrize("name, dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernels_keep_the_block_contract_on_meta_tensors(name, dtype, causal):
    """torch's CUDA ops have meta implementations: the kernels' argument lists, GQA folding and the
    efficient op's padded LSE are checked here for shapes and dtypes (the numbers by scripts/gpu_check.sh)."""
    from megazero.model.attention.block_kernels import block_kernel

    b, h, g, n, d = 2, 8, 2, 40, 64
    wide = torch.empty(n, b, h + 2 * g, d, device="meta", dtype=dtype)  # [s, b, heads, d] views, as the ring passes
    q, k, v = (t.permute(1, 2, 0, 3) for t in (wide[:, :, :h], wide[:, :, h:h + g], wide[:, :, h + g:]))
    kernel = block_kernel(name, q)
    out, lse, _ = kernel.forward(q, k, v, causal, 0.125)
    assert out.shape == (b, h, n, d) and out.dtype == dtype
    assert lse.shape == (b, h, n) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(torch.empty_like(out), q, k, v, out, lse, causal, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, (dq.shape, dk.shape, dv.shape)
    ring = ring_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), zigzag_layout(n, 1), kernel=name)
    assert ring.shape == (n, b, h * d)
