"""The recipes of examples/recipes/: each script's own command line (the script run with a launcher
that records its arguments) parses at the world size it is written for to the model and layout its
header names, and the same flags with tiny shapes and a 4-rank layout train 2 iterations on
synthetic tokens."""

from __future__ import annotations

import json
import math
import os
import re
import stat
import subprocess
import sys

import pytest

from megazero.config import parse_args
from tests.launch import ROOT, in_pool

RECIPES = os.path.join(ROOT, "examples", "recipes")
# The environment the recipes read: a value left in the caller's environment would change the launch.
SETTINGS = {"CHECKPOINT_DIR", "CP", "DATA_PATH", "DRY_RUN", "EP", "GLOBAL_BATCH", "GPU", "GPUS_PER_NODE", "MASTER_ADDR",
            "MASTER_PORT", "MICRO_BATCH", "NNODES", "NODE_RANK", "PLAN", "PP", "SEQ_LENGTH", "TENSORBOARD_DIR",
            "TOKENIZER_MODEL", "TORCHRUN", "TP", "TRAIN_ITERS", "ZERO_STAGE"}


def recipe_command(name: str, tmp_path, **env: str) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, pretrain_gpt.py's arguments) of ``bash examples/recipes/NAME.sh``."""
    record = tmp_path / f"{name}.argv"
    shim = tmp_path / "torchrun"
    shim.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{record}'\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    full_env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    full_env.update(TORCHRUN=str(shim), CHECKPOINT_DIR=str(tmp_path / "ckpt"), **env)
    proc = subprocess.run(["bash", os.path.join(RECIPES, f"{name}.sh")], env=full_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = record.read_text().splitlines()
    split = argv.index("pretrain_gpt.py")
    return argv[:split], argv[split + 1:]


def world_size(launcher: list[str]) -> int:
    value = {flag: launcher[i + 1] for i, flag in enumerate(launcher[:-1]) if flag.startswith("--")}
    return int(value["--nnodes"]) * int(value["--nproc_per_node"])


def substituted(argv: list[str], values: dict[str, str], drop: tuple[str, ...] = ()) -> list[str]:
    """``argv`` with each flag of ``values`` given that value and the switches in ``drop`` removed;
    every flag named must be in the recipe, so a renamed flag fails here rather than going unused."""
    out, i = [], 0
    missing = set(values) | set(drop)
    while i < len(argv):
        flag = argv[i]
        if flag in drop:
            missing.discard(flag)
            i += 1
        elif flag in values:
            missing.discard(flag)
            out += [flag, values[flag]]
            i += 2
        else:
            out.append(flag)
            i += 1
    assert not missing, f"flags not in the recipe: {sorted(missing)}"
    return out


LLAMA = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
             normalization="rmsnorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False,
             tie_embeddings=False, vocab_size=128256)


def _check(config, **expected) -> None:
    m, p = config.model, config.parallel
    got = {k: getattr(p, k) if hasattr(p, k) and not hasattr(m, k) else getattr(m, k) for k in expected}
    assert got == expected


def test_llama3_8b_parses_on_8_gpus(tmp_path):
    launcher, argv = recipe_command("llama3_8b", tmp_path)
    assert world_size(launcher) == 8
    config = parse_args(argv, world_size=8, check_files=False)
    _check(config, **LLAMA, rotary_base=500000.0, seq_length=8192, tp=1, pp=1, cp=1, dp=8, zero_stage=3)
    assert config.precision.dtype == "bf16" and config.data.mock_data


def test_llama3_8b_128k_cp_parses_on_64_gpus(tmp_path):
    launcher, argv = recipe_command("llama3_8b_128k_cp", tmp_path)
    assert world_size(launcher) == 64
    config = parse_args(argv, world_size=64, check_files=False)
    _check(config, **LLAMA, seq_length=131072, tp=4, cp=8, pp=1, dp=2, zero_stage=1, sequence_parallel=True,
           recompute_granularity="full", attention_dropout=0.0)


def test_mixtral_8x7b_parses_on_64_gpus(tmp_path):
    launcher, argv = recipe_command("mixtral_8x7b", tmp_path)
    assert world_size(launcher) == 64
    config = parse_args(argv, world_size=64, check_files=False)
    _check(config, **{**LLAMA, "vocab_size": 32000}, num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.01,
           moe_grouped_gemm=True, rotary_base=1e6, tp=1, pp=4, ep=8, dp=16, zero_stage=1)
    assert all(config.model.is_moe_layer(i) for i in range(32))


