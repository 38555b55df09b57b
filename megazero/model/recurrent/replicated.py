"""The recurrent layers' small weights, whole on every tensor-parallel rank.

A convolution over a few thousand channels, a decay rate and a time-step bias per head, a norm's weight: too small
to shard, each rank uses the rows of its own heads. :func:`replicated_parameter` makes one (marked as the norms'
weights are, ``sequence_parallel``: its gradient is partial on each rank) and :func:`as_used` hands a forward the
weights through the copy whose backward sums their gradients over TP, so every rank steps the same values.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megazero import mpu

__all__ = ["replicated_parameter", "as_used"]


def replicated_parameter(*shape: int, tp_size: int, dtype: torch.dtype, device=None) -> torch.nn.Parameter:
    """An uninitialised parameter of the whole ``shape`` on each of ``tp_size`` ranks."""
    p = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
    p.sequence_parallel = tp_size > 1  # each rank uses its heads' rows: the gradient is summed over TP
    return p


def as_used(weights: tuple[torch.Tensor, ...], tp_size: int,
            tp_group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
    """``weights`` as a forward uses them: under TP through the copy whose backward all-reduces their gradients."""
    if tp_size == 1:
        return weights
    return tuple(mpu.copy_to_tensor_model_parallel_region(w, tp_group) for w in weights)
