"""Every path into a run selects the process's GPU: a group started here, or one that already existed.

No GPU is needed: ``torch.cuda`` reports 4 devices and records ``set_device``; no NCCL group is made.
The already-existing group is the test pool's gloo group, one process per rank with LOCAL_RANK set.
"""

import contextlib
import os
from unittest import mock

import torch
import torch.distributed as dist

from megazero import mpu
from megazero.mpu import distributed
from megazero.mpu.distributed import LOCAL_RANK_VARIABLES
from tests.distributed import run_distributed


@contextlib.contextmanager
def _fake_cuda(device_count: int = 4):
    """``torch.cuda`` with ``device_count`` devices; yields the list of devices passed to ``set_device``."""
    selected: list[int] = []
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=device_count), \
            mock.patch.object(torch.cuda, "set_device", side_effect=selected.append), \
            mock.patch.object(torch.cuda, "current_device", side_effect=lambda: selected[-1] if selected else 0):
        yield selected


def _existing_group_paths() -> dict:
    local_rank = int(os.environ["LOCAL_RANK"])
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    out = {"local_rank": local_rank}
    with _fake_cuda() as selected:
        out["init_nccl"] = (distributed.init_distributed("nccl"), list(selected))
    # distributed_run() as pretrain_gpt and generate call it, inside a group whose backend is NCCL.
    with _fake_cuda() as selected, mock.patch.object(dist, "get_backend", return_value="nccl"):
        with mpu.distributed_run() as rank_world:
            out["run"] = (rank_world, list(selected))
    with _fake_cuda() as selected:  # the gloo group as it is: a CPU run selects nothing
        out["init_default"] = (distributed.init_distributed(), list(selected))
    with _fake_cuda() as selected, mock.patch.dict(os.environ, {name: "" for name in LOCAL_RANK_VARIABLES}):
        # No launcher variable: whoever started the group chose the device; it is kept.
        out["no_launcher"] = (distributed.select_device("nccl", group_exists=True), list(selected))
    return out


def test_existing_group_selects_each_ranks_local_device():
    for rank, out in enumerate(run_distributed(2, _existing_group_paths)):
        assert out["local_rank"] == rank
        assert out["init_nccl"] == ((rank, 2), [rank])
        assert out["run"] == ((rank, 2), [rank])
        assert out["init_default"] == ((rank, 2), [])
        assert out["no_launcher"] == (0, [])


def test_group_started_here_selects_the_device_before_the_group(monkeypatch):
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    for name in launcher + LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with _fake_cuda() as selected:
        inits: list = []
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: inits.append((backend, list(selected))))
        monkeypatch.setattr(dist, "get_rank", lambda: 3)
        monkeypatch.setattr(dist, "get_world_size", lambda: 4)
        assert distributed.init_distributed("nccl") == (3, 4)
    assert inits == [("nccl", [3])]  # the device was selected before the group was made


def test_no_device_selected_without_cuda_or_nccl(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with _fake_cuda() as selected:
        assert distributed.select_device("gloo") is None
        assert distributed.select_device(None) is None
        assert distributed.select_device("cpu:gloo,cuda:nccl") == 1
    assert selected == [1]
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(torch.cuda, "set_device", side_effect=AssertionError("set_device on CPU")):
        assert distributed.select_device("nccl") is None