def test_deepseek_v3_moe_parses_on_1024_gpus(tmp_path):
    launcher, argv = recipe_command("deepseek_v3_moe", tmp_path)
    assert world_size(launcher) == 1024
    config = parse_args(argv, world_size=1024, check_files=False)
    _check(config, num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
           multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
           v_head_dim=128, num_query_groups=None, resolved_rope_type="yarn", rotary_scaling_factor=40.0,
           original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, mtp_num_layers=1,
           mtp_loss_scaling_factor=0.1, vocab_size=129280, num_experts=256, moe_ffn_hidden_size=2048,
           moe_shared_expert_intermediate_size=2048, moe_router_topk=8, moe_router_score_function="sigmoid",
           moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
           moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
           moe_aux_loss_coeff=1e-4, tie_embeddings=False, tp=2, pp=16, ep=64, dp=32, zero_stage=1,
           sequence_parallel=True)
    assert [i for i in range(61) if config.model.is_moe_layer(i)] == list(range(3, 61))
    assert (config.model.qk_dim, config.model.v_dim) == (192, 128)


GPT_OSS = dict(hidden_size=2880, ffn_hidden_size=2880, moe_ffn_hidden_size=2880, num_attention_heads=64,
               num_query_groups=8, kv_channels=64, vocab_size=201088, seq_length=131072, window_size=(127, 0),
               window_attn_skip_freq=2, softmax_type="learnable", activation="quick_geglu", glu_linear_offset=1.0,
               activation_func_clamp_value=7.0, add_bias_linear=True, normalization="rmsnorm", tie_embeddings=False,
               resolved_rope_type="yarn", rotary_base=150000.0, rotary_scaling_factor=32.0,
               original_max_position_embeddings=4096, yarn_correction_range_round_to_int=False, moe_router_topk=4)


@pytest.mark.parametrize("name, layers, experts, layout", [
    ("gpt_oss_20b", 24, 32, dict(tp=2, cp=8, dp=4, ep=8, zero_stage=1)),
    ("gpt_oss_120b", 36, 128, dict(tp=2, cp=4, dp=8, ep=8, zero_stage=3)),
])
def test_gpt_oss_parses_on_64_gpus_with_hfs_window_pattern(name, layers, experts, layout, tmp_path):
    """The first layer slides, as HF's layer_types begin with sliding_attention: Megatron's
    --window-attn-skip-freq 2 makes the 1-based even layers global."""
    launcher, argv = recipe_command(name, tmp_path)
    assert world_size(launcher) == 64
    config = parse_args(argv, world_size=64, check_files=False)
    _check(config, **GPT_OSS, num_layers=layers, num_experts=experts, pp=1, etp=1, sequence_parallel=True,
           moe_grouped_gemm=True, recompute_granularity="full", **layout)
    m = config.model
    assert [m.layer_window(i) for i in range(4)] == [127, None, 127, None]
    assert all(m.is_moe_layer(i) for i in range(layers)) and m.head_dim * m.num_attention_heads == 4096


