"""How a GPT's weights are drawn: the init functions of ordinary weights and of residual outputs."""

from __future__ import annotations

import torch

from megazero.mpu.initializers import init_method_normal, scaled_init_method_normal

from .config import GPTConfig

__all__ = ["init_methods"]


def init_methods(config: GPTConfig):
    """``(init, output_init)``: for ordinary weights and for the residual-output projections
    (linear_proj, linear_fc2). Both draw from the full weight's shape (TP-invariant)."""
    if config.init_method == "xavier_uniform":
        return torch.nn.init.xavier_uniform_, torch.nn.init.xavier_uniform_
    return (init_method_normal(config.init_method_std),
            scaled_init_method_normal(config.init_method_std, config.num_layers))
