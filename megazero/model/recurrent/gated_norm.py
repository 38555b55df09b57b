"""The gated RMSNorms that follow the recurrent mixers, as transformers computes them.

Two orders of silu gating, one function (:func:`gated_rms_norm`), and Kimi Delta Attention's sigmoid gate
(:func:`sigmoid_gated_rms_norm`):

* ``norm_before_gate=True`` (Gated DeltaNet, Qwen3-Next's ``Qwen3NextRMSNormGated``):
  ``rmsnorm(x) * weight * silu(z)``. Qwen3-Next passes ``eps = config.rms_norm_eps`` (1e-6 by default) and
  normalises over one head (the caller folds heads into the leading dims).
* ``norm_before_gate=False`` (Mamba-2, Nemotron-H's ``NemotronHRMSNormGated`` / mamba_ssm's ``RMSNormGated``):
  ``rmsnorm(x * silu(z)) * weight``, the mean square taken over groups of ``group_size`` channels (Nemotron-H:
  ``intermediate_size // n_groups``). Nemotron-H passes ``eps = config.layer_norm_epsilon`` (1e-5 by default;
  megatron-core's mixer hard-codes 1e-5).
* Kimi Linear's ``KimiLinearRMSNormGated``: ``rmsnorm(x) * weight * sigmoid(gate)`` over one head, all in fp32
  (the weight too), cast to x's dtype at the end.

The casts are transformers': x and z go to fp32, the normalised value is cast back to x's dtype before the weight
multiplies it (in the promoted dtype of weight and x), and the result is returned in x's dtype. Where the weight is
wider than x (fp32 weight, bf16 x) transformers' Nemotron-H norm returns the wider dtype and its mixer casts to the
model dtype right after; casting here gives the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["gated_rms_norm", "sigmoid_gated_rms_norm"]


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, *, eps: float, group_size: int | None = None,
                   norm_before_gate: bool) -> Tensor:
    """x, z [..., C]; weight [C]. norm_before_gate=True (Gated DeltaNet / Qwen3-Next): rmsnorm(x) * weight * silu(z)
    over the last dim; False (Mamba-2 / Nemotron-H): rmsnorm(x * silu(z)) * weight, normalised over groups of group_size
    channels (None: all C). fp32 inside, output in x's dtype.

    ``group_size`` applies to both orders (None: the whole last dim); it must divide C."""
    C = x.shape[-1]
    if z.shape != x.shape or weight.shape != (C,):
        raise ValueError(f"gated_rms_norm needs x and z of one shape [..., C] and weight [C]; got x {tuple(x.shape)}, "
                         f"z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    group = C if group_size is None else group_size
    if group < 1 or C % group:
        raise ValueError(f"group_size {group_size} must divide the {C} channels (None normalises over all of them)")
    dtype = x.dtype
    h = x.to(torch.float32)
    gate = F.silu(z.to(torch.float32))
    if not norm_before_gate:
        h = h * gate
    h = _rms_normalize(h, group, eps)
    h = weight * h.to(dtype)
    if norm_before_gate:
        h = h * gate
    return h.to(dtype)


def _rms_normalize(h: Tensor, group: int, eps: float) -> Tensor:
    """h / sqrt(mean(h²) + eps) over consecutive groups of ``group`` channels of the last dim (fp32 in, fp32 out)."""
    shape = h.shape
    h = h.reshape(*shape[:-1], shape[-1] // group, group)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.reshape(shape)


def sigmoid_gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, *, eps: float) -> Tensor:
    """x, gate [..., C]; weight [C]: rmsnorm(x) * weight * sigmoid(gate) over the last dim, in fp32 throughout
    (Kimi Linear's), returned in x's dtype."""
    C = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (C,):
        raise ValueError(f"sigmoid_gated_rms_norm needs x and gate of one shape [..., C] and weight [C]; got x "
                         f"{tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    h = _rms_normalize(x.to(torch.float32), C, eps) * weight.to(torch.float32)
    return (h * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)
