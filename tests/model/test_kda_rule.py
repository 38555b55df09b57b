"""Kimi Delta Attention's rule (one decay per key channel): chunked against the token loop, against transformers' Kimi
Linear references (chunked and recurrent) and against the gated delta rule when the decay is the same on every
channel; packed documents isolated exactly, gradients, and the state-passing algebra that chains segments."""

import pytest
import torch
import torch.nn.functional as F

from megazero.model.recurrent.delta_rule import chunk_gated_delta_rule
from megazero.model.recurrent.kda_rule import chunk_kda_rule, kda_transition, recurrent_kda_rule

hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _inputs(B, T, H, dk, dv, seed=0, dtype=torch.float32, decay_shift=0.0):
    """Unit-scale q, k (normalised), v; g = logsigmoid(N(shift, 1)) <= 0 per channel; beta in (0, 1); a random
    initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = F.normalize(r(B, T, H, dk), dim=-1), F.normalize(r(B, T, H, dk), dim=-1)
    v, g, beta = r(B, T, H, dv), F.logsigmoid(r(B, T, H, dk) + decay_shift), torch.sigmoid(r(B, T, H))
    s0 = r(B, H, dk, dv) * 0.5
    return [x.to(dtype) for x in (q, k, v, g, beta, s0)]


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


SHAPES = [  # B, T, H, dk, dv, chunk
    (2, 70, 3, 16, 24, 16), (1, 200, 2, 32, 32, 64), (1, 1, 3, 8, 12, 64), (2, 64, 1, 16, 8, 16), (1, 37, 2, 8, 8, 64),
    (1, 50, 2, 8, 8, 8), (1, 45, 1, 8, 4, 12)]  # 12: not a multiple of the 4-way sub-chunk split at every level


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decay_shift", [2.0, -1.0])  # mild and strong decay
def test_chunked_matches_recurrent_fp32(shape, decay_shift):
    *dims, C = shape
    q, k, v, g, beta, s0 = _inputs(*dims, decay_shift=decay_shift)
    for init in (None, s0):
        o, s = chunk_kda_rule(q, k, v, g, beta, initial_state=init, chunk_size=C)
        o_ref, s_ref = recurrent_kda_rule(q, k, v, g, beta, initial_state=init)
        assert o.dtype == torch.float32 and s.dtype == torch.float32 and o.shape == v.shape
        assert _max_diff(o, o_ref) <= 3e-7 and _max_diff(s, s_ref) <= 3e-7


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_matches_recurrent_fp64(shape):
    *dims, C = shape
    q, k, v, g, beta, s0 = _inputs(*dims, dtype=torch.float64, decay_shift=-1.0)
    starts = torch.zeros(dims[0], dims[1], dtype=torch.bool)
    starts[:, dims[1] // 3] = True
    for kw in (dict(initial_state=s0), dict(initial_state=s0, starts=starts)):
        o, s = chunk_kda_rule(q, k, v, g, beta, chunk_size=C, **kw)
        o_ref, s_ref = recurrent_kda_rule(q, k, v, g, beta, **kw)
        assert o.dtype == s.dtype == torch.float64
        assert _max_diff(o, o_ref) <= 1e-12 and _max_diff(s, s_ref) <= 1e-12


def test_extreme_decays_stay_finite_and_exact():
    """Per-channel log decays down to -200 a token (a chunk's sums far beyond fp32's exp range) next to channels that
    barely decay: no overflow in the factored decays, and the result still matches the fp64 token loop."""
    q, k, v, g, beta, s0 = _inputs(1, 200, 2, 32, 16, seed=12, dtype=torch.float64)
    g = -torch.rand(g.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64) ** 4 * 200
    g[..., :4] = -1e-4
    o_ref, s_ref = recurrent_kda_rule(q, k, v, g, beta, initial_state=s0)
    leaves = [x.float().requires_grad_() for x in (q, k, v, g, beta, s0)]
    o, s = chunk_kda_rule(*leaves[:5], initial_state=leaves[5])
    assert _max_diff(o, o_ref) <= 3e-7 and _max_diff(s, s_ref) <= 1e-6 * s_ref.abs().max().item()
    grads = torch.autograd.grad(o.sum() + s.sum(), leaves)
    assert all(torch.isfinite(x).all() for x in grads)


@pytest.mark.parametrize("B,T,H,dk,dv", [(1, 1, 2, 16, 16), (2, 70, 3, 16, 24), (1, 200, 2, 32, 16)])
def test_matches_transformers(B, T, H, dk, dv):
    q, k, v, g, beta, s0 = _inputs(B, T, H, dk, dv, seed=1, decay_shift=1.0)
    o, s = chunk_kda_rule(q, k, v, g, beta, initial_state=s0)
    o_r, s_r = recurrent_kda_rule(q, k, v, g, beta, initial_state=s0)
    for reference in (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention):
        o_hf, s_hf = reference(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                               use_qk_l2norm_in_kernel=False)
        for mine in ((o, s), (o_r, s_r)):
            assert _max_diff(mine[0], o_hf) <= 1e-6 and _max_diff(mine[1], s_hf) <= 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-7), (torch.float64, 1e-12)])
def test_one_decay_on_every_channel_is_the_gated_delta_rule(dtype, tol):
    q, k, v, g, beta, s0 = _inputs(2, 100, 2, 16, 8, seed=14, dtype=dtype, decay_shift=-0.5)
    starts = torch.zeros(2, 100, dtype=torch.bool)
    starts[1, 41] = True
    g_head = g[..., 0]
    o, s = chunk_kda_rule(q, k, v, g_head.unsqueeze(-1).expand_as(g), beta, initial_state=s0, starts=starts)
    o_gdn, s_gdn = chunk_gated_delta_rule(q, k, v, g_head, beta, initial_state=s0, starts=starts)
    assert _max_diff(o, o_gdn) <= tol and _max_diff(s, s_gdn) <= tol


def test_scale_and_dtypes():
    q, k, v, g, beta, s0 = _inputs(1, 20, 2, 8, 8, seed=2)
    o, _ = chunk_kda_rule(q, k, v, g, beta, scale=0.3, chunk_size=8)
    o_ref, _ = recurrent_kda_rule(q * (0.3 / 8 ** -0.5), k, v, g, beta)
    assert _max_diff(o, o_ref) <= 3e-7
    o16, s16 = chunk_kda_rule(*(x.bfloat16() for x in (q, k, v, g, beta)), chunk_size=8)
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.float32


def _packed(seed=3):
    """B = 2, T = 100, chunk 16: row 0 starts documents at 37 (inside chunk 2, inside a 4-token leaf) and 80; row 1
    at 48 (a chunk boundary) and 49."""
    q, k, v, g, beta, s0 = _inputs(2, 100, 2, 16, 8, seed=seed, decay_shift=-0.5)
    starts = torch.zeros(2, 100, dtype=torch.bool)
    starts[0, [37, 80]] = True
    starts[1, [48, 49]] = True
    return (q, k, v, g, beta, s0), starts


@pytest.mark.parametrize("rule", ["chunk", "recurrent"])
def test_documents_are_isolated_exactly(rule):
    (q, k, v, g, beta, s0), starts = _packed()
    run = chunk_kda_rule if rule == "chunk" else recurrent_kda_rule
    kw = dict(chunk_size=16) if rule == "chunk" else {}
    o, s = run(q, k, v, g, beta, initial_state=s0, starts=starts, **kw)
    # change everything before each row's first start (and the state entering the sequence)
    first = [37, 48]
    changed = [x.clone() for x in (q, k, v, g, beta)]
    for b, t in enumerate(first):
        for x in changed:
            x[b, :t] = torch.randn_like(x[b, :t]).abs().neg() * 5 if x is changed[3] else torch.randn_like(x[b, :t])
    o2, s2 = run(*changed, initial_state=torch.randn_like(s0), starts=starts, **kw)
    for b, t in enumerate(first):
        assert not torch.equal(o2[b, :t], o[b, :t])
        assert torch.equal(o2[b, t:], o[b, t:])
    assert torch.equal(s2, s)


def test_documents_match_separate_runs():
    (q, k, v, g, beta, s0), starts = _packed(seed=4)
    o, s = chunk_kda_rule(q, k, v, g, beta, initial_state=s0, starts=starts, chunk_size=16)
    o_r, s_r = recurrent_kda_rule(q, k, v, g, beta, initial_state=s0, starts=starts)
    assert _max_diff(o, o_r) <= 3e-7 and _max_diff(s, s_r) <= 3e-7
    for b, bounds in enumerate([(0, 37, 80, 100), (0, 48, 49, 100)]):
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            part = [x[b:b + 1, lo:hi] for x in (q, k, v, g, beta)]
            o_doc, s_doc = chunk_kda_rule(*part, initial_state=s0[b:b + 1] if i == 0 else None, chunk_size=16)
            assert _max_diff(o[b:b + 1, lo:hi], o_doc) <= 1e-6
        assert _max_diff(s[b:b + 1], s_doc) <= 1e-6


def test_start_at_zero_drops_initial_state():
    q, k, v, g, beta, s0 = _inputs(2, 40, 2, 8, 8, seed=5)
    starts = torch.zeros(2, 40, dtype=torch.bool)
    starts[:, 0] = True
    with_init = chunk_kda_rule(q, k, v, g, beta, initial_state=s0, starts=starts, chunk_size=16)
    without = chunk_kda_rule(q, k, v, g, beta, starts=starts, chunk_size=16)
    assert torch.equal(with_init[0], without[0]) and torch.equal(with_init[1], without[1])


def test_gradients_match_recurrent():
    (q, k, v, g, beta, s0), starts = _packed(seed=6)
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, s0)]
    weight = torch.randn(100, 2, 8, generator=torch.Generator().manual_seed(7))
    grads = []
    for run, kw in ((chunk_kda_rule, dict(chunk_size=16)), (recurrent_kda_rule, {})):
        o, s = run(*inputs[:5], initial_state=inputs[5], starts=starts, **kw)
        grads.append(torch.autograd.grad((o * weight).sum() + s.square().sum(), inputs))
    for name, mine, ref in zip("q k v g beta s0".split(), *grads):
        assert _max_diff(mine, ref) <= 1e-5 * ref.abs().max().item(), name


def test_gradcheck_fp64():
    q, k, v, g, beta, s0 = _inputs(1, 9, 1, 3, 2, seed=8, dtype=torch.float64)
    starts = torch.zeros(1, 9, dtype=torch.bool)
    starts[0, 6] = True
    for st in (None, starts):  # chunk 8: a 4 x 2-token split and its leaves; the document starts inside a leaf
        fn = lambda *x, st=st: chunk_kda_rule(*x[:5], initial_state=x[5], starts=st, chunk_size=8)
        assert torch.autograd.gradcheck(fn, [x.requires_grad_() for x in (q, k, v, g, beta, s0)])


@pytest.mark.parametrize("split,exact", [(48, True), (40, False)])  # on a chunk boundary, and inside a chunk
def test_segments_chain_through_the_state(split, exact):
    q, k, v, g, beta, s0 = _inputs(2, 100, 2, 16, 8, seed=9, decay_shift=1.0)
    o, s = chunk_kda_rule(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    first = [x[:, :split] for x in (q, k, v, g, beta)]
    second = [x[:, split:] for x in (q, k, v, g, beta)]
    o1, s1 = chunk_kda_rule(*first, initial_state=s0, chunk_size=16)
    o2, s2 = chunk_kda_rule(*second, initial_state=s1, chunk_size=16)
    if exact:
        assert torch.equal(torch.cat([o1, o2], 1), o) and torch.equal(s2, s)
    else:
        assert _max_diff(torch.cat([o1, o2], 1), o) <= 1e-6 and _max_diff(s2, s) <= 1e-6


@pytest.mark.parametrize("starts_at", [None, 20, 70, 85])  # none; in the first segment; at the split; in the second
def test_transition_combines_segments(starts_at):
    q, k, v, g, beta, s0 = _inputs(2, 100, 2, 16, 8, seed=10, decay_shift=4.0)  # mild decay: M is far from 0
    starts = None
    if starts_at is not None:  # row 1 only, so row 0 keeps a non-zero transition
        starts = torch.zeros(2, 100, dtype=torch.bool)
        starts[1, starts_at] = True
    split = 70  # inside a chunk
    _, s = chunk_kda_rule(q, k, v, g, beta, initial_state=s0, starts=starts, chunk_size=16)
    seg = lambda x, lo, hi: None if x is None else x[:, lo:hi]
    parts = [[x[:, lo:hi] for x in (q, k, v, g, beta)] + [seg(starts, lo, hi)] for lo, hi in ((0, split), (split, 100))]
    _, s_first = chunk_kda_rule(*parts[0][:5], initial_state=s0, starts=parts[0][5], chunk_size=16)
    _, s_second = chunk_kda_rule(*parts[1][:5], starts=parts[1][5], chunk_size=16)
    m = kda_transition(*parts[1][1:2], *parts[1][3:5], starts=parts[1][5], chunk_size=16)
    assert m.shape == (2, 2, 16, 16) and m.dtype == torch.float32
    assert _max_diff(m @ s_first + s_second, s) <= 1e-6
    assert m[0].abs().max() > 0.1
    if starts_at is not None and starts_at >= split:
        assert torch.equal(m[1], torch.zeros_like(m[1]))


def test_transition_is_the_state_map():
    """final(S0) - final(0) == M S0 for a random S0, against the token loop; M of an empty product is I, and of one
    step with beta = 0 the diagonal exp(g) (the decay is per channel: M is not a multiple of I)."""
    q, k, v, g, beta, s0 = _inputs(2, 70, 3, 16, 8, seed=11, dtype=torch.float64)
    m = kda_transition(k, g, beta, chunk_size=16)
    _, s_with = recurrent_kda_rule(q, k, v, g, beta, initial_state=s0)
    _, s_without = recurrent_kda_rule(q, k, v, g, beta)
    assert _max_diff(m @ s0, s_with - s_without) <= 1e-12
    m1 = kda_transition(k[:, :1], torch.zeros_like(g[:, :1]), torch.zeros_like(beta[:, :1]))
    assert torch.equal(m1, torch.eye(16, dtype=torch.float64).expand_as(m1))
    m2 = kda_transition(k[:, :1], g[:, :1], torch.zeros_like(beta[:, :1]))
    assert _max_diff(m2, torch.diag_embed(g[:, 0].exp())) <= 1e-15


def test_wrong_shapes_say_what_to_fix():
    q, k, v, g, beta, s0 = _inputs(1, 10, 2, 8, 8)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H, dk\]"):
        chunk_kda_rule(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="v must be"):
        chunk_kda_rule(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="starts must be a bool"):
        chunk_kda_rule(q, k, v, g, beta, starts=torch.zeros(1, 10))
    with pytest.raises(ValueError, match="initial_state must be"):
        recurrent_kda_rule(q, k, v, g, beta, initial_state=s0[..., :3])
