"""Llama 3.1's RoPE scaling against megatron-core and through Megatron-LM's arguments: megatron-core's own
``RotaryEmbedding(rope_scaling=True)`` gives the frequencies megazero's llama3 RoPE gives; a Megatron-LM
checkpoint's ``use_rope_scaling`` reads as rope_type llama3 with Megatron's fixed factors, and megazero's
torch_dist arguments write it back in Megatron's spelling."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest
import torch

from megazero.model.attention.rope import RotaryEmbedding, Llama3Scaling
from megazero.model.config import GPTConfig
from megazero.model.interop.megatron_args import megatron_model_args
from megazero.model.interop.megatron_import import config_from_megatron_args
from tests.model.test_megatron_import import _args

LLAMA3 = dict(position_embedding_type="rope", rope_type="llama3", rotary_scaling_factor=8.0,
              original_max_position_embeddings=8192, rotary_base=500000.0)


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=128, num_attention_heads=2, vocab_size=64, seq_length=32,
                max_position_embeddings=32, normalization="rmsnorm", activation="swiglu", add_bias_linear=False)
    return GPTConfig(**{**base, **LLAMA3, **kw}).validate()


def test_the_frequencies_are_megatron_cores():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rotary = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    theirs = rotary.RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rope_scaling=True, rope_scaling_factor=8.0,
                                    rotary_base=500000, use_cpu_initialization=True).inv_freq
    c = _config()
    ours = RotaryEmbedding(64, c.rotary_base, llama3=Llama3Scaling.of(c)).inv_freq(torch.device("cpu"))
    plain = RotaryEmbedding(64, c.rotary_base).inv_freq(torch.device("cpu"))
    assert not torch.allclose(plain, theirs, rtol=1e-3)  # the scaling changes the low frequencies
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_megatron_lm_use_rope_scaling_reads_as_llama3():
    a = _args("llama", 1, 1)
    a.use_rope_scaling, a.rope_scaling_factor, a.rotary_base = True, 32.0, 500000
    c = config_from_megatron_args(a)
    assert (c.resolved_rope_type, c.rotary_scaling_factor, c.low_freq_factor, c.high_freq_factor,
            c.original_max_position_embeddings) == ("llama3", 32.0, 1.0, 4.0, 8192)
    assert config_from_megatron_args(_args("llama", 1, 1)).resolved_rope_type == "rope"


def test_torch_dist_arguments_write_megatron_spelling_and_read_back():
    c = _config(low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=16)
    args = megatron_model_args(c)
    assert (args["rope_type"], args["use_rope_scaling"], args["rope_scaling_factor"]) == ("rope", True, 8.0)
    ns = argparse.Namespace(**{**vars(_args("llama", 1, 1)), **args})
    back = config_from_megatron_args(ns)
    assert (back.resolved_rope_type, back.rotary_scaling_factor, back.low_freq_factor, back.high_freq_factor,
            back.original_max_position_embeddings) == ("llama3", 8.0, 2.0, 8.0, 16)
    plain = megatron_model_args(dataclasses.replace(c, rope_type=None, rotary_scaling_factor=1.0))
    assert "use_rope_scaling" not in plain
