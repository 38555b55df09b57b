"""Which GPU a process takes: the launcher's local rank, never a silent GPU 0 for every rank."""

import os

import pytest

from megazero.mpu import distributed
from megazero.mpu.distributed import LOCAL_RANK_VARIABLES, resolve_local_rank


@pytest.mark.parametrize("name", LOCAL_RANK_VARIABLES)
def test_local_rank_comes_from_any_launcher_variable(name):
    assert resolve_local_rank({"RANK": "5", "WORLD_SIZE": "8", name: "3"}, device_count=4) == 3


def test_torchrun_variable_wins_over_the_others():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert resolve_local_rank(env, device_count=2) == 1


def test_rank_only_on_several_gpus_is_refused_naming_local_rank():
    with pytest.raises(RuntimeError, match="set LOCAL_RANK"):
        resolve_local_rank({"RANK": "3", "WORLD_SIZE": "8"}, device_count=8)


@pytest.mark.parametrize("env,count", [
    ({"RANK": "3", "WORLD_SIZE": "8"}, 1),  # one visible device: it is this process's
    ({"RANK": "3", "WORLD_SIZE": "8", "SLURM_LOCALID": "3"}, 1),  # a GPU per task via CUDA_VISIBLE_DEVICES
    ({}, 8),  # `python pretrain_gpt.py` on a multi-GPU machine: one process, device 0
    ({"RANK": "0", "WORLD_SIZE": "1"}, 8),
    ({"RANK": "0", "WORLD_SIZE": "1"}, 0),
])
def test_device_zero_where_it_is_right(env, count):
    assert resolve_local_rank(env, device_count=count) == 0


@pytest.mark.parametrize("value,match", [("4", "only 4 GPUs are visible"), ("x", "not an integer")])
def test_bad_local_rank_is_refused(value, match):
    with pytest.raises(RuntimeError, match=match):
        resolve_local_rank({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": value}, device_count=4)


def test_srun_without_a_local_id_no_longer_defaults_to_zero(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") + LOCAL_RANK_VARIABLES:
        monkeypatch.setenv(k, "")  # recorded, so that what export_slurm_env writes is undone after the test
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    distributed.export_slurm_env()
    assert os.environ["RANK"] == "2" and "LOCAL_RANK" not in os.environ
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        resolve_local_rank(os.environ, device_count=4)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.delenv("RANK")
    distributed.export_slurm_env()
    assert os.environ["LOCAL_RANK"] == "1" and resolve_local_rank(os.environ, device_count=4) == 1


def test_pretrain_gpt_under_plain_srun_checks_the_slurm_world_size(monkeypatch, capsys):
    """``srun pretrain_gpt.py`` (no torchrun): the parser sees SLURM's 4 tasks, not a world of 1."""
    from megazero.cli.pretrain_gpt import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") + LOCAL_RANK_VARIABLES:
        monkeypatch.setenv(k, "")  # recorded, so that what export_slurm_env writes is undone after the test
        monkeypatch.delenv(k)
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODELIST": "n[1-2]"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_:
        main(["--tp", "3", "--mock-data", "--num-layers", "2", "--hidden-size", "24", "--num-attention-heads", "3",
              "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--vocab-size", "64"])
    assert exit_.value.code == 2
    assert "world size 4 is not divisible" in capsys.readouterr().err
