"""Between full (tp=1) tensors and their TP shards, following the partition attributes.

A parameter with ``partition_dim=d`` and ``partition_stride=k`` is the full
tensor cut into ``k * tp`` equal blocks along ``d``; rank ``r`` holds blocks
``r, r + tp, ..., r + (k-1) * tp``, concatenated. With ``k = 1`` that is one
contiguous chunk per rank; ``k = 2`` is e.g. SwiGLU's fused [gate; up] weight,
where every rank holds its slice of both halves.

A parameter is shard ``(rank, world)`` over the tensor-parallel group unless it says otherwise:
an expert under an expert tensor-parallel size other than the TP size carries ``tp_shard =
(rank, world)`` and ``tp_shard_group`` (the group of those ``world`` shards; None when
``world == 1``). :func:`tp_shard_of` and :func:`tp_shard_group_of` read either.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .utils import group_size

__all__ = ["shard_ranges", "shard_of_full", "full_from_shards", "gather_tensor_model_parallel", "is_tp_sharded", "tp_shard_of",
           "tp_shard_group_of"]


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a shard of a larger tensor along ``partition_dim``."""
    return bool(getattr(param, "tensor_model_parallel", False))


def tp_shard_of(param: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """``(rank, world)``: ``param`` is shard ``rank`` of ``world`` of its full (tp=1) tensor.

    Its own ``tp_shard`` when it has one, else the given default (the TP group's coordinates).
    Meaningful for TP-sharded parameters only (:func:`is_tp_sharded`)."""
    shard = getattr(param, "tp_shard", None)
    return (rank, world) if shard is None else (int(shard[0]), int(shard[1]))


def tp_shard_group_of(param: torch.Tensor,
                      default_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The process group over which ``param``'s shards lie: its own ``tp_shard_group`` when it has
    a ``tp_shard`` (None for a whole tensor), else ``default_group`` (the TP group)."""
    if getattr(param, "tp_shard", None) is None:
        return default_group
    return getattr(param, "tp_shard_group", None)


def shard_ranges(size: int, stride: int, rank: int, world: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges along the partition dimension (of length ``size``) that shard ``rank`` of
    ``world`` holds, in order: block ``s * world + rank`` of the ``stride * world`` equal blocks, for each
    ``s``. What a reader that fetches only its shard's bytes (a safetensors slice) needs."""
    if size % (stride * world):
        raise ValueError(f"dimension of size {size} does not split into {stride} x {world} equal blocks")
    block = size // (stride * world)
    return [((s * world + rank) * block, (s * world + rank + 1) * block) for s in range(stride)]


def shard_of_full(full: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of ``full`` (a contiguous copy)."""
    if world == 1:
        return full.clone()
    try:
        ranges = shard_ranges(full.shape[dim], stride, rank, world)
    except ValueError:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {stride} x {world} "
                         "equal blocks") from None
    return torch.cat([full.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim).contiguous()


def full_from_shards(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`shard_of_full` given every rank's shard in rank order."""
    world = len(shards)
    if world == 1:
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(world)], dim=dim)


def gather_tensor_model_parallel(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The full tensor of a TP-sharded parameter (replicated ones are returned as they are),
    gathered over its own shard group when it has one (:func:`tp_shard_group_of`), else ``group``."""
    group = tp_shard_group_of(t, group)
    if not is_tp_sharded(t) or group is None or group_size(group) == 1:
        return t.detach().clone()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return full_from_shards(parts, t.partition_dim, getattr(t, "partition_stride", 1))
