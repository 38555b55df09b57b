"""Logging flags: Megatron's TensorBoard tags, params norm / zeros / optimizer states counted once over
tp x dp, the wall-clock breakdown in the log line, DeepSpeed's csv_monitor, and wandb's clear error."""

import glob
import json
import math
import os

import pytest
import torch

from megazero.config import ConfigError, LoggingConfig, parse_args
from megazero.training.meters import megatron_scalars
from tests.distributed import run_distributed

# --make-vocab-size-divisible-by 1: 100 rows at tp 1, 2 and 4 alike (Megatron pads to divisible_by x tp),
# so every layout holds the same parameters.
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --lr 1e-2 --mock-data --vocab-size 100 --make-vocab-size-divisible-by 1 "
        "--hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights --eval-iters 1").split()


def _stats(args, world):
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from megazero.training.norms import count_zeros_in_grads, params_norm
    from megazero.training.trainer import megatron_no_weight_decay

    cfg = parse_args(args, world)
    groups = mpu.initialize_model_parallel(cfg.parallel.tp)
    mpu.model_parallel_manual_seed(cfg.seed)
    engine = zero.initialize(GPTModel(cfg.model, device="meta"), cfg.zero_config(), mpu=mpu,
                             no_weight_decay=megatron_no_weight_decay, device=torch.device("cpu"))
    full = engine.consolidated_state_dict(rank0_only=False)
    reference = math.sqrt(sum(float(t.double().pow(2).sum()) for t in full.values()))
    before = params_norm(engine, groups)
    zeros = count_zeros_in_grads(engine, groups)
    # the same global batch on every layout: tokens 0..39 only, so embedding rows 40..99 get no gradient
    tokens = torch.arange(cfg.schedule.global_batch_size * 17).remainder(40).view(-1, 17)
    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = tokens.view(dp, -1, 17)[rank]
    for micro in mine.split(cfg.schedule.micro_batch_size):
        loss = engine(micro[:, :-1], labels=micro[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
    return before, reference, float(zeros.zeros), params_norm(engine, groups)


@pytest.fixture(scope="module")
def plain_dp():
    """The same numbers without any partitioning: tp 1, ZeRO-0 (each rank holds everything)."""
    return run_distributed(4, _stats, TINY + "--train-iters 1 --global-batch-size 8 --tp 1 --zero-stage 0".split(),
                           4)[0]


@pytest.mark.parametrize("layout", ["--tp 2 --zero-stage 3", "--tp 4 --zero-stage 1"])
def test_params_norm_and_zeros_count_each_element_once(layout, plain_dp):
    args = TINY + "--train-iters 1 --global-batch-size 8".split() + layout.split()
    before, reference, zeros, after = run_distributed(4, _stats, args, 4)[0]
    assert before == pytest.approx(reference, rel=1e-9)  # vs the consolidated tp=1 state dict
    # the input embedding's unused rows (60 of 100, x hidden 32) have zero gradient
    assert zeros >= 60 * 32
    assert before == pytest.approx(plain_dp[0], rel=1e-9)
    # The same zeros, up to gradients whose DP/TP sums cancel exactly in one summation order only.
    assert abs(zeros - plain_dp[2]) <= 2, (zeros, plain_dp[2])
    assert plain_dp[0] == pytest.approx(plain_dp[1], rel=1e-9)
    assert after == pytest.approx(plain_dp[3], rel=1e-6)


def test_megatron_tag_names_are_gated_by_their_flags():
    record = {"lr": 1e-3, "lm_loss": 2.0, "loss_scale": 1.0, "grad_norm": 0.5, "global_batch_size": 8,
              "consumed_samples": 80, "eval_ppl": 7.0, "fwd_ms": 3.0, "elapsed_ms_per_iteration": 20.0,
              "memory_mb": 1.0, "optimizer/momentum_l2": 0.1, "tflops_per_rank": 0.5, "tokens_per_s": 900.0,
              "mfu": 0.4, "moe_aux_loss": 0.02, "expert_load_max_over_mean": 1.5}
    tags = {t for t, _, _ in megatron_scalars(record, LoggingConfig())}
    assert tags == {"learning-rate", "learning-rate vs samples", "lm loss", "lm loss vs samples", "loss-scale",
                    "loss-scale vs samples", "grad-norm", "grad-norm vs samples", "moe aux loss",
                    "expert load max over mean"}
    on = LoggingConfig(log_batch_size_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
                       log_timers_to_tensorboard=True, log_memory_to_tensorboard=True,
                       log_optimizer_states_to_tensorboard=True, log_throughput=True)
    scalars = {t: (v, axis) for t, v, axis in megatron_scalars(record, on)}
    assert scalars["batch-size vs samples"] == (8.0, "samples") and scalars["iteration-time"] == (0.02, "iteration")
    assert scalars["tokens-per-second"] == (900.0, "iteration") and scalars["mfu"] == (0.4, "iteration")
    for tag in ("lm loss validation ppl", "forward-compute-time", "mem-max-allocated-bytes", "throughput",
                "optimizer/momentum_l2"):
        assert tag in scalars


def _run(args, world):
    from megazero.training.trainer import pretrain

    return pretrain(parse_args(args, world)).iteration


def test_breakdown_csv_and_tensorboard_from_the_json(tmp_path, capfd):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"wall_clock_breakdown": True,
                              "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"},
                              "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}))
    args = TINY + ["--train-iters", "2", "--log-interval", "1", "--deepspeed_config", str(ds), "--log-params-norm",
                   "--log-timers-to-tensorboard", "--log-optimizer-states-to-tensorboard"]
    assert run_distributed(2, _run, args, 2)[0] == 2
    assert {"lm_loss.csv", "lr.csv", "fwd_ms.csv"} <= {os.path.basename(p) for p in glob.glob(str(tmp_path / "csv" / "*.csv"))}
    lines = open(tmp_path / "csv" / "lm_loss.csv").read().splitlines()
    assert lines[0] == "step,value" and [line.split(",")[0] for line in lines[1:]] == ["1", "2"]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "params-norm", "forward-compute-time",
            "optimizer/momentum_l2"} <= tags


def test_wandb_missing_is_a_clear_error():
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="needs the wandb package, which is not installed: pip install wandb"):
        parse_args(TINY + "--train-iters 1 --wandb-project p".split(), 1)


def test_wandb_writes_under_save_not_under_tensorboard(tmp_path, monkeypatch):
    # Megatron's default --wandb-save-dir is {save}/wandb; the run's TensorBoard directory holds event files only
    import sys
    import types

    from megazero.training.meters import MetricsWriter

    started = []
    fake = types.SimpleNamespace(init=lambda **kw: started.append(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    base = TINY + f"--train-iters 1 --wandb-project p --tensorboard-dir {tmp_path / 'tb'}".split()
    for extra, expected in (([], None), (["--save", str(tmp_path / "ck")], tmp_path / "ck" / "wandb"),
                            (["--save", str(tmp_path / "ck"), "--wandb-save-dir", str(tmp_path / "w")], tmp_path / "w")):
        options = parse_args(base + extra, 1, check_files=False).logging  # (the fake module has no import spec)
        MetricsWriter(None, options.tensorboard_dir, options=options).close()
        assert started.pop()["dir"] == (None if expected is None else str(expected))
