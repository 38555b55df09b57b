"""The chunked Mamba-2 SSD scan against its step-by-step reference and against transformers' Nemotron-H (its
chunk scan, its decoding step and its whole mixer); packed documents isolated bit for bit; state passing between
pieces of a sequence; gradients (against the reference and by gradcheck)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.model.recurrent.gated_norm import gated_rms_norm
from megazero.model.recurrent.ssd import chunk_ssd_scan, recurrent_ssd_scan, ssd_delta, ssd_transition

transformers = pytest.importorskip("transformers", reason="the scan is checked against transformers' Nemotron-H")
from transformers.models.nemotron_h import modeling_nemotron_h as hf  # noqa: E402
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig  # noqa: E402


def _inputs(b=2, T=150, H=4, P=8, G=2, N=16, dtype=torch.float32, seed=0, dt_max=0.125,
            A_max=8.0) -> dict[str, torch.Tensor]:
    """Unit-scale inputs, outputs of magnitude ~1 (an fp32 ulp: 6e-8 to 1.2e-7); Δ and A in Nemotron-H's ranges
    (Δ|A| up to ~1)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=0.5 * torch.randn(b, T, H, P, generator=g, dtype=dtype),
        dt=0.005 + (dt_max - 0.005) * torch.rand(b, T, H, generator=g, dtype=dtype),
        A=-torch.linspace(0.5, A_max, H, dtype=dtype),
        B=torch.randn(b, T, G, N, generator=g, dtype=dtype) / math.sqrt(N),
        C=torch.randn(b, T, G, N, generator=g, dtype=dtype) / math.sqrt(N),
        D=0.5 * torch.rand(H, generator=g, dtype=dtype),
        initial_state=0.25 * torch.randn(b, H, P, N, generator=g, dtype=dtype),
    )


def _starts(b: int, T: int, *positions: int) -> torch.Tensor:
    starts = torch.zeros(b, T, dtype=torch.bool)
    starts[:, list(positions)] = True
    return starts


def _scan(inputs: dict, **kw):
    return chunk_ssd_scan(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], D=inputs["D"],
                          initial_state=inputs["initial_state"], **kw)


# ---------------------------------------------------------------- chunked vs step by step

@pytest.mark.parametrize("T,chunk_size,G", [(150, 32, 2), (150, 32, 1), (96, 32, 4), (7, 128, 2), (200, 64, 2)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-7), (torch.float64, 1e-12)])
def test_chunked_matches_recurrent(T, chunk_size, G, packed, dtype, tol):
    inp = _inputs(T=T, G=G, dtype=dtype)
    # Starts inside a chunk, on a chunk boundary, and at t=0 of the second sequence (drops its initial state).
    starts = None
    if packed:
        starts = _starts(2, T, *[t for t in (3, 40, 64, 65) if t < T])
        starts[1, 0] = True
    y, state = _scan(inp, starts=starts, chunk_size=chunk_size)
    y_ref, state_ref = recurrent_ssd_scan(**inp, starts=starts)
    assert y.dtype == dtype and state.dtype == dtype
    assert y_ref.abs().max() < 1.5  # unit scale: 3e-7 is 3 to 5 fp32 ulps here
    assert (y - y_ref).abs().max() <= tol
    assert (state - state_ref).abs().max() <= tol


def test_chunked_fp32_is_as_accurate_as_recurrent_fp32():
    """Against the float64 truth, with strong decays (Δ|A| up to 8, a chunk's decays summing to ~500): a decay
    matrix built from differences of prefix sums (exp(cs_l - cs_s)) would lose ~5e-5 here."""
    inp = _inputs(T=256, dt_max=0.5, A_max=16.0, dtype=torch.float64)
    y_true, state_true = recurrent_ssd_scan(**inp)
    inp32 = {k: v.float() for k, v in inp.items()}
    y, state = _scan(inp32, chunk_size=128)
    y_rec, state_rec = recurrent_ssd_scan(**inp32)
    assert y_true.abs().max() < 2
    # Measured: chunked 2.1e-7 / 2.2e-8, recurrent 1.1e-7 / 2.8e-8, prefix-sum differences 1.4e-6 / 4.1e-7.
    assert (y.double() - y_true).abs().max() <= 4e-7 and (y_rec.double() - y_true).abs().max() <= 4e-7
    assert (state.double() - state_true).abs().max() <= 1e-7 and (state_rec.double() - state_true).abs().max() <= 1e-7


def test_bf16_in_bf16_out_fp32_state():
    inp = {k: (v.bfloat16() if k in ("x", "B", "C") else v) for k, v in _inputs(T=40).items()}
    y, state = _scan(inp, chunk_size=16)
    y_ref, state_ref = recurrent_ssd_scan(**inp)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.equal(y, y_ref) or (y.float() - y_ref.float()).abs().max() <= 2 ** -7 * y_ref.abs().max()
    assert (state - state_ref).abs().max() <= 1e-6


# ---------------------------------------------------------------- transformers' Nemotron-H

