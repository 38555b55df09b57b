"""Autograd-aware collectives at the borders of tensor-parallel regions.

Each function is the forward half of a pair whose backward is its conjugate
(copy <-> all-reduce, split <-> all-gather, all-gather <-> reduce-scatter).
Names follow Megatron-LM. Every function takes an explicit ``group``; ``None``
means the registered TP group, or ``NO_GROUP`` (no communication at all) when
model parallelism is not initialized (single-process use).

Sequence-parallel tensors are split along dim 0: activations are ``[s, b, h]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import parallel_state
from .utils import NO_GROUP, all_gather_flat, divide, group_rank, group_size, reduce_scatter_flat

__all__ = [
    "resolve_tp_group",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_first_dim",
    "reduce_scatter_first_dim",
]


def resolve_tp_group(group: Optional[dist.ProcessGroup]):
    """``group`` if given, else the registered TP group, else ``NO_GROUP`` (no communication)."""
    if group is not None:
        return group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return NO_GROUP


_size, _rank = group_size, group_rank


# ---- raw collectives (no autograd) -------------------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    width = divide(x.size(-1), world, "last dimension / tensor parallel size")
    return x.narrow(-1, _rank(group) * width, width).contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    world = _size(group)
    if world == 1:
        return x
    rows = divide(x.size(0), world, "sequence length / tensor parallel size")
    return x.narrow(0, _rank(group) * rows, rows).contiguous()


def all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (no autograd)."""
    world = _size(group)
    if world == 1:
        return x
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's dim-0 chunk (no autograd)."""
    world = _size(group)
    if world == 1:
        return x
    rows = divide(x.size(0), world, "sequence length / tensor parallel size")
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


# ---- autograd functions ------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _size(group) == 1:
            return x
        if x.is_contiguous() and x._base is None and (x.grad_fn is not None or not x.requires_grad):
            # In place, as Megatron's _reduce: the input is a layer's fresh partial sum (a matmul's
            # output, which nothing saves), so a copy per layer would only cost time and memory.
            # mark_dirty bumps its version, so an op that did save it fails loudly in backward.
            dist.all_reduce(x, group=group)
            ctx.mark_dirty(x)
            return x
        # a leaf, a view or strided: the caller's tensor stays (one contiguous copy, not clone + contiguous)
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        # When the consumer is tensor-parallel (e.g. a column-parallel linear), each rank
        # holds a partial gradient of the full sequence: sum them and keep our chunk.
        # When the consumer is replicated, every rank already has the full gradient.
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (entering a TP region)."""
    return _CopyToRegion.apply(x, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-reduce forward; identity backward (leaving a TP region with partial sums)."""
    return _ReduceFromRegion.apply(x, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; all-gather of the gradient backward."""
    return _ScatterToRegion.apply(x, resolve_tp_group(group))


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather along the last dim; keep this rank's chunk of the gradient backward."""
    return _GatherFromRegion.apply(x, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dim 0); all-gather of the gradient backward."""
    return _ScatterToSequenceRegion.apply(x, resolve_tp_group(group))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Optional[dist.ProcessGroup] = None, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence (dim 0); reduce-scatter (or split) of the gradient backward."""
    return _GatherFromSequenceRegion.apply(x, resolve_tp_group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk; all-gather backward."""
    return _ReduceScatterToSequenceRegion.apply(x, resolve_tp_group(group))
