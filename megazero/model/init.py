"""How a GPT's weights are drawn: the init functions of ordinary weights and of residual outputs."""

from __future__ import annotations

import math

import torch

from megazero.mpu.initializers import InitSpec, init_method_normal, param_draw_key, scaled_init_method_normal

from .config import GPTConfig

__all__ = ["init_methods", "keyed_uniform"]


def init_methods(config: GPTConfig):
    """``(init, output_init)``: for ordinary weights and for the residual-output projections
    (linear_proj, linear_fc2, the recurrent layers' out_proj): N(0, std / sqrt(2L)), or std / sqrt(L) in a hybrid
    stack, whose layers have one residual branch each (Megatron-core's). Both draw from the full weight's shape
    (TP-invariant)."""
    if config.init_method == "xavier_uniform":
        return torch.nn.init.xavier_uniform_, torch.nn.init.xavier_uniform_
    if config.hybrid_layer_pattern is not None:  # one residual branch per layer: Megatron's std / sqrt(L)
        return (init_method_normal(config.init_method_std),
                init_method_normal(config.init_method_std / math.sqrt(config.num_layers)))
    return (init_method_normal(config.init_method_std),
            scaled_init_method_normal(config.init_method_std, config.num_layers))


def keyed_uniform(param: torch.Tensor) -> torch.Tensor:
    """U(0, 1) values of ``param``'s (whole) shape, fp32 on the CPU: the counter-based standard normal keyed by the
    parameter's name (as the mpu layers draw theirs) mapped through the normal CDF. A function of the seed and the
    name only, so a replicated parameter initialised from it (A_log, dt_bias, a short convolution) is the same at
    every TP x PP x ZeRO layout; drawn in fp32 whatever the parameter's dtype, so a bf16 parameter and ZeRO's fp32
    copy of it round the same values."""
    z = InitSpec("normal", tuple(param.shape), std=1.0).draw(param_draw_key(param), 0, param.numel())
    return (0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))).view(param.shape)
