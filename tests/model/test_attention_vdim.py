"""Value heads of another width than query/key heads (multi-latent attention: q/k of qk_head_dim +
qk_pos_emb_head_dim, v of v_head_dim), narrower and wider, with GQA: every core backend, every ring
block kernel and every context-parallel exchange (p2p, a2a, allgather, a2a+p2p; causal and packed
documents) against the explicit formula in fp64 (fp32 inputs within 1e-5), forward and the gradients
of q, k and v; and the bytes each exchange sends (K at dqk, V at dv) against its formula and the
planner's."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.model.attention import core
from megazero.model.attention.core import core_attention
from megazero.model.attention.cp.exchanges import a2a_elements, allgather_elements
from megazero.model.attention.cp.context import ContextParallel, context_parallel_attention
from megazero.model.attention.cp.hierarchical import Hierarchy
from megazero.model.attention.cp.layout import split_for_rank, zigzag_layout
from megazero.model.attention.cp.ring import RingStats, ring_attention
from megazero.model.attention.block_kernels import _KERNELS, _OneWidth, block_kernel
from megazero.model.config import GPTConfig
from megazero.model.keyed_dropout import AttentionDropout, sample_keys
from megazero.mpu.cp_exchange import CommCounter
from megazero.observe.planner_traffic import cp_bytes_per_layer
from tests.distributed import run_distributed
from tests.model.test_cp_hierarchical import _groups

S, B, HEADS, DQK = 32, 2, 4, 24
V_WIDTHS = (8, 40)  # narrower and wider than DQK
DOCS = ([0, 9, 30, 31, 64], [0, 50, 64])  # packed documents of a 64-token sequence, per sample


def _inputs(seq: int, groups: int, dv: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(seq, B, n, DQK, generator=g, dtype=dtype) for n in (HEADS, groups))
    v = torch.randn(seq, B, groups, dv, generator=g, dtype=dtype)
    return q, k, v, torch.randn(seq, B, HEADS * dv, generator=g, dtype=dtype)


def _allowed(seq: int, docs=None) -> torch.Tensor:
    """``[b, 1, s, s]`` may-attend: causal, and within each sample's documents when ``docs`` are given."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril().expand(B, 1, seq, seq)
    if docs is None:
        return allowed
    ids = [torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff()) for cu in docs]
    same = torch.stack([d[:, None] == d[None, :] for d in ids])[:, None]
    return allowed & same


def _reference(q, k, v, go, allowed, dropout=None):
    """The formula in fp64: (out [s, b, h * dv], dq, dk, dv), scaled by 1/sqrt(dqk)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s, h, dv = q.size(0), q.size(2), v.size(3)
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(h // t.size(1), dim=1) for t in (kt, vt))
    probs = torch.softmax((qt @ kt.transpose(-1, -2) / math.sqrt(q.size(3))).masked_fill(~allowed, float("-inf")), -1)
    if dropout is not None:
        probs = probs * dropout.keep(torch.arange(s), torch.arange(s)) / (1 - dropout.p)
    out = (probs @ vt).permute(2, 0, 1, 3).reshape(s, B, h * dv)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), go.double()))


def _worst(got, want) -> float:
    return max(float((a.detach().double() - b).abs().max()) for a, b in zip(got, want))


def _run_core(q, k, v, go, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = core_attention(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


@pytest.mark.parametrize("dv", V_WIDTHS)
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_core_backends_take_their_own_value_width(dv, backend):
    for groups in (HEADS, 2, 1):
        q, k, v, go = _inputs(S, groups, dv)
        for docs in (None, ([0, 5, 20, S], [0, 17, S])):
            allowed = _allowed(S, docs)
            mask = None if docs is None else ~allowed
            got = _run_core(q, k, v, go, backend=backend, attention_mask=mask)
            assert got[0].shape == (S, B, HEADS * dv) and got[3].shape == v.shape
            assert _worst(got, _reference(q, k, v, go, allowed)) < 1e-5, (groups, docs)


def _fake_flash_attn(calls: list):
    """A stand-in for flash-attn's ``flash_attn_func`` ([b, s, n, d], one head width, as the real one wants)."""
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        assert q.size(-1) == k.size(-1) == v.size(-1), "flash-attn takes one head width"
        calls.append((q, k, v))
        rep = q.size(2) // k.size(2)
        qt, kt, vt = (t.transpose(1, 2).repeat_interleave(rep if t is not q else 1, dim=1) for t in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale).transpose(1, 2)
    return types.SimpleNamespace(flash_attn_func=flash_attn_func)


def test_flash_pads_to_one_width_and_trims_and_leaves_equal_widths_alone(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(calls))
    for dv in V_WIDTHS:
        for groups in (HEADS, 1):
            q, k, v, go = _inputs(S, groups, dv)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = core._flash(q, k, v, 0.0).reshape(S, B, HEADS * dv)
            got = (out, *torch.autograd.grad(out, (q, k, v), go))
            assert _worst(got, _reference(q, k, v, go, _allowed(S))) < 1e-5
            assert calls[-1][0].size(-1) == max(DQK, dv)
    q, k, v, _ = _inputs(S, 2, DQK)
    core._flash(q, k, v, 0.0)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(calls[-1], (q, k, v))), "equal widths: no copies"


