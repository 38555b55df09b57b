"""Collectives that count what they move.

Volumes are logical, as in the ZeRO paper's accounting: an all-gather or a
reduce-scatter of a flat tensor of N elements counts N elements (the size of
the full tensor), an all-reduce counts N. Bytes are tallied per operation and
per group name, so a step's traffic can be checked against the theory
(ZeRO-3: 2 all-gathers of the parameters and 1 reduce-scatter of the gradients).

On gloo (CPU) the two ZeRO collectives are issued as their in-place equivalents. gloo's
all-gather receives into a full-size temporary and copies out of it, and its reduce-scatter
holds a copy of its input and output, which a ZeRO-3 step would pay per unit in flight. So an
all-gather is one broadcast per rank into the output (no temporary), and a reduce-scatter an
in-place all-reduce of the input (which then holds the sum: the input is scratch for every
caller) whose own chunk is copied out, at twice the bytes on the wire. NCCL gathers and
reduce-scatters in place already and keeps the collectives themselves. Memory and time of
both forms: ``docs/benchmarks.md``.

Which form is issued is chosen per :class:`CommCounter` (``collectives=``), or, when the engine
builds it, by ``$MEGAZERO_ZERO_COLLECTIVES``, read once as the engine is constructed:
``auto`` (the default: emulated on gloo groups, native on every other backend), ``native``
(``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on every backend, gloo included: the
path a GPU run takes, runnable on CPU) or ``emulated`` (broadcasts / all-reduce on every
backend). Both forms count the same bytes and calls.
"""

from __future__ import annotations

import collections
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..mpu.parallel_state import new_group
from ..mpu.utils import all_gather_flat, reduce_scatter_flat

__all__ = ["CommCounter", "build_comm", "gradient_communicator", "grads_channel", "COLLECTIVES_ENV", "COLLECTIVES"]

COLLECTIVES_ENV = "MEGAZERO_ZERO_COLLECTIVES"
COLLECTIVES = ("auto", "native", "emulated")


class _Then:
    """Asynchronous works, then a local step once they have all finished (``wait`` as a Work)."""

    def __init__(self, works: list, after: Optional[Callable[[], object]] = None) -> None:
        self.works, self.after = works, after

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return True


