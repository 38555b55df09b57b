"""pretrain_gpt.py --optimizer muon at several layouts (ZeRO 0-3, the distributed optimizer, TP with SP, PP,
CP, EP, gradient accumulation, clipping), compared with the one-process run of the same flags: loss and grad
norm per iteration within 2e-5 (fp32 Newton-Schulz, QKV split, dropout 0); a checkpoint resumes at another
layout; switching from AdamW takes --no-load-optim; and Muon's flags are refused where they cannot work."""

from __future__ import annotations

import pytest

from megazero.config.arguments import parse_args
from megazero.config.train_config import ConfigError
from tests.training.test_layout_invariance import (assert_resumes_elsewhere, assert_same_run, data, flags,  # noqa: F401
                                                   launch)
from tests.training.test_deepseek_training import DEEPSEEK, KEYS
from tests.training.test_moe_training import MOE

MUON = ("--optimizer", "muon", "--muon-nesterov", "--muon-extra-scale-factor", "0.2", "--weight-decay", "0.1")


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *MUON), tmp_path_factory.mktemp("muon1"), "muon1")


@pytest.fixture(scope="module")
def one_process_moe(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *MUON, *MOE), tmp_path_factory.mktemp("muon1_moe"), "muon1_moe")


@pytest.mark.parametrize("world,extra", [
    (2, ["--zero-stage", "0"]),  # plain DP: each rank orthogonalises its own matrices, all-gathers the rest
    (4, ["--tp", "2", "--sequence-parallel", "--use-distributed-optimizer"]),  # ZeRO-1, whole matrices over TP
    (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "2"]),
    (4, ["--zero-stage", "3"]),
    (4, ["--context-parallel-size", "2", "--zero-stage", "1"]),
    # Newton-Schulz on the TP blocks together: Gram matrices summed over TP, nothing gathered
    (2, ["--tp", "2", "--muon-tp-mode", "distributed"]),
    (4, ["--tp", "2", "--sequence-parallel", "--muon-tp-mode", "distributed", "--zero-stage", "3"]),
])
def test_muon_equals_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    got = launch(world, flags(data, *MUON, *extra), tmp_path, "muon")
    assert_same_run(got, one_process, what=f"muon at world {world} {extra}")
    losses = [one_process[i]["lm_loss"] for i in sorted(one_process)]
    assert losses[0] - losses[-1] > 0.05, losses  # it trains


@pytest.fixture(scope="module")
def one_process_swiglu(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *MUON, "--swiglu"), tmp_path_factory.mktemp("swiglu_ref"), "swiglu_ref")


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_swiglu_blocks_over_tp_equal_one_process(data, one_process_swiglu, tmp_path, mode):  # noqa: F811
    """SwiGLU's fc1 holds [gate; up] blocks on each TP rank (partition stride 2)."""
    ref = one_process_swiglu
    got = launch(2, flags(data, *MUON, "--swiglu", "--tp", "2", "--muon-tp-mode", mode), tmp_path, "swiglu_tp2")
    assert_same_run(got, ref, what=f"swiglu at tp 2, {mode}")


@pytest.mark.parametrize("name,precision,world,layout,rtol", [
    ("bf16", ["--bf16"], 4, ["--tp", "2", "--use-distributed-optimizer"], 2e-2),
    # a loss scale of 2^20 overflows: iterations 1-3 are skipped (no update, the momentum untouched)
    ("fp16", ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1"], 2,
     ["--pipeline-model-parallel-size", "2"], 1e-3),
])
def test_muon_in_half_precision_equals_one_process(data, tmp_path, name, precision, world, layout,  # noqa: F811
                                                   rtol):
    ref = launch(1, flags(data, *MUON, *precision, iters=8), tmp_path, f"{name}_ref")
    got = launch(world, flags(data, *MUON, *precision, *layout, iters=8), tmp_path, name)
    assert_same_run(got, ref, rtol=rtol, what=f"muon {name}")
    if name == "fp16":
        assert min(ref) == 4 and ref[4]["loss_scale"] == 131072, ref  # three skipped steps, then updates


