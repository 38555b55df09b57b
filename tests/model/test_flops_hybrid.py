"""Parameter counts and FLOPs of hybrid stacks (Gated DeltaNet, Mamba-2, attention, MoE; one-part layers): the closed
forms against built meta models (whole and TP-sharded), and the scans' FLOPs against torch's FLOP counter."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megazero import mpu
from megazero.model import GPTConfig, GPTModel
from megazero.model.flops import (attention_square_flops_per_token, expert_parameters, flops_per_iteration,
                                  layer_flops_per_token, num_parameters, replicated_parameters)
from megazero.model.recurrent.counts import GDN_CHUNK, recurrent_flops_per_token, recurrent_parameters
from tests.distributed import run_distributed

HAS_MAMBA = importlib.util.find_spec("megazero.model.recurrent.mamba") is not None
needs_mamba = pytest.mark.skipif(not HAS_MAMBA, reason="Mamba-2's mixer (recurrent/mamba.py) is not here")


def qwen3_next(**kw) -> GPTConfig:
    """Qwen3-Next's shape in small: 3 Gated DeltaNet layers to 1 gated attention layer, every MLP a mixture with a
    gated shared expert, GQA with query/key norms, untied, one multi-token prediction depth."""
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                vocab_size=96, seq_length=32, max_position_embeddings=32, position_embedding_type="rope",
                normalization="rmsnorm", activation="swiglu", add_bias_linear=False, tie_embeddings=False,
                qk_layernorm=True, attention_output_gate=True, experimental_attention_variant="gated_delta_net",
                linear_attention_freq=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, mtp_num_layers=1)
    return GPTConfig(**{**base, **kw})


def nemotron_h(pattern: str, **kw) -> GPTConfig:
    """Nemotron-H's stack in small: one block per symbol (M Mamba-2, * attention, - MLP, E mixture of experts)."""
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32) if "E" in pattern else {}
    base = dict(num_layers=len(pattern.replace("|", "")), hidden_size=64, num_attention_heads=4, num_query_groups=2,
                vocab_size=96, seq_length=32, max_position_embeddings=32, position_embedding_type="none",
                normalization="rmsnorm", activation="squared_relu", add_bias_linear=False, tie_embeddings=False,
                hybrid_layer_pattern=pattern, mamba_num_heads=8, mamba_head_dim=16, mamba_num_groups=2,
                mamba_state_dim=16, **moe)
    return GPTConfig(**{**base, **kw})


def kimi_linear(**kw) -> GPTConfig:
    """Kimi Linear's shape in small: 3 KDA layers to 1 multi-latent attention layer, low-rank decay and gate
    projections, every MLP a mixture with a shared expert."""
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96, seq_length=32,
                max_position_embeddings=32, position_embedding_type="none", normalization="rmsnorm",
                activation="swiglu", add_bias_linear=False, multi_latent_attention=True, kv_lora_rank=16,
                qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, experimental_attention_variant="kda",
                linear_attention_freq=4, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, kda_f_lora_rank=8, kda_gate_lora_rank=8, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32)
    return GPTConfig(**{**base, **kw})


CONFIGS = {
    "kimi-linear": lambda: kimi_linear(),
    "kimi-linear, full-rank gates, biases": lambda: kimi_linear(kda_f_lora_rank=None, kda_gate_lora_rank=None,
                                                                add_bias_linear=True),
    "qwen3-next": lambda: qwen3_next(),
    "qwen3-next, biases, tied, no MTP": lambda: qwen3_next(add_bias_linear=True, tie_embeddings=True, mtp_num_layers=0),
    "G-*E": lambda: nemotron_h("G-*E", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=8),
    "M-*-": lambda: nemotron_h("M-*-"),
    "M-M*E|ME": lambda: nemotron_h("M-M*E|ME", add_bias_linear=True, mtp_num_layers=1),
}
MAMBA = {name for name in CONFIGS if "M" in name.split(",")[0] and name[0] == "M"}


def _built_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    params = list(model.named_parameters())
    replicated = sum(p.numel() for n, p in params if not getattr(p, "tensor_model_parallel", False)
                     and ".experts." not in n)
    return num_parameters(model), replicated, sum(p.numel() for n, p in params if ".experts." in n)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_closed_forms_count_the_built_model(name):
    if name in MAMBA and not HAS_MAMBA:
        pytest.skip("Mamba-2's mixer is not here")
    c = CONFIGS[name]().validate()
    built = _built_counts(GPTModel(c, device="meta"))
    assert built == (num_parameters(c), replicated_parameters(c), expert_parameters(c)), name