class CommCounter:
    """Issues collectives on named groups and counts their bytes.

    ``collectives`` chooses how flat all-gathers and reduce-scatters are issued: ``"auto"``
    (emulated on gloo groups, native elsewhere), ``"native"`` or ``"emulated"`` (see the module
    docstring); None reads ``$MEGAZERO_ZERO_COLLECTIVES`` now (``auto`` when unset). The choice
    changes neither the counted traffic nor, up to summation order, the results.
    """

    def __init__(self, groups: dict[str, Optional[dist.ProcessGroup]], collectives: Optional[str] = None) -> None:
        self.groups = groups
        self.bytes: collections.Counter[tuple[str, str], int] = collections.Counter()
        self.calls: collections.Counter[tuple[str, str], int] = collections.Counter()
        if collectives is None:
            collectives = os.environ.get(COLLECTIVES_ENV, "").strip().lower() or "auto"
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives={collectives!r} (or ${COLLECTIVES_ENV}) must be one of {COLLECTIVES}")
        self.collectives = collectives
        self._emulate: dict[str, bool] = {}

    def emulated(self, name: str) -> bool:
        """Whether group ``name`` gets the broadcast / all-reduce forms (decided once per group)."""
        if name not in self._emulate:
            if self.collectives != "auto":
                self._emulate[name] = self.collectives == "emulated"
            else:
                try:
                    self._emulate[name] = dist.get_backend(self.groups[name]) == "gloo"
                except (RuntimeError, ValueError):  # a fake or custom process group: its own collectives
                    self._emulate[name] = False
        return self._emulate[name]

    def size(self, name: str) -> int:
        g = self.groups[name]
        return 1 if g is None or not dist.is_initialized() else dist.get_world_size(g)

    def _count(self, op: str, name: str, t: torch.Tensor) -> None:
        self.bytes[(op, name)] += t.numel() * t.element_size()
        self.calls[(op, name)] += 1

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, name: str, async_op: bool = False):
        """Gather equal shards into ``out`` (flat)."""
        self._count("all_gather", name, out)
        n = self.size(name)
        if n == 1:
            out.copy_(shard)
            return None
        group = self.groups[name]
        if not self.emulated(name):
            return all_gather_flat(out, shard, group=group, async_op=async_op)
        chunk, rank = out.numel() // n, dist.get_rank(group)
        mine = out.narrow(0, rank * chunk, chunk)
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        works = [dist.broadcast(out.narrow(0, i * chunk, chunk), src=_global(group, i), group=group, async_op=True)
                 for i in range(n)]
        return _finish(_Then(works), async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, name: str, async_op: bool = False,
                       via: Optional[str] = None):
        """Sum ``full`` over the group and keep this rank's equal chunk in ``out`` (counted under
        ``name``; issued on the communicator of ``via``, the same ranks, when given)."""
        self._count("reduce_scatter", name, full)
        n = self.size(name)
        if n == 1:
            out.copy_(full)
            return None
        group = self.groups[via or name]
        if not self.emulated(via or name):
            return reduce_scatter_flat(out, full, group=group, async_op=async_op)
        chunk, rank = full.numel() // n, dist.get_rank(group)
        work = dist.all_reduce(full, group=group, async_op=True)  # ``full`` is scratch: it ends as the sum
        return _finish(_Then([work], lambda: out.copy_(full.narrow(0, rank * chunk, chunk))), async_op)

    def all_reduce(self, t: torch.Tensor, name: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        self._count("all_reduce", name, t)
        if self.size(name) == 1:
            return None
        return dist.all_reduce(t, op=op, group=self.groups[name], async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   name: str) -> None:
        """``all_to_all_single`` with uneven splits over group ``name``; counts the bytes this rank
        sends to the others (its own split is a local copy)."""
        n = self.size(name)
        rank = 0 if n == 1 else dist.get_rank(self.groups[name])
        self.bytes[("all_to_all", name)] += (inp.numel() - in_splits[rank]) * inp.element_size()
        self.calls[("all_to_all", name)] += 1
        if n == 1:
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.groups[name])

    def snapshot(self) -> dict[str, int]:
        """``{"all_gather/dp": bytes, ...}`` since the last :meth:`reset`."""
        return {f"{op}/{name}": n for (op, name), n in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def _global(group: Optional[dist.ProcessGroup], i: int) -> int:
    return i if group is None else dist.get_global_rank(group, i)


def _finish(work: _Then, async_op: bool) -> Optional[_Then]:
    if async_op:
        return work
    work.wait()
    return None


_GRADS_DESC = "megazero_zero3_grads"


def gradient_communicator(dp_group: Optional[dist.ProcessGroup], stage: int, dp_size: int,
                          keep_gathered: bool, separate: bool) -> Optional[dist.ProcessGroup]:
    """The communicator ZeRO-3's per-unit gradient reduce-scatters use: ``dp_group`` itself, or,
    with ``separate``, a second communicator over the same ranks.

    Backward interleaves the window's gathers (in the agreed trace order) with the reducer's
    reduce-scatters (in the static unit order) alike on every rank when every rank ran the same
    layers, and differently on ranks whose forwards differed (a layer some ranks skip). gloo
    progresses each communicator on its own threads, so there (``separate``: the engine asks for it
    on the emulated, gloo path) each kind keeps its own agreed order on its own communicator, and
    differing forwards train. NCCL offers no such independence (operations on several communicators
    must be issued in the same order on every rank, and each communicator costs device memory), so
    the native path shares the DP communicator and the engine refuses a ZeRO-3 step whose forwards
    differed. ZeRO-2 (no gathers in backward) and the keep-gathered policy share it always.
    """
    if stage < 3 or dp_size == 1 or keep_gathered or not separate:
        return dp_group
    ranks = dist.get_process_group_ranks(dp_group or dist.group.WORLD)
    # A later engine over the same ranks (another model in this process, the next test) reuses
    # the communicator rather than add one per engine: torch's hashed group names include a
    # count of existing groups, so the group is found by its ranks and its description.
    try:
        world = dist.distributed_c10d._world
        existing = next((pg for pg, members in world.pg_group_ranks.items()
                         if getattr(pg, "group_desc", None) == _GRADS_DESC and sorted(members) == sorted(ranks)),
                        None)
    except AttributeError:  # torch's private registry moved: create one per engine
        existing = None
    return existing or new_group(ranks, use_local_synchronization=True, group_desc=_GRADS_DESC)


def grads_channel(part) -> str:
    """The name of the communicator ``part``'s gradient reduce-scatters are issued on."""
    return f"{part.name}_grads"


def build_comm(groups: dict[str, Optional[dist.ProcessGroup]], partitionings: list, *, stage: int,
               keep_gathered: bool) -> CommCounter:
    """An engine's counted collectives: the named ``groups`` (dp, tp, mp), and for each partitioning its
    own group, its replicas' group and the communicator its gradient reduce-scatters take
    (:func:`gradient_communicator`, named by :func:`grads_channel`)."""
    comm = CommCounter(groups)
    for part in partitionings:
        comm.groups[part.name] = part.shard
        comm.groups[part.replicate_name] = part.replicate
        comm.groups[grads_channel(part)] = gradient_communicator(
            part.shard, stage, part.size, keep_gathered, separate=comm.emulated(part.name))
    return comm
