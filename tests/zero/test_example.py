"""examples/zero_with_tp/train.py: tp=2 x dp=2 ZeRO-3 trains, and matches DeepSpeed when it is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import launch

EXAMPLE = "examples/zero_with_tp/train.py"


def run_example(tmp_path: Path, engine: str, steps: int = 10) -> dict:
    """``torchrun --nproc_per_node 4 examples/zero_with_tp/train.py --engine ENGINE`` as its README gives it."""
    out = tmp_path / f"{engine}.json"
    launch(4, ["--engine", engine, "--steps", str(steps), "--json", str(out)], script=EXAMPLE,
           env={"DS_ACCELERATOR": "cpu"}, timeout_s=600).check(f"the example with --engine {engine}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return run_example(tmp_path_factory.mktemp("example"), "megazero")


def test_megazero_tp2_dp2_zero3_trains(ours):
    res = ours
    losses = res["losses"]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 0.2, losses
    states = res["model_state_bytes"]
    # ZeRO-3 in fp32: parameter and gradient partitions of equal size, Adam's two moments twice that.
    for s in states:
        assert s["optimizer"] == 2 * s["params"] == 2 * s["grads"]
    # Per step: parameters gathered twice (forward and backward) and gradients reduce-scattered once,
    # all within the DP group; the TP group carries only activations. Units are gathered only while
    # used: the tied embedding once more for the output layer, the position table not in backward
    # (its gradient needs only the ids): 2 x 961,024 + (256 x 128 embedding rows of this TP rank
    # - 64 x 128 positions) x 4 B.
    t = res["traffic"]
    assert t["all_gather/dp"] == 2 * t["reduce_scatter/dp"] + (256 * 128 - 64 * 128) * 4 > 0
    assert t["all_reduce/tp"] > 0


def test_deepspeed_matches_megazero(tmp_path, ours):
    """DeepSpeed's ZeRO-3 on the same model and data: its 5 steps equal megazero's first 5."""
    pytest.importorskip("deepspeed")
    theirs = run_example(tmp_path, "deepspeed", steps=5)
    assert len(theirs["losses"]) == 5
    for a, b in zip(ours["losses"], theirs["losses"]):
        assert abs(a - b) < 1e-5, (ours["losses"], theirs["losses"])
    for a, b in zip(ours["grad_norms"], theirs["grad_norms"]):
        assert abs(a - b) < 1e-5 * max(1.0, a), (ours["grad_norms"], theirs["grad_norms"])
