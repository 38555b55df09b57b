"""Attention sinks: one learnable logit per head that joins every query's softmax and then is dropped
(gpt-oss; Megatron's ``--softmax-type learnable``, ``off-by-one`` for a sink fixed at 0).

softmax([scores, sink])[:-1] equals the plain softmax rescaled by σ(lse − sink) = exp(lse − lse'),
with lse' = logaddexp(lse, sink). So any attention that yields its output and log-sum-exp (a tiled
kernel, a ring after its last merge) takes sinks as one rescale at the end; a FlashAttention-style
backward given that output and lse' yields the exact q, k, v gradients, and the sink's own gradient
is −Σ_rows exp(sink − lse') · rowsum(dO · O).
"""

from __future__ import annotations

from typing import Optional

import torch

from megazero.mpu.initializers import InitMethod, initialize_sharded_, set_tensor_model_parallel_attributes

__all__ = ["LearnableSinks", "add_sinks", "sinks_grad", "softmax_with_sinks"]


class LearnableSinks(torch.nn.Module):
    """The learned sink logits of this TP rank's ``heads / tp_size`` heads, ``softmax_offset`` (megatron-core's
    name; the module sits where megatron-core's core attention does, so the checkpoint names agree),
    drawn by ``init_method`` from the whole ``[heads]`` vector: the same values at any TP degree."""

    def __init__(self, heads: int, *, tp_rank: int, tp_size: int, init_method: InitMethod,
                 params_dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.heads, self.tp_rank, self.tp_size, self.init_method = heads, tp_rank, tp_size, init_method
        self.softmax_offset = torch.nn.Parameter(torch.empty(heads // tp_size, dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0)
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_sharded_(self.softmax_offset, (self.heads,), 0, self.tp_rank, self.tp_size, self.init_method)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` ``[b, heads, s, dv]`` and ``lse`` ``[b, heads, s]`` of a plain softmax attention ->
    (output, log-sum-exp) of the softmax with the per-head ``sinks`` ``[heads]`` among the logits."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype), total


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the ``sinks`` ``[heads]`` from this rank's rows: ``dout`` and ``out`` (with sinks)
    ``[b, heads, s, dv]``, ``lse`` (with sinks) ``[b, heads, s]``."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(torch.exp(sinks.to(acc).view(1, -1, 1) - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The explicit formula: softmax over the last dimension of ``scores`` ``[b, heads, n, m]`` with a
    column of ``sinks`` ``[heads]`` appended, the column dropped (the reference the tiled paths match)."""
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