@pytest.mark.parametrize("world,extra", [
    (2, ["--expert-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size",
         "1", "--zero-stage", "2"]),
])
def test_muon_with_experts_equals_one_process(data, one_process_moe, tmp_path, world, extra):  # noqa: F811
    got = launch(world, flags(data, *MUON, *MOE, *extra), tmp_path, "muon_moe")
    assert_same_run(got, one_process_moe, what=f"muon with experts at world {world} {extra}")


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_muon_with_expert_tensor_parallel_equals_one_process(data, one_process_moe, tmp_path, mode):  # noqa: F811
    """Experts sharded over an expert TP group of their own: the owners gather them (or sum their Gram
    matrices) over it."""
    got = launch(4, flags(data, *MUON, *MOE, "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size",
                          "2", "--zero-stage", "3", "--muon-tp-mode", mode), tmp_path, "muon_etp")
    assert_same_run(got, one_process_moe, what=f"muon with expert TP 2, {mode}")


@pytest.fixture(scope="module")
def one_process_deepseek(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *MUON, *DEEPSEEK), tmp_path_factory.mktemp("muon1_dsv3"), "muon1_dsv3")


@pytest.mark.parametrize("world,extra", [
    (4, ["--tp", "2", "--sequence-parallel", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
         "1", "--use-distributed-optimizer"]),
    (4, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--zero-stage", "3"]),
])
def test_muon_on_the_deepseek_shape_equals_one_process(data, one_process_deepseek, tmp_path, world,  # noqa: F811
                                                       extra):
    """Multi-latent attention's down and up projections, the MTP layer's, the routers and the experts."""
    got = launch(world, flags(data, *MUON, *DEEPSEEK, *extra), tmp_path, "muon_dsv3")
    for it, ref in one_process_deepseek.items():
        for key in KEYS:
            a, b = got[it][key], ref[key]
            assert abs(a - b) <= 2e-5 * abs(b), f"world {world} {extra}: iteration {it} {key} {a} vs {b}"


def test_blockwise_depends_on_the_tp_size(data, one_process, tmp_path):  # noqa: F811
    """--muon-tp-mode blockwise orthogonalises each TP shard: at tp 1 it is the duplicated run, at tp 2
    another one (Megatron's documented layout dependence)."""
    same = launch(1, flags(data, *MUON, "--muon-tp-mode", "blockwise"), tmp_path, "blockwise1")
    assert_same_run(same, one_process, what="blockwise at tp 1")
    other = launch(2, flags(data, *MUON, "--muon-tp-mode", "blockwise", "--tp", "2"), tmp_path, "blockwise2")
    assert abs(other[4]["lm_loss"] - one_process[4]["lm_loss"]) > 1e-4


@pytest.mark.parametrize("fmt", ["megazero", "torch_dist"])
def test_muon_resumes_at_another_layout(data, one_process, tmp_path, fmt):  # noqa: F811
    assert_resumes_elsewhere(data, [*MUON, "--ckpt-format", fmt], (4, ["--tp", "2", "--use-distributed-optimizer"]),
                             [(2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "3"])],
                             one_process, tmp_path, f"muon_{fmt}")


def test_switching_from_adamw_to_muon_takes_no_load_optim(data, tmp_path):  # noqa: F811
    saved = str(tmp_path / "adamw")
    launch(1, flags(data, "--save", saved, "--save-interval", "2"), tmp_path, "adamw")
    with pytest.raises(AssertionError, match="holds optimizer state.*switch optimizers with --no-load-optim"):
        launch(1, flags(data, *MUON, "--load", saved, "--ckpt-step", "2"), tmp_path, "muon_refused")
    got = launch(1, flags(data, *MUON, "--load", saved, "--ckpt-step", "2", "--no-load-optim"), tmp_path,
                 "muon_switched")
    assert sorted(got) == [3, 4]


@pytest.mark.parametrize("extra,message", [
    (["--muon-momentum", "0.9"], "--muon-momentum needs --optimizer muon"),
    (["--optimizer", "muon", "--optimizer-cpu-offload", "--zero-stage", "1"], "drop --optimizer-cpu-offload"),
    (["--optimizer", "muon", "--muon-momentum", "1.2"], "momentum must be in"),
    (["--optimizer", "muon", "--muon-tp-mode", "sideways"], "invalid choice: 'sideways'"),
    (["--optimizer", "muon", "--muon-scale-mode", "huge"], "invalid choice: 'huge'"),
])
def test_muon_refusals(data, extra, message, capsys):  # noqa: F811
    with pytest.raises((ConfigError, SystemExit)) as info:
        parse_args(flags(data, *extra), 1)
    assert message in str(info.value) + capsys.readouterr().err
