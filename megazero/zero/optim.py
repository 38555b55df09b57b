"""The ZeRO engine's optimizer: which kernel runs, and its step count, whatever the kernel.

Kernel choice (:func:`build_optimizer`), over the engine's fp32 master partitions:

* ``SGD``: torch's SGD (foreach off the GPU).
* Adam on CUDA masters: NVIDIA apex's multi-tensor ``FusedAdam`` when apex is installed
  *and usable*, else torch's fused AdamW/Adam. An apex installed without its CUDA
  extensions imports fine and raises ``RuntimeError`` ("requires cuda extensions") only
  when ``FusedAdam`` is constructed, so any exception there falls back to torch.
* Adam on CPU masters: torch's fused AdamW/Adam (one pass per tensor, no temporaries: about
  5x the foreach kernel on a 32M-element shard here, and foreach allocates a shard-sized
  temporary at the step). It is elementwise, so a flat shard steps bit-identically to the
  same parameters stepped one by one with ``torch.optim.AdamW(fused=True)``; it differs from
  torch's default CPU kernel (for-loop) by ~1e-7 per step. apex is never tried (its kernels
  are CUDA-only).
* Meta masters (a rehearsal, ``megazero/observe/rehearsal.py``): the for-loop kernel, whose
  temporaries (one unit's partition at a time) are closest to a fused kernel's none.

The kernel and the reason it was chosen are logged once per process (first rank only): INFO, or
WARNING when apex is installed but unusable.

Step count (:func:`optimizer_step`, :func:`set_optimizer_step`): Adam's bias correction
depends on how many steps were taken. torch keeps that count per parameter in
``state[p]["step"]`` (a tensor, on the device for fused/capturable kernels); apex's
``FusedAdam`` (and DeepSpeed's copy of it) keeps it per parameter group in
``param_group["step"]`` and has no ``state["step"]``. A checkpoint stores one number; these
two functions read it from either place and write it back where the kernel reads it, so a
resume continues bias correction instead of restarting it at step 1.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.distributed as dist

from .optimizers import SGD, Muon

__all__ = ["build_optimizer", "optimizer_step", "set_optimizer_step", "keeps_step_in_group", "say_once"]

# Packages whose Adam-family kernels count steps in ``param_group["step"]`` (apex's FusedAdam,
# FusedLAMB, ...; DeepSpeed's FusedAdam is apex's). Used only before the first step, when
# neither place holds a count yet.
_GROUP_STEP_PACKAGES = ("apex", "deepspeed")
logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)  # the cache is what makes it once per process
def say_once(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` at ``level`` once per process, on the first rank only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message)


def build_optimizer(param_groups: list[dict], oc, device: torch.device, *,
                    mixed_devices: bool = False) -> torch.optim.Optimizer:
    """The optimizer of ``oc`` (an ``OptimizerConfig``) over ``param_groups``, whose tensors
    live on ``device``; for Adam, apex's FusedAdam on CUDA when it works, torch's otherwise.
    ``mixed_devices``: some masters are on the host (optimizer offload): torch's fused kernel,
    which groups tensors by device (apex's takes CUDA tensors only)."""
    device = torch.device(device)
    c = oc.component
    if isinstance(c, SGD):  # Megatron's SGD: weight decay added to the gradient (coupled L2)
        return torch.optim.SGD(param_groups, lr=oc.lr, momentum=oc.momentum or 0.0,
                               foreach=device.type != "cuda" or None)
    kwargs = dict(lr=oc.lr, betas=oc.betas, eps=oc.eps)
    # Muon's elementwise parameters take the auxiliary AdamW (its matrices are listed but carry no
    # .grad at this kernel's step: the engine steps them, megazero/zero/muon.py)
    torch_cls = torch.optim.AdamW if oc.adam_w_mode or isinstance(c, Muon) else torch.optim.Adam
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


def _state_step(optimizer: torch.optim.Optimizer) -> Optional[int]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                return int(state["step"])
    return None


def _group_step(optimizer: torch.optim.Optimizer) -> Optional[int]:
    for group in optimizer.param_groups:
        if "step" in group:
            return int(group["step"])
    return None


def keeps_step_in_group(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` counts its steps in ``param_group["step"]`` (apex) rather than in
    ``state[p]["step"]`` (torch). Where a count already exists decides; before the first step
    the kernel's package does."""
    if _group_step(optimizer) is not None:
        return True
    if _state_step(optimizer) is not None:
        return False
    return type(optimizer).__module__.split(".")[0] in _GROUP_STEP_PACKAGES


def optimizer_step(optimizer: torch.optim.Optimizer) -> int:
    """The number of steps ``optimizer`` has taken (0 before the first, and for SGD)."""
    step = _state_step(optimizer)
    if step is None:
        step = _group_step(optimizer)
    return step or 0


def set_optimizer_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Make ``optimizer`` continue from ``step`` steps, written where its kernel reads it.

    For torch's per-parameter count only parameters whose state was restored get one (a
    parameter without state starts afresh: torch would otherwise skip creating its moments).
    SGD keeps no step count and is left alone.
    """
    if isinstance(optimizer, torch.optim.SGD):
        return
    groups = [g for g in optimizer.param_groups if not g.get("per_matrix")]  # Muon's matrices count no steps
    if keeps_step_in_group(optimizer):
        for group in groups:
            group["step"] = int(step)
        return
    on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for group in groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:  # torch's fused/capturable kernels keep the count on the parameter's device
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu")