@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.02, 0.3)])
def test_matches_transformers_chunk_scan(dt_limit):
    inp = _inputs(T=70)
    g = torch.Generator().manual_seed(3)
    dt_raw, dt_bias = torch.randn(2, 70, 4, generator=g) - 2, torch.randn(4, generator=g)
    y_hf, state_hf = hf.mamba2_chunk_scan(inp["x"], dt_raw, inp["A"], inp["B"], inp["C"], chunk_size=16, D=inp["D"],
                                          dt_bias=dt_bias, initial_states=inp["initial_state"], dt_softplus=True,
                                          dt_limit=dt_limit, return_final_states=True)
    delta = ssd_delta(dt_raw, dt_bias, dt_limit=dt_limit)
    y, state = _scan({**inp, "dt": delta}, chunk_size=16)
    assert (y - y_hf).abs().max() <= 1e-6
    assert (state - state_hf).abs().max() <= 1e-6


def test_decoding_step_matches_transformers():
    inp = _inputs(T=1)
    g = torch.Generator().manual_seed(4)
    dt_raw, dt_bias = torch.randn(2, 1, 4, generator=g), torch.randn(4, generator=g)
    P, N = 8, 16
    state_hf = inp["initial_state"].clone()
    y_hf = hf.mamba2_selective_state_update(
        state_hf, inp["x"][:, 0], dt_raw[:, 0, :, None].expand(-1, -1, P), inp["A"][:, None, None].expand(-1, P, N),
        inp["B"][:, 0], inp["C"][:, 0], inp["D"][:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P),
        dt_softplus=True)
    y, state = recurrent_ssd_scan(**{**inp, "dt": ssd_delta(dt_raw, dt_bias)})
    assert (y[:, 0] - y_hf).abs().max() <= 1e-6
    assert (state - state_hf).abs().max() <= 1e-6


