"""Gated DeltaNet against transformers' Qwen3NextGatedDeltaNet (its PyTorch chunked rule, l2-normalised q and k,
the gated RMSNorm): a tiny random layer with two key heads serving four value heads, over 70 tokens (two chunks),
gives transformers' output within 1e-5; packed documents are exact (changing one document changes nothing in the
next); the attention output gate equals Qwen3-Next's gated attention."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Gated DeltaNet reference is transformers'")

from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next  # noqa: E402

from megazero.model.config import GPTConfig  # noqa: E402
from megazero.model.forward_context import ForwardContext  # noqa: E402
from megazero.model.recurrent.gated_delta_net import GatedDeltaNet  # noqa: E402

H, NK, NV, DK, DV, K, T = 32, 2, 4, 8, 8, 4, 70


def hf_config():
    return transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
        linear_value_head_dim=DV, linear_conv_kernel_dim=K, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
        rms_norm_eps=1e-6)


def ours_config(**kw) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=64, seq_length=T,
                     max_position_embeddings=T, add_bias_linear=False, normalization="rmsnorm",
                     layernorm_epsilon=1e-6, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                     linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
                     linear_value_head_dim=DV, linear_conv_kernel_dim=K, hidden_dropout=0.0, attention_dropout=0.0,
                     **kw)


def from_hf(hf) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused projections (interleaved per key head: q, k, v-group, z-group; b-group, a-group) as
    megazero's [q; k], [v; z], [b; a]."""
    r = NV // NK
    qkvz = hf.in_proj_qkvz.weight.view(NK, 2 * DK + 2 * r * DV, H)
    q, k, v, z = qkvz.split([DK, DK, r * DV, r * DV], dim=1)
    ba = hf.in_proj_ba.weight.view(NK, 2 * r, H)
    b, a = ba.split([r, r], dim=1)
    flat = lambda t: t.reshape(-1, H)  # noqa: E731
    return {"in_proj_qk.weight": torch.cat([flat(q), flat(k)]), "in_proj_vz.weight": torch.cat([flat(v), flat(z)]),
            "in_proj_ba.weight": torch.cat([flat(b), flat(a)]), "out_proj.weight": hf.out_proj.weight,
            "conv1d_weight": hf.conv1d.weight.squeeze(1), "A_log": hf.A_log, "dt_bias": hf.dt_bias,
            "norm_weight": hf.norm.weight}


def pair():
    torch.manual_seed(0)
    hf = hf_qwen3_next.Qwen3NextGatedDeltaNet(hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = GatedDeltaNet(ours_config(), tp_group=None, tp_size=1)
    ours.load_state_dict({n: t.detach().clone() for n, t in from_hf(hf).items()})
    return hf, ours


def test_equals_transformers():
    hf, ours = pair()
    x = torch.randn(2, T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()


def test_packed_documents_do_not_leak():
    _, ours = pair()
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2))
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, [0, 30]] = True  # the second document starts inside the first chunk
    context = ForwardContext(starts=starts)
    y = ours(x.transpose(0, 1), context)
    x2 = x.clone()
    x2[:, 5:30] += torch.randn(1, 25, H)
    y2 = ours(x2.transpose(0, 1), context)
    assert torch.equal(y[30:], y2[30:])
    assert not torch.equal(y[:30], y2[:30])


def test_attention_output_gate_equals_qwen3_next():
    """Per query group (queries, their gates, key, value) rows; output times sigmoid(gate) before o_proj."""
    from megazero.model.attention.self_attention import SelfAttention

    torch.manual_seed(0)
    cfg = hf_config()
    hf = hf_qwen3_next.Qwen3NextAttention(cfg, layer_idx=1).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    c = ours_config(qk_layernorm=True, apply_layernorm_1p=True, attention_output_gate=True, kv_channels=8,
                    num_query_groups=2, position_embedding_type="none")
    ours = SelfAttention(c, tp_group=None, tp_size=1)
    d, hpg = 8, 2
    qg = hf.q_proj.weight.view(4, 2, d, H)  # per head: [query; gate]
    q, g = qg[:, 0].reshape(2, hpg * d, H), qg[:, 1].reshape(2, hpg * d, H)
    k, v = hf.k_proj.weight.view(2, d, H), hf.v_proj.weight.view(2, d, H)
    rows = torch.cat([q, g, k, v], dim=1).reshape(-1, H)
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(rows)
        ours.linear_proj.weight.copy_(hf.o_proj.weight)
        ours.q_layernorm.weight.copy_(hf.q_norm.weight)
        ours.k_layernorm.weight.copy_(hf.k_norm.weight)
    x = torch.randn(2, 12, H)
    cos, sin = torch.ones(2, 12, d), torch.zeros(2, 12, d)  # no rotation: compare the gate and the norms
    mask = torch.full((12, 12), float("-inf")).triu(1)
    with torch.no_grad():
        want, _ = hf(x, position_embeddings=(cos, sin), attention_mask=mask[None, None])
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert (got - want).abs().max() < 1e-5
