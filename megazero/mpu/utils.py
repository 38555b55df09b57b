"""Small helpers shared by the tensor-parallel modules: sizes, splits, vocab ranges."""

from __future__ import annotations


import torch
import torch.distributed as dist

__all__ = [
    "divide",
    "ensure_divisibility",
    "split_tensor_along_last_dim",
    "VocabUtility",
    "pad_vocab_size",
    "NO_GROUP",
    "group_size",
    "group_rank",
    "all_gather_flat",
    "reduce_scatter_flat",
]


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    if denominator <= 0 or numerator % denominator != 0:
        label = f"{what}: " if what else ""
        raise ValueError(
            f"{label}{numerator} is not divisible by {denominator}; "
            f"pick sizes so that {numerator} is a multiple of {denominator}"
        )


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """``numerator // denominator``, refusing a remainder with a message naming both numbers."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int, contiguous: bool = False) -> tuple[torch.Tensor, ...]:
    last = divide(tensor.size(-1), num_partitions, "last dimension")
    chunks = torch.split(tensor, last, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous else chunks


class VocabUtility:
    """Ranges ``[first, last)`` of the vocabulary owned by each TP rank (contiguous chunks)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition: int, rank: int, world_size: int) -> tuple[int, int]:
        first = rank * per_partition
        return first, first + per_partition

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size, "vocabulary size / tensor parallel size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def pad_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of ``divisible_by * tp``.

    Padding keeps every TP shard the same size and the GEMM shapes friendly.
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


class _NoGroup:
    """Stands for "no tensor parallelism here": what a layer built without model-parallel
    groups keeps, so that it stays single-process even if groups are registered later
    (``None`` means "the registered group" everywhere)."""

    def __repr__(self) -> str:
        return "NO_GROUP"


NO_GROUP = _NoGroup()


def group_size(group) -> int:
    """World size of ``group``; 1 for ``NO_GROUP`` or when torch.distributed is not running."""
    if group is NO_GROUP or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is NO_GROUP or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# torch 2.13 renamed the flat collectives; older releases (common on GPU clusters) only
# have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
