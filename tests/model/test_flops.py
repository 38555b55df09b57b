"""Parameter counts and FLOPs: closed forms against meta-built models and Narayanan et al. 2021."""

import time

import pytest
import torch

from megazero import mpu
from megazero.model import PRESETS, GPTModel, gpt_preset
from megazero.model.flops import flops_per_iteration, flops_per_token, layer_forward_flops_per_token, num_parameters
from tests.distributed import run_distributed
from tests.model.common import tiny_config

# Exact parameter counts (padded vocab 50304, tied, learned positions).
EXPECTED = {
    "gpt-tiny": 136_960, "gpt-125m": 125_262_336, "gpt-350m": 355_919_872, "gpt-760m": 760_372_224,
    "gpt-1.3b": 1_315_819_520, "gpt-2.7b": 2_651_673_600, "gpt-6.7b": 6_658_596_864,
    "gpt-13b": 12_853_626_880, "gpt-175b": 174_604_836_864,
}


def narayanan_params(l, h, V, s):
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


@pytest.mark.parametrize("name", list(PRESETS))
def test_meta_model_matches_closed_form(name):
    c = gpt_preset(name)
    start = time.perf_counter()
    model = GPTModel(c, device="meta")
    assert time.perf_counter() - start < 5.0
    assert all(p.is_meta for p in model.parameters())
    n = num_parameters(model)
    assert n == num_parameters(c) == EXPECTED[name]
    # Narayanan's formula plus the final LayerNorm's 2h (the paper leaves it out).
    paper = narayanan_params(c.num_layers, c.hidden_size, c.padded_vocab_size, c.max_position_embeddings)
    assert n == round(paper) + 2 * c.hidden_size


def test_13b_is_12_85_billion():
    assert num_parameters(gpt_preset("13b")) == 12_853_626_880


@pytest.mark.parametrize("l, h, billions", [(24, 2304, 1.7), (30, 3072, 3.6), (36, 4096, 7.5), (40, 6144, 18.4),
                                            (48, 8192, 39.1), (60, 10240, 76.1), (80, 12288, 145.6)])
def test_table_1_parameter_counts(l, h, billions):
    c = gpt_preset("125m", num_layers=l, hidden_size=h, num_attention_heads=32, vocab_size=51200)
    assert round(num_parameters(c) / 1e9, 1) == billions


def _sharded_counts():
    out = {}
    for tp in (1, 2, 4):
        groups = mpu.initialize_model_parallel(tp)
        for name in PRESETS:
            c = gpt_preset(name)
            if c.num_attention_heads % tp == 0:
                m = GPTModel(c, tp_group=groups.tp_group, device="meta")
                local = num_parameters(m, local=True)
                replicated = sum(p.numel() for p in m.parameters() if not getattr(p, "tensor_model_parallel", False))
                out[(tp, name)] = (num_parameters(m), (local - replicated) * tp + replicated)
        mpu.destroy_model_parallel()
    return out


def test_sharded_meta_models_count_the_same():
    for (tp, name), (full, by_hand) in run_distributed(4, _sharded_counts)[0].items():
        assert full == by_hand == EXPECTED[name], (tp, name)


@pytest.mark.parametrize("name", ["gpt-125m", "gpt-1.3b", "gpt-13b", "gpt-175b"])
def test_flops_reduce_to_equation_3(name):
    c = gpt_preset(name)
    B, s, l, h, V = 1536, c.seq_length, c.num_layers, c.hidden_size, c.padded_vocab_size
    eq3 = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert flops_per_iteration(c, B, s, recompute_full=True) == pytest.approx(eq3, rel=1e-12)
    # Without recompute the layers cost 3 passes instead of 4; the logit layer is never recomputed.
    no_recompute = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert flops_per_iteration(c, B, s) == pytest.approx(no_recompute, rel=1e-12)
    assert flops_per_token(c) == pytest.approx(flops_per_iteration(c, 1) / s)


def test_flops_generalize_to_gqa_and_swiglu():
    c = tiny_config("llama")  # h=64, 8 heads of 8, 4 groups, swiglu ffn=192, s=16
    h, d, s, f = 64, 8, 16, c.ffn_size
    qkv = 2 * h * (8 + 2 * 4) * d
    expected = qkv + 4 * s * h + 2 * h * h + 2 * h * 2 * f + 2 * f * h
    assert layer_forward_flops_per_token(c) == expected
    assert layer_forward_flops_per_token(c.replace(num_query_groups=None)) - expected == 2 * h * 8 * d


def test_a_sliding_window_counts_the_pairs_it_computes():
    """The square convention counts twice a causal layer's pairs: a sliding layer counts twice its window's
    (sum over queries of min(i, w) + 1), so gpt-oss's pattern (every second layer global) is their mean."""
    from megazero.model.config import GPTConfig
    from megazero.model.flops import attention_square_flops_per_token

    s, w = 4096, 127
    c = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=s, max_position_embeddings=s,
                  vocab_size=64)
    per_key = 2 * c.num_attention_heads * (c.qk_dim + c.v_dim)
    pairs = sum(min(i, w) + 1 for i in range(s))
    windowed = c.replace(window_size=(w, 0))
    assert attention_square_flops_per_token(windowed) == round(per_key * 2 * pairs / s)
    assert attention_square_flops_per_token(c) == per_key * s
    mixed = c.replace(window_size=(w, 0), window_attn_skip_freq=2)
    assert attention_square_flops_per_token(mixed) == round(per_key * (s + 2 * pairs / s) / 2)
