"""Uniform draws for the recurrent layers' small weights, keyed like every other weight.

megazero draws a weight counter-based, keyed by its name (``mpu.initializers``), so a model is a function of the
seed whatever its layout. Those draws are normal; :func:`uniform_` maps a keyed standard normal through its
CDF to U(lo, hi), so the decay rates, time steps and convolution taps are as layout-free as the matrices.
"""

from __future__ import annotations

import math

import torch

from megazero.mpu.initializers import NormalInit, param_draw_key, spec_for

__all__ = ["uniform_"]


@torch.no_grad()
def uniform_(param: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Fill a replicated ``param`` with U(lo, hi): its own keyed N(0, 1) draw (by name where the engine names
    parameters) mapped through Phi, in fp32, then cast."""
    z = spec_for(tuple(param.shape), 0, 0, 1, NormalInit(1.0)).draw(param_draw_key(param), 0, param.numel())
    u = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    return param.copy_((lo + (hi - lo) * u).view(param.shape).to(param.dtype))
