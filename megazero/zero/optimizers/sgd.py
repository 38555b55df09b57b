"""SGD with momentum (Megatron's ``--optimizer sgd``): torch's SGD over the flat fp32 shards, weight decay
added to the gradient (coupled L2, as Megatron's)."""

from __future__ import annotations

import dataclasses

import torch

from .base import Optimizer, OptimizerConfig, ZeroConfigError, register

__all__ = ["SGD", "SGDSettings"]


@dataclasses.dataclass(frozen=True)
class SGDSettings:
    """``--sgd-momentum``."""

    momentum: float = 0.9

    def validate(self) -> "SGDSettings":
        if not 0 <= self.momentum < 1:
            raise ZeroConfigError(f"--sgd-momentum must be in [0, 1), got {self.momentum}")
        return self


class SGD(Optimizer):
    name, aliases, cli_names = "SGD", ("sgd",), ("sgd",)
    params = ("lr", "weight_decay", "momentum")
    summary = "sgd (--sgd-momentum)"
    json_flags = {"momentum": ("sgd_momentum", "--sgd-momentum")}

    def state_keys(self, oc, matrix=False):
        return ("momentum_buffer",) if oc.momentum else ()  # torch's SGD keeps no buffer without momentum

    def state_stats(self):
        return (("momentum", lambda s: s.get("momentum_buffer")),)

    def default_config(self):
        return OptimizerConfig(type="SGD", momentum=SGDSettings().momentum)

    def check(self, oc):
        if not 0.0 <= float(oc.momentum or 0.0) < 1.0:
            raise ZeroConfigError(f"optimizer.params.momentum must be in [0, 1), got {oc.momentum}")

    def build(self, param_groups, oc, device, mixed_devices):
        return torch.optim.SGD(param_groups, lr=oc.lr, momentum=oc.momentum or 0.0,
                               foreach=torch.device(device).type != "cuda" or None)

    def add_flags(self, g):
        g("honoured", "--sgd-momentum", "momentum of --optimizer sgd", float, default=0.9)

    def flag_dests(self):
        return ("sgd_momentum",)

    def settings(self, ns):
        given = getattr(ns, "sgd_momentum", None)
        return SGDSettings(*(() if given is None else (float(given),))).validate()

    def engine_config(self, o, params):
        # the JSON's Adam-only params do not apply; its momentum came in as --sgd-momentum
        momentum = (o.settings or SGDSettings()).momentum
        return OptimizerConfig(type="SGD", lr=o.lr, momentum=momentum, weight_decay=o.weight_decay)

    def describe(self, o):
        return f"SGD momentum {(o.settings or SGDSettings()).momentum}"


register(SGD())
