"""pretrain_gpt.py --optimizer lion (an optimizer added as one file and its registration) at pp 1 and pp 2,
and from a DeepSpeed "Lion" block, equals the one-process run of the same flags; a checkpoint resumes at
another layout. No biases: the key bias's gradient is rounding noise, and Lion keeps only its sign."""

from __future__ import annotations

import json

import pytest

from tests.training.test_layout_invariance import (assert_resumes_elsewhere, assert_same_run, data, flags,  # noqa: F401
                                                   launch)

LION = ("--optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99", "--weight-decay", "0.1",
        "--disable-bias-linear")


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *LION), tmp_path_factory.mktemp("lion1"), "lion1")


@pytest.mark.parametrize("world,extra", [
    (2, ["--zero-stage", "3"]),
    (2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
])
def test_lion_equals_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    got = launch(world, flags(data, *LION, *extra), tmp_path, "lion")
    assert_same_run(got, one_process, what=f"lion at world {world} {extra}")
    losses = [one_process[i]["lm_loss"] for i in sorted(one_process)]
    assert losses[0] - losses[-1] > 0.05, losses  # it trains


def test_deepspeed_lion_block_equals_the_flags(data, one_process, tmp_path):  # noqa: F811
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "Lion", "params": {"betas": [0.9, 0.99], "weight_decay": 0.1}}}))
    plain = [f for f in flags(data, "--weight-decay", "0.1", "--disable-bias-linear")]
    got = launch(2, [*plain, "--tp", "2", "--deepspeed_config", str(ds)], tmp_path, "lion_ds")
    assert_same_run(got, one_process, what="Lion from the DeepSpeed JSON at tp 2")


def test_lion_resumes_at_another_layout(data, one_process, tmp_path):  # noqa: F811
    assert_resumes_elsewhere(data, [*LION], (2, ["--zero-stage", "3"]),
                             [(2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"])], one_process,
                             tmp_path, "lion")
