"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), elementwise over the flat fp32
shards: ``p <- p * (1 - lr * wd)``; ``p <- p - lr * sign(beta1 * m + (1 - beta1) * g)``;
``m <- beta2 * m + (1 - beta2) * g`` (decoupled weight decay first, as lion-pytorch and optax). One state
tensor, ``exp_avg`` (m). ``--optimizer lion`` with ``--lion-beta1/--lion-beta2``, or DeepSpeed's
``"optimizer": {"type": "Lion", "params": {"lr", "betas", "weight_decay"}}``; betas default to (0.9, 0.99)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .base import Optimizer, OptimizerConfig, ZeroConfigError, parse_optimizer, register

__all__ = ["Lion", "LionKernel", "LionSettings"]


class LionKernel(torch.optim.Optimizer):
    """Lion's update of the tensors that carry a ``.grad``; it counts no steps (no bias correction)."""

    counts_steps = False

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m, g = state["exp_avg"], p.grad
                p.mul_(1 - lr * wd)
                p.add_(m.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)


@dataclasses.dataclass(frozen=True)
class LionSettings:
    """``--lion-beta1``/``--lion-beta2`` (None: the DeepSpeed JSON's betas, else 0.9 and 0.99)."""

    beta1: Optional[float] = None
    beta2: Optional[float] = None


class Lion(Optimizer):
    name, aliases, cli_names = "Lion", ("lion",), ("lion",)
    params = ("lr", "betas", "weight_decay")
    summary = "lion (the sign of an interpolated momentum; --lion-beta1/--lion-beta2)"
    param_defaults = {"betas": (0.9, 0.99)}
    json_flags = {"betas.0": ("lion_beta1", "--lion-beta1"), "betas.1": ("lion_beta2", "--lion-beta2")}

    def state_keys(self, oc, matrix=False):
        return ("exp_avg",)

    def state_stats(self):
        return (("momentum", lambda s: s.get("exp_avg")),)

    def check(self, oc):
        if not all(0.0 <= b < 1.0 for b in oc.betas):
            raise ZeroConfigError(f"Lion's betas must be in [0, 1), got {oc.betas}")

    def build(self, param_groups, oc, device, mixed_devices):
        return LionKernel(param_groups, lr=oc.lr, betas=oc.betas)

    def add_flags(self, g):
        # No default in the flag: unset, the DeepSpeed JSON's betas apply, else (0.9, 0.99).
        g("honoured", "--lion-beta1", "Lion's beta1, the update's interpolation (unset: the DeepSpeed JSON's "
          "betas[0], else 0.9)", float)
        g("honoured", "--lion-beta2", "Lion's beta2, the momentum's decay (unset: the DeepSpeed JSON's betas[1], "
          "else 0.99)", float)

    def flag_dests(self):
        return ("lion_beta1", "lion_beta2")

    def settings(self, ns):
        return LionSettings(getattr(ns, "lion_beta1", None), getattr(ns, "lion_beta2", None))

    def engine_config(self, o, params):
        oc = parse_optimizer(o.type, {k: v for k, v in params.items() if k in self.params})
        s = o.settings or LionSettings()
        betas = (oc.betas[0] if s.beta1 is None else s.beta1, oc.betas[1] if s.beta2 is None else s.beta2)
        oc = dataclasses.replace(oc, lr=o.lr, weight_decay=o.weight_decay, betas=betas, settings=s)
        self.check(oc)
        return oc

    def describe(self, o):
        s, defaults = o.settings or LionSettings(), self.param_defaults["betas"]
        shown = [f"{d:g} unless the DeepSpeed JSON sets it" if v is None else f"{v:g}"
                 for v, d in zip((s.beta1, s.beta2), defaults)]
        return f"Lion betas ({shown[0]}, {shown[1]})"


register(Lion())
