"""Mixed precision: fp16 dynamic loss scaling (DeepSpeed semantics) and bf16 training."""

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTModel
from megazero.zero.config import FP16Config
from megazero.zero.loss_scaler import LossScaler
from tests.distributed import run_distributed
from tests.zero.common import SEED, batches, ds_config, tiny_config


def _fp16_overflow(stage, hysteresis):
    mpu.initialize_model_parallel(2)
    torch.manual_seed(SEED)
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100, "hysteresis": hysteresis, "min_loss_scale": 1}
    engine = zero.initialize(GPTModel(tiny_config()), ds_config(stage, fp16=fp16), mpu=mpu)
    rows = batches(1, 1, 4)[0, 0][mpu.get_data_parallel_rank() * 2:][:2]
    scales, updated, weights = [], [], []
    for inject in (False, True, True):
        before = engine.consolidated_state_dict(rank0_only=False)
        loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
        if inject:
            loss = loss * float("inf")  # every gradient becomes inf/nan
        engine.backward(loss)
        updated.append(engine.step())
        after = engine.consolidated_state_dict(rank0_only=False)
        weights.append(all(torch.equal(before[k], after[k]) for k in before))
        scales.append(engine.get_loss_scale())
    return updated, weights, scales, engine.skipped_steps, loss.dtype


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_step_and_backs_off(stage):
    updated, unchanged, scales, skipped, _ = run_distributed(4, _fp16_overflow, stage, 1)[0]
    assert updated == [True, False, False] and skipped == 2
    assert unchanged == [False, True, True], "a skipped step must leave the weights untouched"
    assert scales == [256.0, 128.0, 64.0]  # hysteresis 1: halve on every overflow


def test_fp16_hysteresis_delays_the_backoff():
    updated, unchanged, scales, skipped, _ = run_distributed(4, _fp16_overflow, 2, 2)[0]
    assert updated == [True, False, False] and unchanged == [False, True, True]
    assert scales == [256.0, 256.0, 128.0]  # first overflow spends the hysteresis, second halves


def test_loss_scaler_grows_after_a_clean_window():
    s = LossScaler(FP16Config(initial_scale_power=4, loss_scale_window=3, hysteresis=1))
    seen = []
    for overflow in [False, False, False, True, False, False, False]:
        s.update(overflow)
        seen.append(s.scale)
    assert seen == [16.0, 16.0, 32.0, 16.0, 16.0, 16.0, 32.0]


def _bf16_trains(stage):
    mpu.initialize_model_parallel(2)
    torch.manual_seed(SEED)
    cfg = ds_config(stage, bf16={"enabled": True})
    cfg["optimizer"]["params"]["lr"] = 1e-2
    engine = zero.initialize(GPTModel(tiny_config()), cfg, mpu=mpu)
    rows = batches(1, 1, 4)[0, 0][mpu.get_data_parallel_rank() * 2:][:2]
    losses = []
    for _ in range(15):
        loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    dtypes = {p.dtype for p in engine.module.parameters()}
    masters = {g.master.dtype for g in engine.groups}
    return losses, dtypes, masters


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_trains_with_fp32_masters(stage):
    losses, dtypes, masters = run_distributed(4, _bf16_trains, stage)[0]
    assert dtypes == {torch.bfloat16} and masters == {torch.float32}
    assert losses[-1] < losses[0] - 1.0, losses
