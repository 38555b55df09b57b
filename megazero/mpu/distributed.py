"""Start torch.distributed from torchrun's (or SLURM's) environment, on any device."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "distributed_run", "DEFAULT_TIMEOUT_S", "NCCL_GRACE_S", "nccl_watchdog_env", "export_slurm_env", "default_backend", "first_slurm_host",
           "resolve_local_rank", "select_device", "LOCAL_RANK_VARIABLES"]

# Where launchers put a process's rank on its node, in order of trust: torchrun / deepspeed /
# torch.distributed.launch, SLURM's srun, Open MPI, MVAPICH2, Intel MPI / MPICH (hydra),
# PMI-based launchers, PALS (Cray/HPE mpiexec), Flux.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                        "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "FLUX_TASK_LOCAL_ID")


# Megatron-LM's --distributed-timeout-minutes default: every group's collectives give up after it.
DEFAULT_TIMEOUT_S = 600.0
# NCCL's own watchdog aborts the process at its groups' timeout; it gets this much longer, so the run's
# watchdog (megazero.training.health.watchdog), whose deadline is the timeout, speaks first.
NCCL_GRACE_S = 30.0


def nccl_watchdog_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What NCCL needs so a hang inside a CUDA collective ends the process too, as ``{name: value}`` for
    the variables the user left unset: on a timeout the communicators abort and the process ends
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, torch's default made explicit), and the flight recorder
    dumps every rank's last collectives (``TORCH_NCCL_DUMP_ON_TIMEOUT``, ``TORCH_NCCL_TRACE_BUFFER_SIZE``)."""
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    return {k: v for k, v in wanted.items() if not environ.get(k) and not environ.get(k[len("TORCH_"):])}


def default_backend() -> str:
    """NCCL when CUDA devices exist, gloo otherwise (CPU training and tests)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def export_slurm_env() -> None:
    """Under ``srun`` without torchrun, set torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT) from SLURM's; nothing when RANK is set or SLURM did not start the process.
    Entry points call it before reading the world size from the environment."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    if "SLURM_LOCALID" in os.environ:
        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
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


def resolve_local_rank(env: Mapping[str, str], device_count: int) -> int:
    """The CUDA device index of this process, out of ``device_count`` visible devices.

    Taken from the first of :data:`LOCAL_RANK_VARIABLES` that the launcher set. With one
    visible device it is device 0 whatever the local rank (launchers that give each process
    its own GPU through ``CUDA_VISIBLE_DEVICES``), and so is a single process without a
    launcher. Several processes (``WORLD_SIZE`` > 1) on several visible GPUs with none of the
    variables set would all land on GPU 0: that, and a local rank without a visible device,
    are refused with the variable to set.
    """
    found = next(((name, env[name]) for name in LOCAL_RANK_VARIABLES if env.get(name, "").strip()), None)
    if device_count <= 1:
        return 0
    if found is None:
        if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
            return 0
        raise RuntimeError(
            f"cannot tell which of the {device_count} visible GPUs is this process's: the launcher set RANK "
            f"but none of {', '.join(LOCAL_RANK_VARIABLES)}; set LOCAL_RANK to the process's rank on its node "
            "(or launch with torchrun)")
    name, value = found
    try:
        local_rank = int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} is not an integer local rank") from None
    if not 0 <= local_rank < device_count:
        raise RuntimeError(f"{name}={local_rank} but only {device_count} GPUs are visible to this process; "
                           "set LOCAL_RANK (or CUDA_VISIBLE_DEVICES) so that each process on a node gets its own GPU")
    return local_rank


def select_device(backend: Optional[str], *, group_exists: bool = False) -> Optional[int]:
    """Make this process's GPU (:func:`resolve_local_rank`) the current CUDA device and return its
    index, when ``backend`` is NCCL (``"nccl"``, or a per-device spec naming it such as
    ``"cpu:gloo,cuda:nccl"``) and CUDA is available; otherwise change nothing and return None.

    With ``group_exists`` (the default group was started by someone else) and none of
    :data:`LOCAL_RANK_VARIABLES` set, the current device is kept and returned: a process started
    without a launcher had its device chosen by whoever started the group.
    """
    if backend is None or "nccl" not in str(backend) or not torch.cuda.is_available():
        return None
    if group_exists and not any(os.environ.get(name, "").strip() for name in LOCAL_RANK_VARIABLES):
        return torch.cuda.current_device()
    local_rank = resolve_local_rank(os.environ, torch.cuda.device_count())
    torch.cuda.set_device(local_rank)
    return local_rank


def init_distributed(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Initialize the default process group once; return ``(rank, world_size)``.

    ``timeout_s`` is the collective timeout of the default group and of every group megazero makes
    (``parallel_state.new_group``); NCCL groups get :data:`NCCL_GRACE_S` more, and NCCL's watchdog is
    configured (:func:`nccl_watchdog_env`) where the environment does not say otherwise.

    Without a launcher (no RANK/WORLD_SIZE), it starts a single-process group so
    that `python pretrain_gpt.py` works on one device. On every path, whether the group is
    started here or already existed, the process's GPU is selected (:func:`select_device`) for
    ``backend``, or for the existing group's backend when ``backend`` is None.
    """
    if dist.is_initialized():
        # A group someone else started (a script, a notebook, a launcher helper) says nothing
        # about the current device: without this every rank would stay on GPU 0.
        select_device(backend if backend is not None else dist.get_backend(), group_exists=True)
        return dist.get_rank(), dist.get_world_size()
    export_slurm_env()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = backend or default_backend()
    select_device(backend)
    if "nccl" in str(backend):
        os.environ.update(nccl_watchdog_env(os.environ))
        timeout_s += NCCL_GRACE_S
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


def shutdown_distributed() -> None:
    """Destroy the model-parallel groups and the default group, and join their worker threads.

    Call it last, before the process exits. ``destroy_process_group`` unregisters the
    groups, but gloo's worker threads live until the last Python reference to a group is
    collected; a worker still releasing a finished collective's tensors while the
    interpreter finalizes cannot take the GIL and aborts the process (``terminate called
    without an active exception``, exit -6) after the run has already ended. Collecting
    here joins the threads while the interpreter is whole (the group's destructor drops the
    GIL while it joins).
    """
    from .parallel_state import destroy_model_parallel

    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def distributed_run(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[tuple[int, int]]:
    """A program's time in ``torch.distributed``: yields ``(rank, world_size)``; ``timeout_s`` as in
    :func:`init_distributed`.

    Started here (the usual case: torchrun, srun, one process), the default group is shut down at
    the end (:func:`shutdown_distributed`). Inside a process that already has one (an application
    calling a program's ``main``, a test harness), that group is used and left alive; only the
    model-parallel groups made meanwhile are destroyed.
    """
    from .parallel_state import destroy_model_parallel

    started_here = not dist.is_initialized()
    rank_world = init_distributed(backend, timeout_s)
    try:
        yield rank_world
    finally:
        if started_here:
            shutdown_distributed()
        else:
            destroy_model_parallel()
