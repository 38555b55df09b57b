"""The fused kernels' adapters (``recurrent/kernels.py``): what megazero hands flash-linear-attention's gated delta
rule and mamba-ssm's SSD scan, checked on the CPU against stand-ins that take the packages' argument conventions
(``output_final_state``; ``seq_idx`` and ``initial_states`` with ``return_final_states``) and compute with
megazero's PyTorch forms. Without the packages (or off CUDA) the adapters are the PyTorch forms."""

from __future__ import annotations

import torch

from megazero.model.recurrent import kernels
from megazero.model.recurrent.delta_rule import chunk_gated_delta_rule
from megazero.model.recurrent.ssd import chunk_ssd_scan

G = torch.Generator().manual_seed(0)


def _rand(*shape):
    return torch.randn(*shape, generator=G)


def test_without_the_packages_the_adapters_are_megazero_s_forms():
    q, k, v = _rand(1, 20, 2, 4), _rand(1, 20, 2, 4), _rand(1, 20, 2, 3)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    g, beta = -torch.rand(1, 20, 2, generator=G), torch.rand(1, 20, 2, generator=G)
    assert all(torch.equal(a, b) for a, b in zip(kernels.gated_delta_rule(q, k, v, g, beta),
                                                 chunk_gated_delta_rule(q, k, v, g, beta)))


def test_mamba_ssm_gets_documents_as_seq_idx(monkeypatch):
    """mamba-ssm's seq_idx numbers the documents from 0 in each sample; its initial state enters document 0, so a
    sample whose first token starts a document gets none (megazero's contract)."""
    seen = {}

    def mamba_like(x, dt, A, B, C, chunk_size, D=None, initial_states=None, seq_idx=None, return_final_states=False):
        seen["seq_idx"], seen["initial"] = seq_idx, initial_states
        starts = torch.zeros_like(seq_idx, dtype=torch.bool)
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        return chunk_ssd_scan(x, dt, A, B, C, D=D, initial_state=initial_states, starts=starts, chunk_size=chunk_size)

    monkeypatch.setattr(kernels, "_fused_device", lambda t: True)
    monkeypatch.setattr(kernels, "mamba_chunk_scan", lambda: mamba_like)
    b, t, h, p, g, n = 2, 30, 4, 3, 2, 5
    x, dt, B, C = _rand(b, t, h, p), torch.rand(b, t, h, generator=G), _rand(b, t, g, n), _rand(b, t, g, n)
    A, D, s0 = -torch.rand(h, generator=G) - 0.1, _rand(h), _rand(b, h, p, n)
    starts = torch.zeros(b, t, dtype=torch.bool)
    starts[0, [0, 11]] = True  # sample 0 begins with a document; sample 1 continues the state
    starts[1, 17] = True
    got = kernels.ssd_scan(x, dt, A, B, C, D=D, initial_state=s0, starts=starts, chunk_size=8)
    want = chunk_ssd_scan(x, dt, A, B, C, D=D, initial_state=s0, starts=starts, chunk_size=8)
    assert seen["seq_idx"].dtype == torch.int32 and seen["seq_idx"][0].tolist() == [0] * 11 + [1] * 19
    assert seen["seq_idx"][1].tolist() == [0] * 17 + [1] * 13
    assert torch.equal(seen["initial"][0], torch.zeros_like(s0[0])) and torch.equal(seen["initial"][1], s0[1])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


def test_flash_linear_attention_is_left_to_runs_without_documents(monkeypatch):
    calls = []

    def fla_like(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        calls.append(scale)
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    monkeypatch.setattr(kernels, "_fused_device", lambda t: True)
    monkeypatch.setattr(kernels, "fla_gated_delta_rule", lambda: fla_like)
    q, k, v = _rand(1, 20, 2, 4), _rand(1, 20, 2, 4), _rand(1, 20, 2, 3)
    g, beta = -torch.rand(1, 20, 2, generator=G), torch.rand(1, 20, 2, generator=G)
    kernels.gated_delta_rule(q, k, v, g, beta)
    assert calls == [0.5]  # dk ** -0.5, given explicitly
    starts = torch.zeros(1, 20, dtype=torch.bool)
    starts[0, 7] = True
    kernels.gated_delta_rule(q, k, v, g, beta, starts=starts)
    assert len(calls) == 1  # documents: megazero's form, no host read of their lengths
