"""The hybrid recipes (Qwen3-Next-80B-A3B at 131072 tokens with context parallelism over Gated DeltaNet and gated
attention; a Nemotron-H-56B-style Mamba-2 stack from Megatron's allocation ratios): each script's command parses at
the world size it is written for to the model its header names, and its dry run plans the parameters the
released models have."""

from __future__ import annotations

import os
import re
import subprocess

from megazero.config import parse_args
from tests.training.test_recipes import RECIPES, SETTINGS, recipe_command, world_size
from megazero.model.flops import num_parameters


def test_qwen3_next_80b_a3b_parses_on_64_gpus(tmp_path):
    launcher, argv = recipe_command("qwen3_next_80b_a3b", tmp_path)
    assert world_size(launcher) == 64
    config = parse_args(argv, world_size=64, check_files=False)
    m, p = config.model, config.parallel
    assert (p.tp, p.cp, p.dp, p.ep, p.pp, p.zero_stage) == (1, 8, 8, 8, 1, 3) and m.seq_length == 131072
    kinds = [m.layer_kinds(i).mixer for i in range(m.num_layers)]
    assert kinds == ["gdn", "gdn", "gdn", "standard"] * 12 and m.attention_output_gate and m.rotary_dim == 64
    assert round(num_parameters(m) / 1e9, 1) == 79.7  # Qwen3-Next-80B-A3B's 80B (its MTP head left out)


def test_nemotron_h_56b_allocates_megatrons_pattern_on_128_gpus(tmp_path):
    launcher, argv = recipe_command("nemotron_h_56b", tmp_path)
    assert world_size(launcher) == 128
    config = parse_args(argv, world_size=128, check_files=False)
    pattern = config.model.hybrid_layer_pattern
    assert len(pattern) == 118 and (pattern.count("M"), pattern.count("*"), pattern.count("-")) == (54, 10, 54)
    assert round(num_parameters(config.model) / 1e9, 1) == 56.3


def test_the_hybrid_dry_run_plans_state_passing_bytes():
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    proc = subprocess.run(["bash", os.path.join(RECIPES, "qwen3_next_80b_a3b.sh")], env={**env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parameters: 79,674,391,296" in proc.stdout
    assert re.search(r"context parallel [0-9.]+ GiB", proc.stdout)
    assert re.search(r"GPU memory 80 GiB: fits", proc.stdout), proc.stdout[-2000:]
