"""Adam and AdamW (Megatron's ``--optimizer adam`` is decoupled, i.e. AdamW; DeepSpeed's "Adam" too unless
``adam_w_mode`` is false), elementwise over the flat fp32 shards.

Kernel choice, over the engine's fp32 master partitions:

* CUDA masters: NVIDIA apex's multi-tensor ``FusedAdam`` when apex is installed *and usable*, else
  torch's fused AdamW/Adam. An apex installed without its CUDA extensions imports fine and raises
  ``RuntimeError`` ("requires cuda extensions") only when ``FusedAdam`` is constructed, so any
  exception there falls back to torch.
* CPU masters (or some on the host: optimizer offload): torch's fused AdamW/Adam (one pass per tensor,
  no temporaries: about 5x the foreach kernel on a 32M-element shard here, and foreach allocates a
  shard-sized temporary at the step). It is elementwise, so a flat shard steps bit-identically to the
  same parameters stepped one by one with ``torch.optim.AdamW(fused=True)``; it differs from torch's
  default CPU kernel (for-loop) by ~1e-7 per step. apex is never tried (its kernels are CUDA-only).
* Meta masters (a rehearsal, ``megazero/observe/rehearsal.py``): the for-loop kernel, whose
  temporaries (one unit's partition at a time) are closest to a fused kernel's none.

The kernel and the reason it was chosen are logged once per process (first rank only): INFO, or
WARNING when apex is installed but unusable.
"""

from __future__ import annotations

import logging

import torch

from ..optim import say_once
from .base import Optimizer, OptimizerConfig, register

__all__ = ["Adam"]


class Adam(Optimizer):
    name, aliases, cli_names = "AdamW", ("adamw", "adam", "fusedadam"), ("adam", "adamw")
    params = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam")
    summary = "adam (decoupled weight decay, i.e. AdamW, as Megatron's), adamw"
    host_step = True

    param_hints = {"momentum": "; Adam's momentum is betas[0]"}

    def spelled_params(self, spelled):
        # DeepSpeed: "Adam" is AdamW unless adam_w_mode is false; "AdamW" is always decoupled
        return {"adam_w_mode": True} if str(spelled).lower() == "adamw" else {}

    def type_name(self, spelled):
        return str(spelled)  # Adam keeps the file's spelling

    def state_keys(self, oc, matrix=False):
        return ("exp_avg", "exp_avg_sq")

    def state_stats(self):
        # Megatron-DeepSpeed's --log-optimizer-states-to-tensorboard names
        return (("momentum", lambda s: s.get("exp_avg")),
                ("variance", lambda s: s.get("exp_avg_sq")),
                ("variance_sqrt", lambda s: s["exp_avg_sq"].sqrt() if "exp_avg_sq" in s else None))

    def decoupled(self, oc: OptimizerConfig) -> bool:
        """Whether the weight decay is decoupled (AdamW)."""
        return oc.adam_w_mode

    def build(self, param_groups, oc, device, mixed_devices):
        device = torch.device(device)
        kwargs = dict(lr=oc.lr, betas=oc.betas, eps=oc.eps)
        torch_cls = torch.optim.AdamW if self.decoupled(oc) else torch.optim.Adam
        if device.type == "meta":
            return torch_cls(param_groups, foreach=False, **kwargs)
        if device.type != "cuda" or mixed_devices:
            return torch_cls(param_groups, fused=True, **kwargs)
        try:  # apex's multi-tensor Adam, when NVIDIA apex is installed with its CUDA extensions
            from apex.optimizers import FusedAdam

            # Copies: the Optimizer base fills defaults into the group dicts before apex can fail.
            opt = FusedAdam([dict(g) for g in param_groups], adam_w_mode=oc.adam_w_mode, **kwargs)
        except Exception as e:  # ImportError (no apex), RuntimeError (apex without CUDA extensions), ...
            why = f"apex FusedAdam is unusable ({type(e).__name__}: {e})"
            level = logging.INFO if isinstance(e, ImportError) else logging.WARNING
        else:
            say_once("optimizer: apex FusedAdam (apex is installed with its CUDA extensions)", logging.INFO)
            return opt
        say_once(f"optimizer: torch {torch_cls.__name__}(fused=True), because {why}", level)
        return torch_cls(param_groups, fused=True, **kwargs)


register(Adam())
