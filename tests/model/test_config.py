"""GPTConfig: resolved sizes, presets, and errors that name the clashing numbers."""

import dataclasses

import pytest
import torch

from megazero.model import PRESETS, GPTConfig, gpt_preset
from tests.model.common import tiny_config


def test_resolved_sizes():
    c = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=50257)
    assert (c.ffn_size, c.head_dim, c.query_groups, c.padded_vocab_size) == (256, 16, 4, 50304)
    # padded vocab depends on tp only when asked (vocab_padding_tp): TP-independent by default
    assert c.replace(make_vocab_size_divisible_by=64).padded_vocab_size == 50304
    s = c.replace(activation="swiglu", hidden_size=4096, num_attention_heads=32)
    assert s.ffn_size == 10880  # Megatron-LM: int(4h * 2/3 / 64) * 64 (Llama-7B's 11008 rounds to 256 instead)
    assert c.replace(ffn_hidden_size=100).ffn_size == 100
    assert c.replace(num_query_groups=2).query_groups == 2


def test_presets():
    assert gpt_preset("gpt-13b") == gpt_preset("13b")
    c = gpt_preset("13B", seq_length=1024)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length, c.vocab_size) == (40, 5120, 40, 1024, 50257)
    for name in PRESETS:
        gpt_preset(name).validate()
    with pytest.raises(ValueError, match="valid names: gpt-tiny, gpt-125m"):
        gpt_preset("gpt-7b")


def test_dict_round_trip():
    c = tiny_config("llama", params_dtype=torch.bfloat16)
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        GPTConfig.from_dict({**c.to_dict(), "n_layer": 3})


@pytest.mark.parametrize("changes, tp, words", [
    (dict(hidden_size=65), 1, ["hidden_size (65)", "num_attention_heads (8)"]),
    (dict(num_attention_heads=6, hidden_size=48), 4, ["num_attention_heads (6)", "(4)"]),
    (dict(num_query_groups=2), 4, ["num_query_groups (2)", "(4)"]),
    (dict(num_query_groups=3), 1, ["num_attention_heads (8)", "num_query_groups (3)"]),
    (dict(ffn_hidden_size=130), 4, ["ffn size (130)", "(4)"]),
    (dict(vocab_size=70, make_vocab_size_divisible_by=33), 2, ["padded vocabulary (99", "(2)"]),
    (dict(seq_length=32), 1, ["seq_length (32)", "max_position_embeddings (16)"]),
    (dict(normalization="batchnorm"), 1, ["normalization='batchnorm'"]),
    (dict(attention_backend="xformers"), 1, ["attention_backend='xformers'"]),
    (dict(recompute_granularity="partial"), 1, ["recompute_granularity='partial'"]),
    (dict(hidden_dropout=1.0), 1, ["hidden_dropout", "1.0"]),
    (dict(attention_dropout=-0.1), 1, ["attention_dropout", "-0.1"]),
    (dict(position_embedding_type="rope", hidden_size=72, num_attention_heads=8), 1, ["rotated dimensions, got 9"]),
])
def test_impossible_configs_name_the_numbers(changes, tp, words):
    with pytest.raises(ValueError) as e:
        tiny_config("gpt", **changes).validate(tp)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_rope_ignores_position_table_and_sp_with_tp1_is_allowed():
    tiny_config("llama", seq_length=64).validate(1)  # no learned table to exceed
    tiny_config("gpt", sequence_parallel=True).validate(1)  # a no-op at tp=1


def test_fields_are_documented_names():
    names = [f.name for f in dataclasses.fields(GPTConfig)]
    assert names[:4] == ["num_layers", "hidden_size", "num_attention_heads", "vocab_size"]
    assert {"ffn_hidden_size", "num_query_groups", "recompute_granularity", "attention_backend", "params_dtype"} <= set(names)