def test_a_mixture_without_a_shared_expert_replicates_no_second_bias():
    """With biases, a mixture layer's fc2 biases belong to its routed experts: only the attention projection's is
    replicated (a dense layer also has its fc2's)."""
    c = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, num_experts=4,
                  moe_layer_freq=(0, 1), hidden_dropout=0.0, attention_dropout=0.0)
    assert _built_counts(GPTModel(c, device="meta")) == (num_parameters(c), replicated_parameters(c),
                                                         expert_parameters(c))


def _sharded(names: list[str]) -> dict:
    out = {}
    groups = mpu.initialize_model_parallel(2)
    for name in names:
        m = GPTModel(CONFIGS[name]().validate(2), tp_group=groups.tp_group, device="meta")
        local = num_parameters(m, local=True)
        replicated = sum(p.numel() for p in m.parameters() if not getattr(p, "tensor_model_parallel", False))
        out[name] = (num_parameters(m), (local - replicated) * 2 + replicated)
    mpu.destroy_model_parallel()
    return out


def test_sharded_meta_models_count_the_same():
    names = [n for n in CONFIGS if HAS_MAMBA or n not in MAMBA]
    for name, (full, by_hand) in run_distributed(2, _sharded, names)[0].items():
        assert full == by_hand == num_parameters(CONFIGS[name]()), name


@needs_mamba
def test_mamba_parameters_are_the_listed_shapes():
    c = nemotron_h("M", add_bias_linear=True)
    h, d, gn, heads, k = 64, 8 * 16, 2 * 16, 8, c.linear_conv_kernel_dim
    projections = (2 * d + 2 * gn + heads) * (h + 1) + h * d + h
    small = (d + 2 * gn) * (k + 1) + 3 * heads + d
    assert recurrent_parameters(c, "mamba") == (projections + small, h + small)


def _counted(module: torch.nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(x)
    return counter.get_total_flops()


def test_gated_deltanet_flops_are_the_kernels_matmuls():
    """torch's counter sees the projections and the chunked rule's matmuls; the formula adds the convolution
    (2K per channel) and the UT transform's triangular solve (C (dk + dv) per head), which it does not count."""
    from megazero.model.recurrent.gated_delta_net import GatedDeltaNet

    c = CONFIGS["G-*E"]()
    layer = GatedDeltaNet(c, tp_group=None, tp_size=1)
    tokens = 2 * GDN_CHUNK
    conv = 2 * c.linear_conv_kernel_dim * (2 * 2 * 16 + 4 * 8)
    solve = 4 * GDN_CHUNK * (16 + 8)
    assert _counted(layer, torch.randn(tokens, 1, 64)) == tokens * (recurrent_flops_per_token(c, "gdn") - conv - solve)


def test_kda_flops_are_the_kernels_matmuls():
    """As Gated DeltaNet's, with the pairs of the per-channel decays' sub-chunks, which the counter sees."""
    from megazero.model.recurrent.kimi_delta_attention import KimiDeltaAttention

    c = CONFIGS["kimi-linear"]()
    layer = KimiDeltaAttention(c, tp_group=None, tp_size=1)
    tokens = 2 * GDN_CHUNK
    conv = 2 * c.linear_conv_kernel_dim * (2 * 4 * 16 + 4 * 8)
    solve = 4 * GDN_CHUNK * (16 + 8)
    assert _counted(layer, torch.randn(tokens, 1, 64)) == tokens * (recurrent_flops_per_token(c, "kda") - conv - solve)


@needs_mamba
def test_mamba_flops_are_the_kernels_matmuls():
    from megazero.model.recurrent.counts import SSD_CHUNK
    from megazero.model.recurrent.mamba import MambaMixer

    c = nemotron_h("M")
    layer = MambaMixer(c, tp_group=None, tp_size=1)
    conv = 2 * c.linear_conv_kernel_dim * (8 * 16 + 2 * 2 * 16)
    assert _counted(layer, torch.randn(SSD_CHUNK, 1, 64)) == SSD_CHUNK * (recurrent_flops_per_token(c, "mamba") - conv)


def test_recurrent_layers_have_no_square():
    """Per token, an attention layer's FLOPs grow with the sequence; a Gated DeltaNet layer's do not; the iteration
    is the sum of its layers (the square counted only where attention is)."""
    c = qwen3_next(mtp_num_layers=0)
    for s in (1024, 8192):
        assert layer_flops_per_token(c, 0, s) == layer_flops_per_token(c, 0, 64)  # GDN + MoE
    square = layer_flops_per_token(c, 3, 8192) - layer_flops_per_token(c, 3, 1024)
    assert square == 2 * (8192 - 1024) * 4 * (16 + 16)
    assert attention_square_flops_per_token(c, 8192) * 4 == 2 * 8192 * 4 * 32  # one attention layer in four
    s = 4096
    per_token = sum(layer_flops_per_token(c, i, s) for i in range(4)) + 2 * 64 * c.padded_vocab_size
    assert flops_per_iteration(c, 3, s) == 3 * 3 * s * per_token
