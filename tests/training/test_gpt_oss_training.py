"""gpt-oss's MLP through pretrain_gpt.py: --quick-geglu --glu-linear-offset --activation-func-clamp-value with
biases on every linear (Megatron's default), in dense MLPs, routed and shared experts, at tp 2 x ep 2 (sequence
parallel), pp 2, whole experts under tp 2 and grouped matmuls, against the one-process run: losses and grad
norms within 2e-5 (fp32, dropout 0) from bit-identical initial weights; the flags reach GPTConfig, and the
combinations Megatron would assert on or ignore are refused at parse time with the fix."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ConfigError, parse_args
from tests.training.test_layout_invariance import assert_same_run, data, flags, launch  # noqa: F401

# --init-method-std 0.2 puts some of fc1's outputs past a clamp of 0.5, so the clamp bites in every layout; gpt-oss's
# clamp of 7.0 would not bite at these weights (its run equals the unclamped one: the second test's first run).
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "2",
       "--moe-shared-expert-intermediate-size", "32", "--moe-router-load-balancing-type", "none", "--quick-geglu",
       "--init-method-std", "0.2")
OFFSET, CLAMP = ("--glu-linear-offset", "1.0"), ("--activation-func-clamp-value", "0.5")
TINY = "--model-preset gpt-tiny --micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data".split()


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("gpt_oss1")
    return launch(1, flags(data, *MOE, *OFFSET, *CLAMP, "--save", str(out / "ckpt"), "--save-interval", "1"), out,
                  "gpt_oss1"), out


@pytest.mark.slow  # whole launches
@pytest.mark.parametrize("world,extra", [
    (4, ["--tp", "2", "--expert-model-parallel-size", "2", "--sequence-parallel"]),
    (2, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2"]),
    (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm"]),
])
def test_gpt_oss_mlp_equals_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    from megazero.checkpoint.native import load_full_model

    ref, ref_dir = one_process
    save = ("--save", str(tmp_path / "ckpt"), "--save-interval", "1")
    got = launch(world, flags(data, *MOE, *OFFSET, *CLAMP, *extra, *save), tmp_path, "gpt_oss")
    assert_same_run(got, ref, what=f"gpt-oss MLP world {world} {extra}")
    # the first step runs at lr 0 (warmup from 0): iteration 1's checkpoint holds the initial weights
    _, w, _ = load_full_model(str(tmp_path / "ckpt"), 1)
    _, want, _ = load_full_model(str(ref_dir / "ckpt"), 1)
    assert sorted(w) == sorted(want)
    for k in want:
        assert torch.equal(w[k], want[k]), f"{k} differs from one process at initialization"
    assert any(k.endswith("experts.3.linear_fc2.bias") for k in want) and any(".shared_experts." in k for k in want)


@pytest.mark.slow  # two one-process launches
def test_the_clamp_and_the_offset_change_the_run(data, one_process, tmp_path):  # noqa: F811
    ref, _ = one_process
    for name, change in (("clamp7", (*OFFSET, "--activation-func-clamp-value", "7.0")), ("no_offset", CLAMP)):
        got = launch(1, flags(data, *MOE, *change), tmp_path, name)
        assert abs(got[1]["lm_loss"] - ref[1]["lm_loss"]) > 1e-4, (name, got[1]["lm_loss"], ref[1]["lm_loss"])


def _parse(extra: str):
    return parse_args(TINY + extra.split(), 1)


def test_the_flags_reach_the_model():
    m = _parse("--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --num-experts 4").model
    assert (m.activation, m.glu_linear_offset, m.activation_func_clamp_value, m.gated_linear_unit) == \
        ("quick_geglu", 1.0, 7.0, True)
    assert m.ffn_size == 4 * m.hidden_size  # Megatron shrinks the FFN for --swiglu only
    assert m.add_bias_linear and not m.moe_router_bias  # the router's learned bias has no Megatron flag
    d = _parse("--swiglu --activation-func-clamp-value 10").model  # DeepSeek-V4's and GLM's clamped SwiGLU
    assert (d.activation, d.glu_linear_offset, d.activation_func_clamp_value) == ("swiglu", 0.0, 10.0)
    plain = _parse("").model
    assert (plain.activation, plain.glu_linear_offset, plain.activation_func_clamp_value) == ("gelu", 0.0, None)


@pytest.mark.parametrize("extra,message", [
    ("--quick-geglu --swiglu", r"--swiglu and --quick-geglu are different MLP activations; pass one"),
    ("--quick-geglu --squared-relu", r"--squared-relu and --quick-geglu are different MLP activations"),
    ("--glu-linear-offset 1", r"--glu-linear-offset 1 applies to a gated MLP, not to gelu: add --quick-geglu "
                              r"\(gpt-oss's\) or --swiglu, or drop it"),
    ("--squared-relu --activation-func-clamp-value 7 --glu-linear-offset 1",
     r"--glu-linear-offset 1 and --activation-func-clamp-value 7 apply to a gated MLP, not to --squared-relu"),
    ("--quick-geglu --activation-func-clamp-value -1", r"--activation-func-clamp-value -1 must be > 0"),
    ("--openai-gelu", r"--openai-gelu: .*drop the flag"),
])
def test_bad_combinations_are_refused_with_the_fix(extra, message):
    with pytest.raises(ConfigError, match=message):
        _parse(extra)
