"""Start torch.distributed from torchrun's (or SLURM's) environment, on any device."""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "default_backend", "first_slurm_host"]


def default_backend() -> str:
    """NCCL when CUDA devices exist, gloo otherwise (CPU training and tests)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _env_from_slurm() -> None:
    # Under `srun` without torchrun, translate SLURM's variables to torchrun's names.
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST", os.environ.get("SLURM_NODELIST", "127.0.0.1"))
        os.environ["MASTER_ADDR"] = first_slurm_host(nodelist)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[007-010,012],cpu1`` -> ``gpu007``."""
    head, bracket, rest = nodelist.partition("[")
    if not bracket or "," in head:
        return head.split(",")[0]
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return head + first


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialize the default process group once; return ``(rank, world_size)``.

    Without a launcher (no RANK/WORLD_SIZE), it starts a single-process group so
    that `python pretrain_gpt.py` works on one device.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    _env_from_slurm()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # After `torchrun --max-restarts` restarts the workers, the agent's store still holds
        # the dead attempt's connection keys and gloo connects to vanished peers. Keying the
        # group by attempt makes every restart rendezvous afresh.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent_store and rank == 0, timeout=timeout)
        store = dist.PrefixStore(f"megazero/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
