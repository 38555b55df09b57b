"""tools/plan.py as a user runs it: its plans rehearsed within 10 % of their predicted peak on every
rehearsed stage, and the flags of its best plan (pp 1, cp 2, ep 2 at pp 2, 5 layers at pp 3) launched through
pretrain_gpt.py train like the one-process run of the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training import test_layout_invariance as invariance
from tests.training.test_layout_invariance import assert_same_run, flags, launch

data = invariance.data  # the corpus fixture

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp_path, name: str, *argv: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "--json", str(out), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_top_plans_rehearse_within_10_percent_of_their_prediction(tmp_path):
    """A small GPT (RMSNorm, SwiGLU, grouped-query attention) on 8 GPUs of 4 per node with little memory:
    the top three plans, first and last stage each, as tools/rehearse.py measures them."""
    model = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "704", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--vocab-size", "4000", "--bf16", "--global-batch-size", "32"]
    doc, out = _plan(tmp_path, "rehearsed", "--world-size", "8", "--gpus-per-node", "4", "--device-memory-gb", "1.6",
                     "--memory-reserve-gb", "0", "--rehearse", "3", "--pp", "2", *model)
    rows = doc["rehearsed"]
    assert {r["plan"] for r in rows} == {1, 2, 3} and {r["stage"] for r in rows} == {0, 1}
    for r in rows:
        assert abs(r["error"]) <= 0.10, (r, out)
        assert r["rehearsed_bytes"] + 0 <= 1.6 * 2 ** 30  # a plan that fits is rehearsed within the device
    assert "predicted" in out and "rehearsed" in out


def _without(words: list[str], name: str) -> list[str]:
    i = words.index(name)
    return words[:i] + words[i + 2:]


# a mixture of experts as tests/training/test_moe_training.py trains it
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--disable-bias-linear",
       "--swiglu", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-layer-freq", "2"]


@pytest.mark.parametrize("name,world,layers,fixed,model_extra", [
    ("pp1", 4, 4, ["--pp", "1"], []),
    ("cp2", 4, 4, ["--cp", "2"], []),  # a fixed context-parallel size (the search's prior would not split 16 tokens)
    ("ep2_pp2", 4, 4, ["--ep", "2", "--pp", "2"], MOE),
    ("pp3_uneven", 3, 5, ["--pp", "3"], []),  # 5 layers over 3 stages: Megatron's lighter end stages
])
def test_the_best_plan_launches_and_trains_like_one_process(data, tmp_path, name, world, layers, fixed, model_extra):
    """The plan's ``args`` (pretrain_gpt.py's flags) on gloo ranks against the same flags in one process."""
    model = _without(flags(data, *model_extra, layers=layers), "--micro-batch-size")
    doc, _ = _plan(tmp_path, name, "--world-size", str(world), "--gpus-per-node", "4", "--gpu", "h100-80gb", *fixed,
                   *model)
    best = doc["plans"][0]
    for flag, value in zip(fixed[::2], fixed[1::2]):
        assert best[flag.lstrip("-")] == int(value), (flag, best)
    assert best["dp"] * best["tp"] * best["cp"] * best["pp"] == world
    args = best["args"]
    assert args[:len(model)] == model  # the user's flags, then the layout's
    if layers % best["pp"]:
        assert "--decoder-first-pipeline-num-layers" in args and "--decoder-last-pipeline-num-layers" in args
    got = launch(world, args, tmp_path, f"plan_{name}")
    ref = launch(1, model + ["--micro-batch-size", str(best["micro_batch_size"])], tmp_path, f"one_{name}")
    assert got and set(got) == set(ref)
    assert_same_run(got, ref, what=f"the planned layout tp {best['tp']} cp {best['cp']} pp {best['pp']} "
                                   f"ep {best['ep']} dp {best['dp']}, ZeRO-{best['zero_stage']}")
