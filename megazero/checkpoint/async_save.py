"""Checkpoint saves in three parts, so the files can be written while training goes on (``--async-save``).

A save is *staged* on the main thread (:class:`PendingSave`, made by a format's ``stage_*``
function): everything that needs the training process groups or the device happens there, and
the rank's state (its ZeRO partitions, optimizer state, RNG, buffers) is copied into host
memory, so the next step may change the live tensors at once. :meth:`PendingSave.write` then
writes and fsyncs the files with no collective on the training groups (under ``--async-save`` in
one background thread, :class:`BackgroundSave`), and :meth:`PendingSave.commit` seals the
checkpoint with collectives over one dedicated gloo group (:func:`writer_group`), which never
interleave with the training's own: every rank's entries gathered, the manifest written, the
directory renamed, ``latest`` moved. ``latest`` moves only in the commit, so a kill at any point
before it leaves the previous checkpoint in force.

Host memory: a staged save holds one copy of what the rank holds (``PendingSave.host_bytes``),
until its write ends; at most one save is in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megazero.utils.phase_agreement import Failure, attempt, conclude

__all__ = ["PendingSave", "HostCopier", "BackgroundSave", "writer_group", "gather_on_rank0", "finish_write"]

log = logging.getLogger(__name__)

PHASE = "checkpoint save"


class PendingSave:
    """A staged checkpoint of one rank. ``directory``: where it will be once committed;
    ``host_bytes``: the host memory its copies hold; ``group``: the group its commit (and the
    agreement before it) runs over (None: the default group)."""

    directory: str
    host_bytes: int = 0
    group: Optional[dist.ProcessGroup] = None

    def write(self) -> None:
        """Write and fsync this rank's files; no collective on the training groups. Raises on failure."""
        raise NotImplementedError

    def commit(self) -> None:
        """Collective over ``group`` once every rank's write succeeded (:func:`finish_write`): seal the
        checkpoint and move the tracker."""
        raise NotImplementedError


def finish_write(pending: PendingSave, failure: Optional[Failure]) -> None:
    """Collective over ``pending.group``: agree that every rank's write succeeded (else every rank raises
    ``RunAborted`` with the failing rank's message, the previous checkpoint left in force), then commit."""
    conclude(PHASE, failure, pending.group)
    pending.commit()


class HostCopier:
    """Copies tensors into host memory that the live ones no longer share: pinned memory and
    asynchronous copies from a GPU (:meth:`finish` waits for them), plain clones on the CPU.
    ``bytes``: what the copies hold."""

    def __init__(self) -> None:
        self.bytes = 0
        self._device_copies = False

    def __call__(self, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)  # a new tensor already (on the tensor's device)
        if t.device.type == "cuda":
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            out.copy_(t, non_blocking=True)
            self._device_copies = True
        else:
            out = t.contiguous().clone()
        self.bytes += out.numel() * out.element_size()
        return out

    def float32(self, t: torch.Tensor) -> torch.Tensor:
        """The fp32 copy ZeRO's files hold (``zero.checkpoint.stage_zero_state``'s snapshot)."""
        return self(t, torch.float32)

    def finish(self) -> None:
        """Wait for the device-to-host copies (ordered after the step on the current stream)."""
        if self._device_copies:
            torch.cuda.current_stream().synchronize()


def writer_group() -> Optional[dist.ProcessGroup]:
    """Collective: a new gloo group over every rank, for background saves to commit and poll on (None without
    torch.distributed). Every rank makes it at the same point of the run; its owner keeps it."""
    if not dist.is_initialized():
        return None
    from megazero.mpu.parallel_state import new_group

    return new_group(list(range(dist.get_world_size())), backend="gloo")


def gather_on_rank0(obj: Any, group: Optional[dist.ProcessGroup]) -> Optional[list]:
    """Collective over ``group``: every rank's ``obj`` in rank order on rank 0, None elsewhere (``[obj]``
    without torch.distributed). What a commit needs: only rank 0 writes the index of every rank's files."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    rank0 = dist.get_rank() == 0
    gathered: Optional[list] = [None] * dist.get_world_size(group) if rank0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return gathered


def _yield_cpu() -> None:
    """Lower this thread's CPU priority (Linux: a thread's nice value is its own), so that where the host's
    cores are busy (the training step's own threads, data loading) the write takes what they leave instead of
    slowing the step; the write then takes longer, the next save waits for it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: the write runs at the step's priority
        pass


WRITER_NICE = 10  # the writer thread's nice value increment over the process's


class BackgroundSave:
    """One staged save being written by a background thread, and the collectives that end it.

    :meth:`ready` (every rank at the same step boundary) is one small all-reduce on the save's group;
    :meth:`wait` (every rank) waits for this rank's write, then commits (:func:`finish_write`), or
    raises ``RunAborted`` on every rank if any rank's write failed.
    """

    def __init__(self, pending: PendingSave) -> None:
        self.pending = pending
        self.failure: Optional[Failure] = None
        self.write_seconds = 0.0
        self._thread = threading.Thread(target=self._write, name="megazero-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        _yield_cpu()
        t0 = time.perf_counter()
        _, self.failure = attempt(self.pending.write)
        self.write_seconds = time.perf_counter() - t0

    @property
    def written(self) -> bool:
        """Whether this rank's write has ended (well or not)."""
        return not self._thread.is_alive()

    def ready(self) -> bool:
        """Collective over the save's group (one small all-reduce on the host): whether every rank's write
        has ended (well or not), so :meth:`wait` will not wait."""
        group = self.pending.group
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            busy = torch.tensor([0 if self.written else 1], dtype=torch.int32)
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
            return not int(busy.item())
        return self.written

    def wait(self) -> None:
        """Collective: wait for this rank's write, then commit (or every rank raises ``RunAborted``)."""
        self._thread.join()
        finish_write(self.pending, self.failure)