def test_matches_transformers_mixer_end_to_end():
    """NemotronHMamba2Mixer's torch path, rebuilt from its projections, its conv, ssd_delta, chunk_ssd_scan and
    gated_rms_norm (norm after gate, grouped, Nemotron-H's eps)."""
    torch.manual_seed(0)
    cfg = NemotronHConfig(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                          chunk_size=16, layer_types=["mamba"], num_hidden_layers=None)
    mixer = hf.NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in (mixer.A_log, mixer.D, mixer.dt_bias, mixer.norm.weight):
            p.add_(0.3 * torch.randn_like(p))
    b, T, H, P, G, N, I = 2, 37, 4, 8, 2, 16, 32
    hidden = torch.randn(b, T, 32)
    with torch.no_grad():
        ref = mixer(hidden)
        gate, xbc, dt = mixer.in_proj(hidden).split([I, I + 2 * G * N, H], dim=-1)
        xbc = F.conv1d(xbc.transpose(1, 2), mixer.conv1d.weight, mixer.conv1d.bias, padding=cfg.conv_kernel - 1,
                       groups=xbc.shape[-1])[..., :T]
        x, B, C = F.silu(xbc).transpose(1, 2).split([I, G * N, G * N], dim=-1)
        y, _ = chunk_ssd_scan(x.view(b, T, H, P), ssd_delta(dt, mixer.dt_bias, dt_limit=cfg.time_step_limit),
                              -torch.exp(mixer.A_log), B.view(b, T, G, N), C.view(b, T, G, N), D=mixer.D,
                              chunk_size=cfg.chunk_size)
        y = gated_rms_norm(y.reshape(b, T, I), gate, mixer.norm.weight, eps=cfg.layer_norm_epsilon,
                           group_size=I // G, norm_before_gate=False)
        out = mixer.out_proj(y)
    assert (out - ref).abs().max() <= 1e-6


# ---------------------------------------------------------------- packed documents

@pytest.mark.parametrize("start", [40, 64])  # inside the second chunk of 32; on the boundary of chunks 2 and 3
def test_documents_are_isolated_bit_for_bit(start):
    T = 150
    inp = _inputs(T=T, dtype=torch.float32)
    starts = _starts(2, T, start)
    y, state = _scan(inp, starts=starts, chunk_size=32)
    other = _inputs(T=T, seed=9)  # a different first document and initial state
    changed = {k: v.clone() for k, v in inp.items()}
    changed["initial_state"] = other["initial_state"]
    for k in ("x", "dt", "B", "C"):
        changed[k][:, :start] = other[k][:, :start]
    y2, state2 = _scan(changed, starts=starts, chunk_size=32)
    assert not torch.equal(y[:, :start], y2[:, :start])
    assert torch.equal(y[:, start:], y2[:, start:])
    assert torch.equal(state, state2)
    # And the second document alone, from a zero state, is the same up to rounding (chunks fall elsewhere).
    y_alone, state_alone = _scan({**_split(inp, start)[1], "initial_state": None}, chunk_size=32)
    assert (y[:, start:] - y_alone).abs().max() <= 1e-6
    assert (state - state_alone).abs().max() <= 1e-6


def test_no_gradient_crosses_a_document_start():
    inp = {k: v.clone().requires_grad_() for k, v in _inputs(T=100).items()}
    y, _ = _scan(inp, starts=_starts(2, 100, 30, 64), chunk_size=32)
    grads = torch.autograd.grad(y[:, 64:].square().sum(), [inp["x"], inp["dt"], inp["B"], inp["C"],
                                                            inp["initial_state"]])
    for g in grads[:4]:
        assert torch.count_nonzero(g[:, :64]) == 0 and torch.count_nonzero(g[:, 64:]) > 0
    assert torch.count_nonzero(grads[4]) == 0


def test_start_at_zero_drops_the_initial_state():
    inp = _inputs(T=50)
    y, state = _scan(inp, starts=_starts(2, 50, 0), chunk_size=16)
    y0, state0 = _scan({**inp, "initial_state": None}, chunk_size=16)
    assert torch.equal(y, y0) and torch.equal(state, state0)


# ---------------------------------------------------------------- state passing and the transition

def _split(inp: dict, at: int) -> tuple[dict, dict]:
    first = {k: (v[:, :at] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    second = {k: (v[:, at:] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    return first, second


@pytest.mark.parametrize("at,bitwise", [(64, True), (50, False)])
def test_state_passing_reproduces_the_whole(at, bitwise):
    inp = _inputs(T=128)
    y, state = _scan(inp, chunk_size=32)
    first, second = _split(inp, at)
    y1, s1 = _scan(first, chunk_size=32)
    y2, s2 = _scan({**second, "initial_state": s1}, chunk_size=32)
    joined = torch.cat([y1, y2], dim=1)
    if bitwise:
        assert torch.equal(joined, y) and torch.equal(s2, state)
    else:
        assert (joined - y).abs().max() <= 1e-6 and (s2 - state).abs().max() <= 1e-6


@pytest.mark.parametrize("second_has_start", [False, True])
def test_transition_combines_pieces(second_has_start):
    inp = _inputs(T=128)
    starts = _starts(2, 128, 90) if second_has_start else None
    _, state = _scan(inp, starts=starts, chunk_size=32)
    first, second = _split(inp, 50)
    s_first = _scan(first, chunk_size=32)[1]
    part_starts = None if starts is None else starts[:, 50:]
    s_ext = _scan({**second, "initial_state": None}, starts=part_starts, chunk_size=32)[1]
    M = ssd_transition(second["dt"], second["A"], starts=part_starts)
    assert M.shape == (2, 4) and M.dtype == torch.float32
    assert torch.all(M == 0) if second_has_start else torch.all((M > 0) & (M < 1))
    assert (M[..., None, None] * s_first + s_ext - state).abs().max() <= 1e-6
    # The linearity the transition encodes: final_state(S0) - final_state(0) == M * S0.
    s0 = _scan(second, starts=part_starts, chunk_size=32)[1]
    assert (s0 - s_ext - M[..., None, None] * second["initial_state"]).abs().max() <= 1e-6


# ---------------------------------------------------------------- gradients

def test_gradients_match_recurrent():
    inp = _inputs(T=100)
    starts = _starts(2, 100, 45)
    cot = torch.randn(2, 100, 4, 8, generator=torch.Generator().manual_seed(1))
    cot_s = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn, kw in ((chunk_ssd_scan, dict(chunk_size=32)), (recurrent_ssd_scan, {})):
        leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
        y, s = fn(**leaves, starts=starts, **kw)
        grads.append(torch.autograd.grad((y * cot).sum() + (s * cot_s).sum(), list(leaves.values())))
    for name, g, r in zip(inp, *grads):
        assert (g - r).abs().max() <= 1e-5 * r.abs().max(), name


def test_gradcheck_float64():
    inp = {k: v.requires_grad_() for k, v in _inputs(b=1, T=9, H=2, P=2, G=1, N=3, dtype=torch.float64).items()}
    starts = _starts(1, 9, 5)

    def fn(x, dt, A, B, C, D, initial_state):
        return chunk_ssd_scan(x, dt, A, B, C, D=D, initial_state=initial_state, starts=starts, chunk_size=4)

    assert torch.autograd.gradcheck(fn, tuple(inp.values()))
    assert torch.autograd.gradcheck(lambda *a: fn(*a[:6], None), tuple(inp.values())[:6])


# ---------------------------------------------------------------- misuse

def test_bad_shapes_are_refused():
    inp = _inputs(T=10, H=4, G=2)
    with pytest.raises(ValueError, match="dt has shape"):
        _scan({**inp, "dt": inp["dt"][:, :5]})
    with pytest.raises(ValueError, match="H % G"):
        _scan({**inp, "B": torch.randn(2, 10, 3, 16), "C": torch.randn(2, 10, 3, 16)})
    with pytest.raises(ValueError, match="bool"):
        _scan(inp, starts=torch.zeros(2, 10))
