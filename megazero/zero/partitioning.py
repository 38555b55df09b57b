"""Partitionings: the process group each parameter's ZeRO state is split and reduced over.

By default every parameter is partitioned over the engine's data-parallel group, the group
whose ranks see different data. Some parameters need another group:

* an expert of a mixture-of-experts layer lives on one expert-parallel rank only; its state is
  partitioned and its gradient summed over the *expert*-data-parallel group, the ranks that
  hold the same expert (Megatron's ``expert_data_parallel_group``);
* a parameter kept whole on several sub-groups of the data-parallel ranks (hybrid sharding,
  FSDP2's HSDP) is partitioned over one sub-group (``shard``) and identical across the others
  (``replicate``): its gradient is reduce-scattered within ``shard`` and all-reduced across
  ``replicate``.

Invariants the engine relies on: ``shard`` and ``replicate`` hold ranks of this pipeline stage
only (the data-parallel group x the tensor-parallel group), and ``shard x replicate`` ranks
together hold one copy of the parameter. An expert under an expert tensor-parallel size below
the TP size is partitioned over an expert-data-parallel group that spans TP ranks too; the step
sums the norm over DP, then over the model-parallel group, which still counts each element once
since the stage's expert partitions are disjoint. The global gradient norm counts an element on
the first replica only; gradients are divided by the data-parallel size whatever the group
(every data-parallel rank's loss is one term of the mean, whichever parameters it touched).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["Partitioning", "PartitionFn", "data_parallel", "check_within", "stage_ranks", "group_info"]


def group_info(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` for None (this process alone) or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclasses.dataclass(frozen=True, eq=False)
class Partitioning:
    """``name`` labels the group in the engine's collective counts (``"dp"``, ``"edp"``, ...);
    ``shard`` is the group partitions are taken and gradients reduce-scattered over (None:
    this process alone); ``replicate`` the group across which copies are identical (None: none)."""

    name: str
    shard: Optional[dist.ProcessGroup]
    replicate: Optional[dist.ProcessGroup] = None

    @property
    def size(self) -> int:
        """Ranks the state is partitioned over."""
        return group_info(self.shard)[0]

    @property
    def rank(self) -> int:
        """This rank's partition index."""
        return group_info(self.shard)[1]

    @property
    def replicas(self) -> int:
        return group_info(self.replicate)[0]

    @property
    def replica_rank(self) -> int:
        return group_info(self.replicate)[1]

    @property
    def replicate_name(self) -> str:
        """The name the replica group's collectives are counted under."""
        return f"{self.name}.replicas"


PartitionFn = Callable[[str, torch.nn.Parameter], Optional[Partitioning]]


def data_parallel(dp_group: Optional[dist.ProcessGroup]) -> Partitioning:
    """The default: partitioned over the whole data-parallel group, no replicas."""
    return Partitioning("dp", dp_group)


def stage_ranks(dp_group: Optional[dist.ProcessGroup], tp_group: Optional[dist.ProcessGroup] = None) -> set[int]:
    """Global ranks of this rank's pipeline stage: the data-parallel group x the tensor-parallel group.

    Ranks lie on a grid (every mpu layout: each group a line or plane through it), so the stage's
    rank at DP peer ``d`` and TP peer ``t`` is ``d + t - me``. Without torch.distributed: {0}."""
    if not dist.is_initialized():
        return {0}
    me = dist.get_rank()
    dp = dist.get_process_group_ranks(dp_group or dist.group.WORLD)
    tp = dist.get_process_group_ranks(tp_group) if tp_group is not None else [me]
    return {d + t - me for d in dp for t in tp}


def check_within(part: Partitioning, dp_group: Optional[dist.ProcessGroup],
                 tp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise ValueError unless ``part``'s groups hold ranks of this pipeline stage only
    (:func:`stage_ranks`) and together are no larger than the stage."""
    if not dist.is_initialized():
        return
    stage = stage_ranks(dp_group, tp_group)
    for label, g in (("shard", part.shard), ("replicate", part.replicate)):
        if g is None:
            continue
        outside = sorted(set(dist.get_process_group_ranks(g)) - stage)
        if outside:
            raise ValueError(f"partitioning {part.name!r}: its {label} group holds ranks {outside[:8]} outside the "
                             f"pipeline stage's data-parallel x tensor-parallel ranks {sorted(stage)[:8]}...; "
                             "partition over ranks of this stage only (build the group from mpu's groups)")
    if part.size * part.replicas > len(stage):
        raise ValueError(f"partitioning {part.name!r}: {part.size} partitions x {part.replicas} replicas exceed the "
                         f"{len(stage)} ranks of the pipeline stage")
