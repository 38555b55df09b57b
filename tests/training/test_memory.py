"""Memory planner: ZeRO-paper and Korthikanti formulas on hand-worked cases, the CLI, and
the 13B launch script's dry run."""

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from megazero.model.config import GPTConfig, gpt_preset
from megazero.model.flops import flops_per_iteration, num_parameters
from megazero.observe.planner import (activation_bytes_per_layer, estimate_memory, model_state_bytes,
                                      replicated_parameters)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "azure" / "run_gpt_13b.sh"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- model states (ZeRO paper, Fig. 1 / Sec. 5: Psi = 7.5B, N_d = 64, K = 12) -------------------

@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)])
def test_zero_paper_example(stage, gb):
    # The paper's 2 + 2 + K: bf16 gradients (megazero's default accumulates them in fp32).
    assert sum(model_state_bytes(7.5e9, dp=64, zero_stage=stage, precision="bf16", grad_accum_dtype="bf16")) == gb * 1e9


def test_bf16_gradients_default_to_fp32():
    # Megatron's distributed-optimizer figure: 18 bytes per parameter without partitioning.
    assert sum(model_state_bytes(100, dp=1, zero_stage=0, precision="bf16")) == 1800


def test_state_split_fp32_and_fp32_grads():
    assert model_state_bytes(100, dp=4, zero_stage=0, precision="fp32") == (400, 400, 800)
    assert model_state_bytes(100, dp=4, zero_stage=3, precision="fp32") == (100, 100, 200)
    assert model_state_bytes(100, dp=4, zero_stage=1, precision="bf16", grad_accum_dtype="fp32") == (200, 400, 300)


def test_monotonic_in_dp_and_stage():
    c = gpt_preset("1.3b")
    totals = [[estimate_memory(c, tp=1, dp=dp, zero_stage=z, micro_batch_size=1).model_states for z in range(4)]
              for dp in (1, 2, 8, 64)]
    assert len(set(totals[0])) == 1  # dp = 1: nothing to partition over
    for row in totals[1:]:
        assert row == sorted(row, reverse=True) and len(set(row)) == 4
    for z in range(1, 4):
        column = [row[z] for row in totals]
        assert column == sorted(column, reverse=True) and len(set(column)) == 4
    assert totals[0][3] / totals[3][3] == 64
    assert len({row[0] for row in totals}) == 1  # stage 0 does not partition


def test_tp_local_params_count_replicated_weights_once():
    c = gpt_preset("gpt-tiny")  # l=2, h=64, V=512, positions 64
    assert num_parameters(c) == 12 * 2 * 64 ** 2 + 13 * 2 * 64 + (512 + 64) * 64 + 2 * 64 == 136960
    # norms 2 x 2h + row-parallel biases 2h per layer, final norm 2h, position table 64h
    assert replicated_parameters(c) == 2 * 6 * 64 + 2 * 64 + 64 * 64 == 4992
    est = estimate_memory(c, tp=2, dp=1, zero_stage=0, micro_batch_size=1)
    assert est.params_per_rank == (136960 - 4992) / 2 + 4992 == 70976
    assert est.params == 2 * 70976 and est.optimizer == 12 * 70976


# --- activations (Korthikanti et al. 2022, Sec. 4) ------------------------------------------------
# s=32, b=2, h=64, a=4: sbh = 4096, 5as/h = 10

SMALL = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                  max_position_embeddings=32)


@pytest.mark.parametrize("tp, sp, scores, per_layer", [
    (1, False, True, 4096 * (34 + 10)),  # sbh(34 + 5as/h)
    (2, False, True, 4096 * (10 + 24 / 2 + 10 / 2)),  # sbh(10 + 24/t + 5as/(ht))
    (2, True, True, 4096 * (34 / 2 + 10 / 2)),  # sbh(34/t + 5as/(ht))
    (1, False, False, 4096 * 34),  # selective recompute / flash attention
    (2, True, False, 4096 * 34 / 2),
])
def test_korthikanti_per_layer(tp, sp, scores, per_layer):
    got = activation_bytes_per_layer(SMALL, micro_batch_size=2, seq_length=32, tp=tp, sequence_parallel=sp,
                                     keep_attention_scores=scores)
    assert got == per_layer


def test_activation_totals_by_recompute_mode():
    outside = 4096 * (1 + 2 * 2) + 4 * 32 * 2 * 128  # dropout mask, norm + logit-layer inputs, fp32 logits
    kw = dict(tp=1, dp=1, zero_stage=0, micro_batch_size=2)
    assert estimate_memory(SMALL, **kw).activations == 2 * 4096 * 44 + outside
    assert estimate_memory(SMALL, recompute="selective", **kw).activations == 2 * 4096 * 34 + outside
    assert estimate_memory(SMALL, flash_attn=True, **kw).activations == 2 * 4096 * 34 + outside
    # full: each layer keeps its 2sbh input, plus one layer's activations while it is recomputed
    assert estimate_memory(SMALL, recompute="full", **kw).activations == 2 * 2 * 4096 + 4096 * 44 + outside
    fp32 = estimate_memory(SMALL, precision="fp32", **kw).activations
    assert fp32 == 2 * 4096 * (4 * 4 + 2 + 4 * 12 + 10 * 9 / 5) + 4096 * (1 + 2 * 4) + 4 * 32 * 2 * 128


