"""TP-invariant initialization of sharded weights.

A sharded weight is initialized by drawing the *full* (master) weight on the
CPU from the default generator, which is seeded identically on every rank of
a replica, and keeping this rank's contiguous chunk. The gathered weights of a
tp=4 layer are therefore bit-identical to those of a tp=1 layer.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

InitMethod = Callable[[torch.Tensor], torch.Tensor]

__all__ = [
    "InitMethod",
    "init_method_normal",
    "scaled_init_method_normal",
    "init_method_zeros",
    "set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "initialize_sharded_",
    "modules_with_direct_parameters",
    "reset_parameters_in_order",
]


def init_method_normal(std: float) -> InitMethod:
    """N(0, std) initialization."""

    def init_(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(t, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 * num_layers)): GPT-2's scaling for residual-output projections."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def init_method_zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.zeros_(t)


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Megatron's markers: which parameters are TP shards, and along which dim."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def copy_tensor_model_parallel_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    for name in ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared_embedding"):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


@torch.no_grad()
def initialize_sharded_(
    param: torch.Tensor,
    full_shape: tuple[int, ...],
    partition_dim: int,
    rank: int,
    world_size: int,
    init_method: InitMethod,
) -> torch.Tensor:
    """Fill ``param`` with this rank's chunk of a full weight drawn on the CPU."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if world_size > 1:
        master = master.chunk(world_size, dim=partition_dim)[rank]
    param.copy_(master.to(dtype=param.dtype, device=param.device))
    return param


def modules_with_direct_parameters(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules (pre-order) that own parameters themselves rather than through children."""
    return [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]


@torch.no_grad()
def reset_parameters_in_order(module: torch.nn.Module) -> None:
    """Initialize a model by calling ``reset_parameters()`` of every module that owns
    parameters, in ``module.modules()`` order, from the default generator.

    This order is the contract between a model and partitioned construction: a
    model built on the meta device and materialized one module at a time
    (``megazero.zero``) draws exactly the same numbers as one built whole.
    """
    for m in modules_with_direct_parameters(module):
        reset = getattr(m, "reset_parameters", None)
        if reset is None:
            raise TypeError(
                f"{type(m).__name__} owns parameters but has no reset_parameters(); "
                "give it one that initializes its own (non-child) parameters"
            )
        reset()
