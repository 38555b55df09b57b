"""The ZeRO engine's optimizer: which kernel runs, and its step count, whatever the kernel.

Kernel choice (:func:`build_optimizer`) is the optimizer component's (``megazero/zero/optimizers/``:
Adam's picks apex's FusedAdam or torch's fused kernel by device), over the engine's fp32 master
partitions.

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
    """The elementwise kernel of ``oc``'s component (``oc``: an ``OptimizerConfig``) over
    ``param_groups``, whose tensors live on ``device``. ``mixed_devices``: some masters are on the
    host (optimizer offload)."""
    return oc.component.build(param_groups, oc, torch.device(device), mixed_devices)


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
    SGD and kernels that say ``counts_steps = False`` keep no step count and are left alone.
    """
    if isinstance(optimizer, torch.optim.SGD) or not getattr(optimizer, "counts_steps", True):
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