def test_deepseek_v3_moe_dry_run_plans_its_uneven_stages():
    """DRY_RUN=1 through the script: tools/estimate_memory.py plans the 1024-GPU launch (exit 0 fits, 1
    does not; 2 would be a plan refused) with the first stage's 3 dense layers and the last stage's 2,
    its MTP depth (a mixture layer) and the embedding's copy: the largest stage."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    proc = subprocess.run(["bash", os.path.join(RECIPES, "deepseek_v3_moe.sh")], env={**env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "world 1024 = tp 2 x pp 16 x dp 32" in out, out[-3000:]
    assert "  stage 0: 3 layers (0-2, 0 MoE) + embedding," in out
    assert "  stage 1: 4 layers (3-6, 4 MoE)," in out
    assert "  stage 15: 2 layers (59-60, 2 MoE) + head + 1 MTP," in out
    assert "parameters: 682,636,472,320 (682.64B)" in out  # 671.0B and the MTP depth's 11.6B
    largest = re.search(r"largest stage: (\d+) \((\d+) layers", out)
    assert largest and largest.groups() == ("15", "2"), out[-3000:]
    assert re.search(r"GPU memory 80 GiB: (fits|does NOT fit)", out)


@pytest.mark.slow
def test_a_recipe_rehearses_its_launch():
    """DRY_RUN=rehearse through the script: tools/rehearse.py runs rank 0 of the launch (the recipe's flags, tiny
    shapes given after them win) and reports it beside the plan; no launch."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "64",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16", "--window-size", "15,0",
            "--num-experts", "4", "--moe-router-topk", "2", "--tp", "1", "--cp", "2", "--ep", "2", "--vocab-size", "512",
            "--global-batch-size", "4", "--ranks", "0", "--micro-batches", "1"]
    proc = subprocess.run(["bash", os.path.join(RECIPES, "gpt_oss_20b.sh"), *tiny],
                          env={**env, "DRY_RUN": "rehearse", "NNODES": "1", "GPUS_PER_NODE": "4", "SEQ_LENGTH": "64",
                               "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr  # the progress line on stderr
    assert "rehearsal of 4 ranks = tp 1 x cp 2 x pp 1 x dp 2" in out and "rehearsed 1/1 ranks" in out, out[-3000:]
    assert "the plan (tools/estimate_memory.py): state" in out and "sent, ep" in out


def test_plan_picks_a_layout_for_a_recipe_model(tmp_path):
    """PLAN=1 through the script: tools/plan.py searches the recipe's model at the world size, the recipe's own
    layout and micro-batch left out; its chosen launch parses at that world size."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    out = tmp_path / "plan.json"
    proc = subprocess.run(["bash", os.path.join(RECIPES, "llama3_8b.sh"), "--json", str(out), "--top", "3"],
                          env={**env, "PLAN": "1", "NNODES": "1", "GPU": "h200"}, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 x h200" in proc.stdout and "chosen:" in proc.stdout
    best = json.loads(out.read_text())["plans"][0]
    config = parse_args(best["args"], 8, check_files=False, planning=True)
    assert (config.parallel.tp, config.parallel.pp, config.schedule.micro_batch_size) == \
        (best["tp"], best["pp"], best["micro_batch_size"])
    assert config.model.num_layers == 32 and config.model.ffn_size == 14336  # the recipe's model


def test_a_recipe_with_data_passes_its_tokenizer(tmp_path):
    _, argv = recipe_command("mixtral_8x7b", tmp_path, DATA_PATH="0.7 /d/a 0.3 /d/b", TOKENIZER_MODEL="/t/tok.model")
    assert "--mock-data" not in argv
    joined = " ".join(argv)
    assert "--data-path 0.7 /d/a 0.3 /d/b" in joined and "--tokenizer-type Llama2Tokenizer" in joined
    assert "--tokenizer-model /t/tok.model" in joined


TINY = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4", "--num-query-groups": "2",
        "--vocab-size": "512", "--micro-batch-size": "1", "--global-batch-size": "4", "--train-iters": "2",
        "--eval-iters": "1", "--lr-warmup-iters": "1"}
# Each recipe at a tiny size on 4 ranks, with a layout of the same kinds as the recipe's.
TINY_RUNS = {
    "llama3_8b": ({"--num-layers": "2", "--seq-length": "64", "--max-position-embeddings": "64"}, (),
                  "tp 1 x pp 1 x dp 4"),
    "llama3_8b_128k_cp": ({"--num-layers": "2", "--seq-length": "128", "--max-position-embeddings": "128",
                           "--tensor-model-parallel-size": "2", "--context-parallel-size": "2"}, (),
                          "tp 2 x cp 2 (p2p) x pp 1 x dp 1"),
    "mixtral_8x7b": ({"--num-layers": "2", "--seq-length": "64", "--max-position-embeddings": "64",
                      "--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "2"}, (),
                     "tp 1 x pp 2 x dp 2"),
    # multi-latent attention has no query groups (None: TINY's flag not given)
    "deepseek_v3_moe": ({"--num-layers": "4", "--seq-length": "64", "--max-position-embeddings": "64",
                         "--num-query-groups": None, "--q-lora-rank": "24", "--kv-lora-rank": "16",
                         "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16", "--num-experts": "8", "--moe-ffn-hidden-size": "32",
                         "--moe-layer-freq": "([0]*1+[1]*3)", "--moe-shared-expert-intermediate-size": "32",
                         "--moe-router-topk": "2", "--moe-router-num-groups": "4", "--moe-router-group-topk": "2",
                         "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "2",
                         "--decoder-first-pipeline-num-layers": "2", "--decoder-last-pipeline-num-layers": "2",
                         "--expert-model-parallel-size": "2"}, (), "tp 1 x pp 2 x dp 2"),
    # windows of 16 keys over 64 tokens, sinks, the clamped experts, YaRN; ZeRO-3 for the 120b's
    **{name: ({"--num-layers": "2", "--seq-length": "64", "--max-position-embeddings": "64", "--kv-channels": "16",
               "--window-size": "15,0", "--num-experts": "4", "--moe-ffn-hidden-size": "64", "--moe-router-topk": "2",
               "--tensor-model-parallel-size": "1", "--context-parallel-size": "2",
               "--expert-model-parallel-size": "2"}, (), "tp 1 x cp 2 (p2p) x pp 1 x dp 2")
       for name in ("gpt_oss_20b", "gpt_oss_120b")},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_recipe_trains_at_a_tiny_size(name, tmp_path):
    values, drop, layout = TINY_RUNS[name]
    _, argv = recipe_command(name, tmp_path)
    argv = substituted(argv, {k: v for k, v in {**TINY, **values}.items() if v is not None}, drop)
    run = in_pool(4, argv, cwd=ROOT)
    log = run.output
    (tmp_path / "log.txt").write_text(log)
    assert run.returncode == 0, log[-6000:]
    assert layout in log, log[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss: (\S+)", log)]
    assert re.search(r"iteration\s+2/\s*2\b", log) and losses and all(math.isfinite(x) for x in losses), log[-3000:]
    assert os.path.exists(tmp_path / "ckpt" / "latest")


def test_the_tests_clear_every_setting_the_recipes_read():
    text = "".join(open(os.path.join(RECIPES, f)).read() for f in os.listdir(RECIPES) if f.endswith(".sh"))
    read = set(re.findall(r"\$\{([A-Z_]+):[-?]", text)) - {"OMP_NUM_THREADS", "PYTHON"}  # not the launch's
    assert read == SETTINGS
