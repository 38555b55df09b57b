"""A loss whose gradient rides on an activation (Megatron's MoEAuxLossAutoScaler / MTPLossAutoScaler).

``attach_loss(x, loss, scale)`` returns ``x`` unchanged; in backward ``loss`` receives the gradient
``scale.value`` (read then, so a step can set it after the forward), and flows back through its own
graph. The routers' auxiliary losses and multi-token prediction's losses take effect this way without
travelling with the activations: the model's output and the pipeline's schedule stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["attach_loss"]


class _AttachedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale, ctx.loss_dtype = scale, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        value = ctx.scale.value
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device) * value, None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: Any) -> torch.Tensor:
    """``x``, with the 0-d ``loss``'s gradient ``scale.value`` (a number or a 0-d tensor) given in backward."""
    return _AttachedLoss.apply(x, loss, scale)
