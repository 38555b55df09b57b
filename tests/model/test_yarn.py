"""YaRN RoPE tables against transformers' DeepSeek-V3 rotary embedding (and Megatron-core's where they agree)."""

import pytest
import torch

from megazero.model.attention.rope import (RotaryEmbedding, YarnScaling, rotary_embedding, softmax_mscale,
                                           yarn_attention_factor)
from tests.model.common import tiny_config

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import yarn_apply_mscale  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding  # noqa: E402

ROPE = 16  # qk_pos_emb_head_dim

CASES = [  # (factor, mscale, mscale_all_dim, original_max_position_embeddings, beta_fast, beta_slow, base)
    (4.0, 1.0, 0.0, 64, 32.0, 1.0, 10000.0),
    (4.0, 0.707, 1.0, 64, 32.0, 1.0, 10000.0),
    (40.0, 1.0, 1.0, 4096, 32.0, 1.0, 10000.0),
    (40.0, 0.707, 1.0, 4096, 32.0, 1.0, 50000.0),
    (40.0, 1.0, 0.707, 64, 8.0, 2.0, 10000.0),
    (0.5, 1.0, 1.0, 64, 32.0, 1.0, 10000.0),  # a factor below 1: no attention factor, frequencies stretched
]


def _mla_config(factor, mscale, mscale_all_dim, original, beta_fast, beta_slow, base, rope_type="yarn"):
    return tiny_config("llama", num_query_groups=None, multi_latent_attention=True, q_lora_rank=None,
                       kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=ROPE, v_head_dim=8, rotary_base=base,
                       rope_type=rope_type, rotary_scaling_factor=factor, original_max_position_embeddings=original,
                       beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale, mscale_all_dim=mscale_all_dim)


def _hf(factor, mscale, mscale_all_dim, original, beta_fast, beta_slow, base, rope_type="yarn"):
    params = {"rope_type": "default", "rope_theta": base} if rope_type == "rope" else dict(
        rope_type="yarn", rope_theta=base, factor=factor, original_max_position_embeddings=original,
        beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale, mscale_all_dim=mscale_all_dim)
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=8, qk_rope_head_dim=ROPE,
                                        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=8192,
                                        rope_parameters=params)
    return cfg, DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("case", CASES)
def test_yarn_tables_equal_transformers(case):
    config = _mla_config(*case)
    ours = rotary_embedding(config)
    cfg, theirs = _hf(*case)
    assert ours.dim == ROPE and ours.yarn is not None
    pos = torch.tensor([[0, 1, 5, 63, 64, 1000, 4095, 8191], [3, 2, 1, 0, 100, 200, 300, 7000]])
    cos, sin = ours(pos)  # [s, b, 1, d]
    hf_cos, hf_sin = theirs(torch.zeros(1, dtype=torch.float32), pos)  # [b, s, d]
    torch.testing.assert_close(cos[:, :, 0].transpose(0, 1), hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin[:, :, 0].transpose(0, 1), hf_sin, rtol=0, atol=0)
    torch.testing.assert_close(ours.inv_freq(), theirs.inv_freq, rtol=0, atol=0)
    assert ours.attention_factor == theirs.attention_scaling
    scale = 1 / (8 + ROPE) ** 0.5
    assert softmax_mscale(config) * scale == pytest.approx(yarn_apply_mscale(cfg.rope_parameters, scale), rel=1e-12)


def test_yarn_changes_the_tables_and_plain_rope_is_transformers_default():
    case = (40.0, 0.707, 1.0, 64, 32.0, 1.0, 10000.0)
    plain, yarn = rotary_embedding(_mla_config(*case, rope_type="rope")), rotary_embedding(_mla_config(*case))
    pos = torch.arange(100)
    assert not torch.allclose(plain(pos)[0], yarn(pos)[0])
    assert plain.yarn is None and softmax_mscale(_mla_config(*case, rope_type="rope")) == 1.0
    _, theirs = _hf(*case, rope_type="rope")
    torch.testing.assert_close(plain(pos[None])[0][:, 0, 0], theirs(torch.zeros(1), pos[None])[0][0], rtol=0, atol=0)
    # the highest frequencies (more than beta_fast turns over the original context) are kept, the lowest stretched
    inv, base = yarn.inv_freq(), RotaryEmbedding(ROPE).inv_freq()
    assert inv[0] == base[0] and torch.allclose(inv[-1], base[-1] / 40.0)


