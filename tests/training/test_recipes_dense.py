"""The dense recipes people start from in 2026 (Llama-3.1-8B and 70B with Llama 3.1's RoPE scaling, Qwen3-32B
with its per-head query/key norms): each script's command parses at the world size it is written for to the
model its header names, and the same flags at a tiny size train 2 iterations on 4 ranks."""

from __future__ import annotations

import os
import re

import pytest

from megazero.config import parse_args
from tests.launch import ROOT, in_pool
from tests.training.test_recipes import LLAMA, TINY, _check, recipe_command, substituted, world_size

LLAMA31 = dict(LLAMA, rotary_base=500000.0, rope_type="llama3", rotary_scaling_factor=8.0, low_freq_factor=1.0,
               high_freq_factor=4.0, original_max_position_embeddings=8192, max_position_embeddings=131072)


def test_llama3_1_8b_parses_on_8_gpus(tmp_path):
    launcher, argv = recipe_command("llama3_1_8b", tmp_path)
    assert world_size(launcher) == 8
    config = parse_args(argv, world_size=8, check_files=False)
    _check(config, **LLAMA31, seq_length=8192, tp=1, pp=1, dp=8, zero_stage=3)


def test_llama3_1_70b_parses_on_64_gpus(tmp_path):
    launcher, argv = recipe_command("llama3_1_70b", tmp_path)
    assert world_size(launcher) == 64
    config = parse_args(argv, world_size=64, check_files=False)
    _check(config, **{**LLAMA31, "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672,
                      "num_attention_heads": 64}, tp=8, pp=4, dp=2, zero_stage=1, sequence_parallel=True)
    assert config.parallel.virtual_pp == 4


def test_qwen3_32b_parses_on_32_gpus(tmp_path):
    launcher, argv = recipe_command("qwen3_32b", tmp_path)
    assert world_size(launcher) == 32
    config = parse_args(argv, world_size=32, check_files=False)
    _check(config, num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
           num_query_groups=8, kv_channels=128, qk_layernorm=True, rotary_base=1e6, layernorm_epsilon=1e-6,
           add_bias_linear=False, tie_embeddings=False, vocab_size=151936, seq_length=32768, tp=8, pp=2, dp=2)
    assert config.model.head_dim * config.model.num_attention_heads == 8192


TINY_RUNS = {
    "llama3_1_8b": ({"--num-layers": "2", "--seq-length": "64", "--max-position-embeddings": "64",
                     "--rope-scaling-factor": "8"}, "tp 1 x pp 1 x dp 4"),
    "llama3_1_70b": ({"--num-layers": "4", "--seq-length": "64", "--max-position-embeddings": "64",
                      "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
                      "--num-layers-per-virtual-pipeline-stage": "1"}, "tp 2 x pp 2 x dp 1"),
    "qwen3_32b": ({"--num-layers": "2", "--seq-length": "64", "--max-position-embeddings": "64", "--kv-channels": "32",
                   "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2"}, "tp 2 x pp 2 x dp 1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_dense_recipe_trains_at_a_tiny_size(name, tmp_path):
    values, layout = TINY_RUNS[name]
    _, argv = recipe_command(name, tmp_path)
    argv = substituted(argv, {**TINY, **values})
    run = in_pool(4, argv, cwd=ROOT)
    log = run.output
    assert run.returncode == 0, log[-6000:]
    assert layout in log, log[-3000:]
    assert re.search(r"iteration\s+2/\s*2\b", log), log[-3000:]
    assert os.path.exists(tmp_path / "ckpt" / "latest")
