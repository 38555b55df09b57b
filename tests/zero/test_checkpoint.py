"""Sharded ZeRO checkpoints: exact resume, and resharding across tp x dp x stage."""

import os

import pytest
import torch
import torch.distributed as dist

from megazero import mpu, zero
from megazero.model import GPTModel
from megazero.zero.checkpoint import CheckpointError, load_zero_state, read_full_parameters, save_zero_state
from tests.distributed import run_distributed
from tests.zero.common import GLOBAL_MICRO_ROWS, SEED, batches, ds_config, tiny_config

STEPS_BEFORE, STEPS_AFTER = 3, 2


def _train(engine, data, steps):
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    micro = GLOBAL_MICRO_ROWS // dp
    losses = []
    for step in steps:
        rows = data[step, 0, dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(float(total) / dp)
    return losses


def _engine(tp, stage, seed=SEED):
    mpu.initialize_model_parallel(tp)
    torch.manual_seed(seed)
    micro = GLOBAL_MICRO_ROWS // mpu.get_data_parallel_world_size()
    return zero.initialize(GPTModel(tiny_config(), device="meta"), ds_config(stage, micro=micro), mpu=mpu)


def _save(tp, stage, directory):
    engine = _engine(tp, stage)
    data = batches(STEPS_BEFORE + STEPS_AFTER, 1, GLOBAL_MICRO_ROWS)
    _train(engine, data, range(STEPS_BEFORE))
    save_zero_state(engine, directory)
    dist.barrier()
    after = _train(engine, data, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return after, engine.consolidated_state_dict()


def _load(tp, stage, directory):
    engine = _engine(tp, stage, seed=SEED + 1)  # different init: everything must come from the checkpoint
    load_zero_state(engine, directory)
    data = batches(STEPS_BEFORE + STEPS_AFTER, 1, GLOBAL_MICRO_ROWS)
    after = _train(engine, data, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return after, engine.consolidated_state_dict(), engine.global_steps


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt_tp2_dp2_z3"))
    after, sd = run_distributed(4, _save, 2, 3, directory)[0]
    return directory, after, sd


@pytest.mark.parametrize("world,tp,stage", [(4, 2, 3), (4, 1, 1), (4, 4, 2), (4, 1, 0), (1, 1, 3), (2, 2, 0)])
def test_resume_and_reshard(saved, world, tp, stage):
    directory, expected_losses, expected_sd = saved
    losses, sd, steps = run_distributed(world, _load, tp, stage, directory)[0]
    assert steps == STEPS_BEFORE + STEPS_AFTER
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), atol=1e-5, rtol=1e-5)
    for k in expected_sd:
        torch.testing.assert_close(sd[k], expected_sd[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_full_parameters_for_export(saved):
    directory, _, _ = saved
    full = read_full_parameters(directory)
    torch.manual_seed(SEED)
    ref = GPTModel(tiny_config())
    assert set(full) == {n for n, _ in ref.named_parameters()}
    for n, p in ref.named_parameters():
        assert full[n].shape == p.shape, n


def test_truncated_or_foreign_shard_is_refused(saved, tmp_path):
    directory, _, _ = saved
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(directory):
        data = open(os.path.join(directory, f), "rb").read()
        (bad / f).write_bytes(data[: len(data) // 2] if f.endswith("00001.safetensors") else data)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_full_parameters(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="not a megazero checkpoint"):
        read_full_parameters(str(empty))