def test_standard_attention_takes_yarn_over_its_rotary_dim():
    config = tiny_config("llama", rope_type="yarn", rotary_scaling_factor=8.0, original_max_position_embeddings=8)
    rot = rotary_embedding(config)
    assert rot.dim == config.rotary_dim and rot.yarn == YarnScaling(8.0, 8)
    assert rotary_embedding(tiny_config("llama")).yarn is None


megatron_yarn = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


@pytest.mark.parametrize("case", CASES)
def test_megatron_core_frequencies_agree_and_its_factor_where_both_mscales_are_set(case):
    """Megatron-core's YarnRotaryEmbedding makes the same frequencies; its table factor is the ratio of
    the two mscales whenever they are given (transformers': only when both are non-zero)."""
    factor, mscale, mscale_all_dim, original, beta_fast, beta_slow, base = case
    # its constructor and get_emb need CUDA: its frequencies from its __init__'s lines and its helpers
    exponents = torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE
    extra, inter = 1.0 / (base ** exponents), 1.0 / (factor * base ** exponents)
    low, high = megatron_yarn._yarn_find_correction_range(beta_fast, beta_slow, ROPE, base, original)
    keep = 1.0 - megatron_yarn._yarn_linear_ramp_mask(low, high, ROPE // 2, device="cpu")
    theirs = inter * (1 - keep) + extra * keep
    ours = rotary_embedding(_mla_config(*case))
    torch.testing.assert_close(ours.inv_freq(), theirs, rtol=0, atol=0)
    concentration = megatron_yarn._yarn_get_concentration_factor(factor, mscale, mscale_all_dim)
    if mscale and mscale_all_dim:
        assert yarn_attention_factor(ours.yarn) == pytest.approx(concentration, rel=1e-12)


def test_gpt_oss_yarn_without_rounding_equals_transformers():
    """gpt-oss's YaRN (factor 32, original 4096, truncate false: the correction range stays fractional), as
    megazero's standard attention takes it with --no-yarn-correction-range-round-to-int: transformers'
    GptOssRotaryEmbedding's frequencies and tables, bit for bit; rounding would change them."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    params = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                  truncate=False, original_max_position_embeddings=4096)
    cfg = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    rope_parameters=params, max_position_embeddings=131072)
    theirs = GptOssRotaryEmbedding(cfg)
    config = tiny_config("llama", kv_channels=16, rope_type="yarn", rotary_base=150000.0, rotary_scaling_factor=32.0,
                         original_max_position_embeddings=4096, yarn_correction_range_round_to_int=False)
    ours = rotary_embedding(config)
    torch.testing.assert_close(ours.inv_freq(), theirs.inv_freq, rtol=0, atol=0)
    assert ours.attention_factor == theirs.attention_scaling
    pos = torch.tensor([[0, 1, 4095, 4096, 100000]])
    cos, sin = ours(pos)
    hf_cos, hf_sin = theirs(torch.zeros(1, dtype=torch.float32), pos)
    for ours_t, hf_t in ((cos, hf_cos), (sin, hf_sin)):  # gpt-oss keeps one half: each half of ours is it
        half = ours_t[:, :, 0].transpose(0, 1)
        torch.testing.assert_close(half[..., :8], hf_t, rtol=0, atol=0)
        torch.testing.assert_close(half[..., 8:], hf_t, rtol=0, atol=0)
    rounded = rotary_embedding(config.replace(yarn_correction_range_round_to_int=True))
    assert not torch.equal(rounded.inv_freq(), theirs.inv_freq)
    low, high = megatron_yarn._yarn_find_correction_range(32.0, 1.0, 16, 150000.0, 4096, round_to_int=False)
    keep = 1.0 - megatron_yarn._yarn_linear_ramp_mask(low, high, 8, device="cpu")
    exponents = torch.arange(0, 16, 2, dtype=torch.float32) / 16
    megatron = (1.0 / (32.0 * 150000.0 ** exponents)) * (1 - keep) + (1.0 / 150000.0 ** exponents) * keep
    torch.testing.assert_close(ours.inv_freq(), megatron, rtol=0, atol=1e-12)