@pytest.mark.parametrize("dv", V_WIDTHS)
def test_keyed_dropout_tiles_take_their_own_value_width(dv):
    q, k, v, go = _inputs(S, 2, dv, dtype=torch.float64)
    drop = AttentionDropout(0.25, sample_keys(11, torch.tensor([5, 9])), torch.arange(HEADS), 3)
    got = _run_core(q, k, v, go, dropout=drop)
    assert _worst(got, _reference(q, k, v, go, _allowed(S), drop)) < 1e-12


class _Recorder:
    """A kernel that records what it is handed, wrapped by the one-width adapter."""

    def __init__(self):
        self.seen = []

    def forward(self, q, k, v, causal, scale, dropout_p=0.0):
        self.seen.append((q, k, v))
        return _KERNELS["math"].forward(q, k, v, causal, scale, dropout_p)

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng=None):
        self.seen.append((dout, q, k, v, out))
        return _KERNELS["math"].backward(dout, q, k, v, out, lse, causal, scale, dropout_p, rng)


@pytest.mark.parametrize("name", ["math", "cpu_flash", "one-width"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_take_their_own_value_width(name, causal):
    kernel = _OneWidth(_Recorder()) if name == "one-width" else _KERNELS[name]
    for dv in (*V_WIDTHS, DQK):
        for groups in (HEADS, 2):
            q, k, v, go = _inputs(S, groups, dv)
            qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out, lse, _ = kernel.forward(qt, kt, vt, causal, 1 / math.sqrt(DQK))
            dout = go.reshape(S, B, HEADS, dv).permute(1, 2, 0, 3)
            grads = kernel.backward(dout, qt, kt, vt, out, lse, causal, 1 / math.sqrt(DQK))
            allowed = _allowed(S) if causal else torch.ones(B, 1, S, S, dtype=torch.bool)
            want = _reference(q, k, v, go, allowed)
            got = (out.permute(2, 0, 1, 3).reshape(S, B, -1), *(g.permute(2, 0, 1, 3) for g in grads))
            assert _worst(got, want) < 1e-5, (name, dv, groups)
            if name == "one-width" and dv == DQK:  # the op gets the caller's tensors: nothing padded
                assert all(a is b for a, b in zip(kernel.inner.seen[-1], (dout, qt, kt, vt, out)))
            elif name == "one-width":
                assert {t.size(-1) for t in kernel.inner.seen[-1]} == {max(DQK, dv)}


@pytest.mark.parametrize("name, dtype", [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)])
@pytest.mark.parametrize("dqk, dv", [(192, 128), (64, 128)])
def test_cuda_kernels_keep_the_block_contract_with_their_own_value_width(name, dtype, dqk, dv):
    """On meta tensors (torch's CUDA ops' shape functions): shapes and dtypes of out, lse and gradients."""
    b, h, g, n = 2, 8, 2, 40
    q = torch.empty(b, h, n, dqk, device="meta", dtype=dtype)
    k = torch.empty(b, g, n, dqk, device="meta", dtype=dtype)
    v = torch.empty(b, g, n, dv, device="meta", dtype=dtype)
    kernel = _KERNELS[name]
    out, lse, _ = kernel.forward(q, k, v, True, 0.1)
    assert out.shape == (b, h, n, dv) and out.dtype == dtype and lse.shape == (b, h, n)
    dq, dk, d_v = kernel.backward(torch.empty_like(out), q, k, v, out, lse, True, 0.1)
    assert (dq.shape, dk.shape, d_v.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("dtype, dqk, dv, want", [
    (torch.bfloat16, 192, 128, "cuda_flash"), (torch.bfloat16, 128, 192, "cuda_flash"),
    (torch.bfloat16, 192, 320, "cuda_efficient"), (torch.float32, 192, 128, "cuda_efficient")])
def test_auto_kernel_reads_the_wider_head(dtype, dqk, dv, want):
    q = types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype, shape=(1, 4, 16, dqk))
    assert block_kernel("auto", q, dv) is _KERNELS[want]


def _mla_config(dv: int) -> GPTConfig:
    return GPTConfig(vocab_size=128, num_layers=1, hidden_size=64, num_attention_heads=HEADS,
                     multi_latent_attention=True, qk_head_dim=DQK - 8, qk_pos_emb_head_dim=8, v_head_dim=dv,
                     kv_lora_rank=32)


def _exchange(kind: str, dv: int, groups: int, documents: bool, backend: str):
    """One rank: ``kind`` on the zigzag split of a 64-token sequence; (worst error, bytes sent forward and
    backward) against the one-process formula (causal, or per-sample documents)."""
    cp, rank, seq = dist.get_world_size(), dist.get_rank(), 64
    layout = zigzag_layout(seq, cp)
    hierarchy, counter = None, (RingStats() if kind == "p2p" else CommCounter())
    if kind == "a2a+p2p":
        inner, outer = _groups(cp, 2)
        hierarchy = Hierarchy.build(seq, 2, cp // 2, inner, outer)
    ctx = ContextParallel.from_layout(layout, rank, None, kind, counter, hierarchy=hierarchy)
    allowed = _allowed(seq, DOCS if documents else None)
    if documents:
        ctx = ctx.with_documents(DOCS)
    q, k, v, go = _inputs(seq, groups, dv, seed=groups + dv)
    want = _reference(q, k, v, go, allowed)
    local = [split_for_rank(t, rank, cp, layout=layout).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, ctx, backend=backend, attention_mask=~allowed if documents else None)
    got = (out, *torch.autograd.grad(out, local, split_for_rank(go, rank, cp, layout=layout)))
    return _worst(got, [split_for_rank(t, rank, cp, layout=layout) for t in want]), _sent(counter)


def _exchanges(cases) -> list:
    return [_exchange(*case) for case in cases]


def _expected_sent(kind: str, cp: int, dv: int, groups: int) -> tuple[int, int]:
    """(forward, backward) bytes (fp32) one rank sends: the ring's K and V blocks at their own widths, the
    all-to-all's and all-gather's closed forms."""
    seq, e = 64, 4
    if kind == "p2p":
        block = seq // cp * B * groups * (DQK + dv)
        return block * (cp - 1) * e, block * (cp - 1) * e + block * cp * 4
    if kind == "a2a":
        return tuple(a2a_elements(seq, HEADS, groups, DQK, cp, B, phase, v_head_dim=dv) * e
                     for phase in ("forward", "backward"))
    if kind == "allgather":
        return (allgather_elements(seq, groups, DQK, cp, B, v_head_dim=dv) * e,) * 2
    return tuple(a2a_elements(seq // (cp // 2), HEADS, groups, DQK, 2, B, phase, v_head_dim=dv) * e
                 for phase in ("forward", "backward"))


def _sent(counter) -> tuple[int, int]:
    """(forward, backward) bytes the counter saw sent."""
    if isinstance(counter, RingStats):
        return counter.forward_bytes_sent, counter.backward_bytes_sent
    return counter.bytes_sent["forward"], counter.bytes_sent["backward"]


@pytest.mark.parametrize("cp, kinds", [(2, ("p2p", "a2a", "allgather")), (4, ("p2p", "a2a", "allgather", "a2a+p2p"))])
def test_every_exchange_with_its_own_value_width_equals_one_process(cp, kinds):
    """GQA groups 2 and 1 (KV heads split and replicated by the all-to-all) and 4 (an MLA layer, whose
    bytes the planner gives), causal and packed documents, the block kernels and the math backend."""
    cases = [(kind, dv, groups, documents, backend) for kind in kinds for dv in V_WIDTHS
             for groups, documents, backend in ((2, False, "auto"), (1, True, "auto"), (HEADS, True, "math"))]
    for results in run_distributed(cp, _exchanges, cases):
        for (kind, dv, groups, documents, backend), (worst, sent) in zip(cases, results, strict=True):
            assert worst < 1e-5, (kind, dv, groups, documents, backend, worst)
            assert sent == _expected_sent(kind, cp, dv, groups), (kind, dv, groups, sent)
            if groups == HEADS and kind != "a2a+p2p":  # the planner's bytes for an MLA layer, as sent
                planned = cp_bytes_per_layer(_mla_config(dv), tp=1, cp=cp, seq_length=64, micro_batch_size=B,
                                             precision="fp32", recompute=None, kind=kind)
                assert planned == sum(sent), (kind, dv, planned, sent)


def test_ring_sends_value_blocks_unpadded():
    """The ring's bytes with V narrower than K are fewer than with V as wide: nothing padded is sent."""
    (_, narrow), (_, wide) = run_distributed(2, _exchanges, [("p2p", dv, 2, False, "auto") for dv in (8, DQK)])[0]
    assert narrow[0] * (2 * DQK) == wide[0] * (DQK + 8)


@pytest.mark.parametrize("dv", V_WIDTHS)
def test_ring_keeps_for_backward_its_inputs_output_and_lse_unpadded(dv):
    """What the ring saves: q, k at dqk, v and the output at dv, the fp32 LSE; no padded copy."""
    q, k, v, _ = (t.requires_grad_() for t in _inputs(S, 2, dv))
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ring_attention(q, k, v, zigzag_layout(S, 1))
    assert sum(seen.values()) == 4 * (q.numel() + k.numel() + v.numel() + out.numel() + B * HEADS * S)


def test_mismatched_widths_are_refused():
    q, k = torch.zeros(16, B, HEADS, DQK), torch.zeros(16, B, 2, DQK)
    with pytest.raises(ValueError, match=r"k \[s, b, groups, dqk\] and v \[s, b, groups, dv\]"):
        core_attention(q, torch.zeros(16, B, 2, 8), torch.zeros(16, B, 2, 8))
    with pytest.raises(ValueError, match="the same s, b, groups and q/k width"):
        ring_attention(q, k, torch.zeros(16, B, 1, 8), zigzag_layout(16, 1))
