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

Invariants the engine relies on: ``shard`` and ``replicate`` hold ranks of the data-parallel
group only (the step's norm and flags are summed over that group), and ``shard x replicate``
ranks together hold one copy of the parameter. The global gradient norm counts an element on
the first replica only; gradients are divided by the data-parallel size whatever the group
(every data-parallel rank's loss is one term of the mean, whichever parameters it touched).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["Partitioning", "PartitionFn", "data_parallel", "check_within", "group_info"]


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


def check_within(part: Partitioning, dp_group: Optional[dist.ProcessGroup]) -> None:
    """Raise ValueError unless ``part``'s groups hold data-parallel ranks only and together are no
    larger than the data-parallel group."""
    if not dist.is_initialized():
        return
    dp = set(dist.get_process_group_ranks(dp_group or dist.group.WORLD))
    for label, g in (("shard", part.shard), ("replicate", part.replicate)):
        if g is None:
            continue
        outside = sorted(set(dist.get_process_group_ranks(g)) - dp)
        if outside:
            raise ValueError(f"partitioning {part.name!r}: its {label} group holds ranks {outside[:8]} outside the "
                             f"data-parallel group {sorted(dp)[:8]}...; partition over data-parallel ranks only "
                             "(build the group from mpu's data-parallel ranks)")
    if part.size * part.replicas > len(dp):
        raise ValueError(f"partitioning {part.name!r}: {part.size} partitions x {part.replicas} replicas exceed the "
                         f"{len(dp)} data-parallel ranks")
