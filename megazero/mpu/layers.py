"""Tensor-parallel layers (Megatron-LM's): column- and row-parallel linear, vocab-parallel embedding.

All three return shards that are contiguous chunks in TP-rank order along the
partitioned dimension, carry Megatron's ``tensor_model_parallel`` /
``partition_dim`` / ``partition_stride`` attributes, and initialize so that
the gathered weights do not depend on the TP size.

Under sequence parallelism the activations entering/leaving the layers are
``[s/tp, b, h]`` shards. Replicated parameters that then see only a sequence
shard (the row-parallel bias) get their gradient all-reduced over TP by the
layer itself, through ``copy_to_tensor_model_parallel_region``, so no optimizer
has to remember to do it. A sequence-parallel column-parallel layer keeps only its
input shard for backward and re-gathers it there, so sequence parallelism saves
activation memory for QKV, FC1 and the LM head too.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .initializers import InitMethod, init_method_normal, initialize_sharded_, set_tensor_model_parallel_attributes
from .mappings import (
    _rank,
    _size,
    all_gather_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    resolve_tp_group,
    scatter_to_tensor_model_parallel_region,
)
from .utils import VocabUtility, all_gather_flat, divide, reduce_scatter_flat

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

_DEFAULT_INIT = init_method_normal(0.02)


class _TPModule(torch.nn.Module):
    """Holds the TP group, rank and size of a layer."""

    def __init__(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_size = _size(self.tp_group)
        self.tp_rank = _rank(self.tp_group)

    def _maybe_reset(self, device) -> None:
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters()


class _LinearWithAsyncInputGradAllReduce(torch.autograd.Function):
    """``F.linear`` entering a TP region, whose backward all-reduces the input gradient
    asynchronously while the weight gradient is computed (Megatron's overlap).

    Equivalent to ``F.linear(copy_to_tensor_model_parallel_region(x), w, b)``, minus the
    idle time of a synchronous all-reduce.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_input = grad_out.matmul(weight)
        work = dist.all_reduce(grad_input, group=ctx.group, async_op=True)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = g2.t().matmul(x.reshape(-1, x.shape[-1])) if weight.requires_grad else None
        grad_bias = g2.sum(dim=0) if ctx.has_bias else None
        work.wait()
        return grad_input, grad_weight, grad_bias, None


class _LinearWithSequenceParallelGather(torch.autograd.Function):
    """``F.linear(all_gather_seq(x), w, b)`` for a sequence-parallel input ``x`` ``[s/tp, b, h]``
    that saves the shard, not the gathered ``[s, b, h]`` (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication).

    Forward gathers into a temporary freed on return. Backward re-gathers the saved
    shard asynchronously while it computes the input gradient of the full sequence,
    then reduce-scatters that gradient asynchronously while it computes the weight
    gradient. The weight is saved as the tensor passed in (the parameter itself), so
    an engine that swaps a parameter's data between forward and backward is seen.
    A weight that does not require grad (frozen) gets no gradient and backward skips
    the re-gather.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        x = x.contiguous()
        total = all_gather_first_dim(x, group)
        out = F.linear(total, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        group, world = ctx.group, _size(ctx.group)
        if need_weight:
            total = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            gather = all_gather_flat(total, x, group=group, async_op=True)
        grad_input = scatter = None
        if need_input:
            grad_total = grad_out.matmul(weight)  # [s, b, h]: each rank's partial sum over its output columns
            grad_input = torch.empty_like(x)
        if need_weight:
            gather.wait()
        if need_input:
            scatter = reduce_scatter_flat(grad_input, grad_total, group=group, async_op=True)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = g2.t().matmul(total.reshape(-1, total.shape[-1])) if need_weight else None
        grad_bias = g2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if scatter is not None:
            scatter.wait()
        return grad_input, grad_weight, grad_bias, None


class ColumnParallelLinear(_TPModule):
    """Y = XA + b with A split along its output (column) dimension across TP ranks.

    Weight ``[output_size / tp, input_size]``; bias ``[output_size / tp]``.
    ``gather_output=True`` all-gathers Y so every rank sees the full output;
    otherwise each rank keeps its ``output_size / tp`` columns (the input of a
    following ``RowParallelLinear(input_is_parallel=True)``).

    ``skip_weight_param_allocation=True`` (Megatron-core's name) creates no weight:
    ``forward(x, weight=...)`` takes it, as a GPT output layer tied to the input
    embedding does. Passing the weight as an argument, rather than reading another
    module's attribute, lets ZeRO-3 see which parameters a forward needs.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = True,
        skip_bias_add: bool = False,
        init_method: InitMethod = _DEFAULT_INIT,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        skip_weight_param_allocation: bool = False,
    ) -> None:
        super().__init__(tp_group)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True needs gather_output=False")
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(
            output_size, self.tp_size, f"ColumnParallelLinear output_size ({output_size}) / tensor parallel size ({self.tp_size})"
        )
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.init_method = init_method
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = torch.nn.Parameter(
                torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)
        self._maybe_reset(device)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            initialize_sharded_(self.weight, (self.output_size, self.input_size), 0, self.tp_rank, self.tp_size,
                                self.init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        # A layer built without a TP group (tp_size 1) never communicates, even if
        # groups are registered later: None would mean "the registered group" below.
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                                 "pass the weight to forward(x, weight=...)")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"ColumnParallelLinear: weight of shape {tuple(weight.shape)} passed, expected "
                             f"{(self.output_size_per_partition, self.input_size)}")
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                            or (bias is not None and bias.requires_grad)):
                out = _LinearWithSequenceParallelGather.apply(x, weight, bias, self.tp_group)
            else:
                out = F.linear(all_gather_first_dim(x, self.tp_group), weight, bias)
        elif self.tp_size > 1 and torch.is_grad_enabled() and x.requires_grad:
            out = _LinearWithAsyncInputGradAllReduce.apply(x, weight, bias, self.tp_group)
        else:
            out = F.linear(x, weight, bias)
        if not self.gather_output or self.tp_size == 1:
            return out, (self.bias if self.skip_bias_add else None)
        out = gather_from_tensor_model_parallel_region(out, self.tp_group)
        if self.skip_bias_add and self.bias is not None:
            # The caller adds the bias to the gathered output, so hand it the full bias too.
            return out, gather_from_tensor_model_parallel_region(self.bias, self.tp_group)
        return out, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (per rank {self.output_size_per_partition}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_TPModule):
    """Y = XA + b with A split along its input (row) dimension across TP ranks.

    Weight ``[output_size, input_size / tp]``; bias ``[output_size]``, replicated
    and added once after the all-reduce (or reduce-scatter under sequence parallelism).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod = _DEFAULT_INIT,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(
            input_size, self.tp_size, f"RowParallelLinear input_size ({input_size}) / tensor parallel size ({self.tp_size})"
        )
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.init_method = init_method
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, 0)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self._maybe_reset(device)

    def reset_parameters(self) -> None:
        initialize_sharded_(self.weight, (self.output_size, self.input_size), 1, self.tp_rank, self.tp_size, self.init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.input_is_parallel and self.tp_size > 1:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        out = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        elif self.tp_size > 1:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if self.bias is None:
            return out, None
        # Under sequence parallelism each rank adds the bias to its own sequence
        # shard only, so its gradient is partial: all-reduce it over TP in backward.
        bias = copy_to_tensor_model_parallel_region(self.bias, self.tp_group) if self.sequence_parallel else self.bias
        if self.skip_bias_add:
            return out, bias
        return out + bias, None

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (per rank {self.input_size_per_partition}), out={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_TPModule):
    """Embedding whose vocabulary is split into contiguous chunks across TP ranks.

    Weight ``[num_embeddings / tp, embedding_dim]``. Each rank looks up the ids
    it owns, writes zeros for the others, and an all-reduce sums the rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod = _DEFAULT_INIT,
        tp_group: Optional[dist.ProcessGroup] = None,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.init_method = init_method
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        self._maybe_reset(device)

    def reset_parameters(self) -> None:
        initialize_sharded_(self.weight, (self.num_embeddings, self.embedding_dim), 0, self.tp_rank, self.tp_size, self.init_method)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (per rank {self.num_embeddings_per_partition}), {self.embedding_dim}"