def test_13b_plan_and_flops():
    c = gpt_preset("13b")
    est = estimate_memory(c, tp=4, dp=16, zero_stage=3, micro_batch_size=2, precision="bf16", recompute="full",
                          global_batch_size=1024)
    assert est.flops_per_iteration == flops_per_iteration(c, 1024, 2048, recompute_full=True)
    assert est.total < 8 * 2 ** 30 and "total" in est.to_text(80) and "fits" in est.to_text(80)


# --- CLI and launch script ---------------------------------------------------------------------

def test_cli_exit_codes(capsys):
    tool = load_tool("estimate_memory")
    base = "--model-preset 13b --tp 4 --dp 16 --zero-stage 3 --micro-batch-size 2 --bf16 --recompute full".split()
    assert tool.main(base + ["--gpu-memory-gb", "80", "--global-batch-size", "1024"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 12,855,592,960" in out  # vocabulary padded to 50,688 at tp 4, as training pads and "FLOPs per iteration (global batch 1024)" in out
    assert tool.main(base + ["--gpu-memory-gb", "2"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"needs [\d.]+ GiB per GPU, [\d.]+ GiB more than the 2 GiB available", err)
    assert tool.main("--model-preset 13b --tp 1 --dp 8 --zero-stage 1 --micro-batch-size 1 --bf16 "
                     "--gpu-memory-gb 80".split()) == 1
    assert "Changes that would fit: --zero-stage 3" in capsys.readouterr().err
    assert tool.main("--model-preset 13b --tp 3 --dp 1".split()) == 2  # 40 heads % 3


def run_dry(gpu_gb=None):
    env = {**os.environ, "DRY_RUN": "1", "NNODES": "2", "REHEARSE": "0"}  # the plan (the rehearsal: below)
    env.pop("GPU_MEMORY_GB", None)
    if gpu_gb is not None:
        env["GPU_MEMORY_GB"] = str(gpu_gb)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_13b_script_dry_run_fits_and_counts_parameters():
    r = run_dry()
    assert r.returncode == 0, r.stdout + r.stderr
    printed = int(re.search(r"parameters: ([\d,]+)", r.stdout).group(1).replace(",", ""))
    l, h, s = 40, 5120, 2048
    planned = gpt_preset("13b", vocab_padding_tp=4)  # the script's tp 4 pads as Megatron: 50688 rows
    v = planned.padded_vocab_size
    assert v == 50688
    closed = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))  # Narayanan et al. 2021
    assert printed == num_parameters(planned) == 12_853_626_880 + (50688 - 50304) * h == 12_855_592_960
    assert printed - closed == pytest.approx(2 * h)  # the formula leaves out the final LayerNorm
    assert "world 16 = tp 4 x pp 1 x dp 4, ZeRO stage 3" in r.stdout
    for row in ("weights", "gradients", "optimizer states", "activations", "FLOPs per iteration"):
        assert row in r.stdout


def test_13b_script_dry_run_refuses_small_gpu():
    r = run_dry(gpu_gb=8)
    assert r.returncode != 0 and "GiB more than the 8 GiB available" in r.stderr


@pytest.mark.parametrize("layout,ranks", [("tp4pp8z1", "0,28"), ("tp4z3", "0")])
def test_13b_script_rehearsal_agrees_with_the_plan(layout, ranks):
    """The dry run's rehearsal mode runs tools/rehearse.py on the script's own 13B arguments (8
    micro-batches per iteration: the same peak as 512, at pp 8 a stage holds at most 8): the first
    and last pipeline stage (tp4pp8z1 on 32 GPUs, dp 1) and a DP rank of tp4z3 (all alike), each
    beside the plan, which agrees within 10% on the peak and 2% on the state."""
    env = {**os.environ, "DRY_RUN": "rehearse", "NNODES": "4", "LAYOUT": layout, "REHEARSE_MICRO_BATCHES": "8",
           "REHEARSE_RANKS": ranks}
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.findall(r"^rank (\d+) ", r.stdout, re.M) == ranks.split(","), r.stdout
    ratios = re.findall(r"rehearsed / plan: state ([\d.]+)x, peak ([\d.]+)x", r.stdout)
    assert len(ratios) == len(ranks.split(",")), r.stdout
    for state, peak in ratios:
        assert float(state) == pytest.approx(1.0, abs=0.02) and float(peak) == pytest.approx(1.0, abs=0.10), r.stdout
