"""Several experts' linear layers over their rows in one grouped matmul (``torch._grouped_mm``).

``rows`` holds each expert's rows consecutively (``offs``: the cumulative row counts, int32 on the
rows' device); expert ``e``'s rows are multiplied by ``weights[e]^T`` (``[out, in]``, the layout of
``F.linear``). The weights are stacked for the matmul and stacked again in backward, never kept:
autograd saves the parameters themselves, as ``F.linear`` does, rather than a stacked copy alive from
forward to backward (one layer's local experts for every micro-batch in flight), and a ZeRO-3 window
gathers them again for backward like any other saved weight. The weight gradients come out of one
grouped matmul already in ``[out, in]`` layout, each expert's a contiguous slice.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

__all__ = ["grouped_linear", "grouped_matmul_available", "group_offsets"]


def grouped_matmul_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` is worth running for ``dtype`` on ``device``.

    On CUDA only bf16 on compute capability 9.x / 10.x (Hopper, Blackwell) has a grouped kernel;
    elsewhere torch loops over the groups after copying the offsets to the host, a wait for the
    device per matmul that the per-expert loop (whose row counts are already on the host) does not
    make. On the CPU every float dtype runs (a loop inside torch, the same bits); on the meta device,
    the rehearsal's, bf16 as on a GPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.version.hip is None and \
            torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type == "meta":
        return dtype == torch.bfloat16
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def group_offsets(per_group: list, device: torch.device) -> torch.Tensor:
    """``offs`` for :func:`grouped_linear`: the running sums of ``per_group`` (counts on the host), sent
    to ``device`` without waiting for it."""
    return torch.tensor(list(accumulate(per_group)), dtype=torch.int32).to(device, non_blocking=True)


def _stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[E, out, in]``: a view when there is one expert, else a copy."""
    return weights[0].unsqueeze(0) if len(weights) == 1 else torch.stack(weights)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, offs, *weights):
        ctx.save_for_backward(rows, offs, *weights)
        return torch._grouped_mm(rows, _stacked(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        rows, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # a sum's broadcast gradient has zero strides, which _grouped_mm refuses
        grad_rows = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch._grouped_mm(grad, _stacked(weights), offs=offs)  # [N, out] x [E, out, in]
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_weights = list(torch._grouped_mm(grad.t(), rows, offs=offs).unbind(0))  # [E, out, in]
        return (grad_rows, None, *grad_weights)


def grouped_linear(rows: torch.Tensor, offs: torch.Tensor, weights: list) -> torch.Tensor:
    """``[N, in]`` rows (``offs[e-1]:offs[e]`` for expert ``e``) times each expert's ``[out, in]`` weight:
    ``[N, out]``, with gradients for the rows and every weight."""
    return _GroupedLinear.apply(rows.contiguous(), offs, *weights)
