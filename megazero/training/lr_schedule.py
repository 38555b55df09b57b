"""Learning-rate schedule with Megatron's ``OptimizerParamScheduler`` semantics.

    step <= warmup:          lr = max_lr * step / warmup            (linear from 0)
    constant style:          lr = max_lr                            (after warmup)
    step > decay:            lr = min_lr
    otherwise, t = (step - warmup) / (decay - warmup):
        linear               lr = min_lr + (max_lr - min_lr) * (1 - t)
        cosine               lr = min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi t))

``decay`` is where the decay *ends*, counted from step 0 (warmup included), as in
Megatron. A "step" is whatever unit the caller counts: Megatron and ``from_config``
count samples (``step(global_batch_size)`` once per iteration), which keeps the
curve right if the batch size ever changes; iterations work the same way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from megazero.training.config import TrainConfig

__all__ = ["LRScheduler", "DECAY_STYLES"]

DECAY_STYLES = ("constant", "linear", "cosine")
_HYPER = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")


class LRScheduler:
    """Warmup + decay schedule; optionally drives an optimizer's ``param_groups[i]['lr']``.

    Each param group's lr is ``get_lr() * group.get('lr_mult', 1.0)`` (Megatron's knob
    for e.g. a smaller LR on some parameters).
    """

    def __init__(self, *, max_lr: float, min_lr: float = 0.0, warmup_steps: int = 0, decay_steps: int,
                 decay_style: str = "linear", num_steps: int = 0,
                 optimizer: Optional["torch.optim.Optimizer"] = None) -> None:
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
        if decay_steps < 1 or warmup_steps < 0:
            raise ValueError(f"need decay_steps >= 1 and warmup_steps >= 0, got {decay_steps}, {warmup_steps}")
        if warmup_steps > decay_steps:
            raise ValueError(f"warmup_steps ({warmup_steps}) exceeds decay_steps ({decay_steps}); the decay "
                             f"end is counted from step 0, warmup included")
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.decay_style = decay_style
        self.num_steps = int(num_steps)
        self.optimizer = optimizer
        self._apply()

    @classmethod
    def from_config(cls, config: "TrainConfig", optimizer: Optional["torch.optim.Optimizer"] = None) -> "LRScheduler":
        """The run's schedule in samples: call ``step(config.schedule.global_batch_size)`` per iteration."""
        s = config.schedule
        return cls(max_lr=config.optim.lr, min_lr=config.optim.min_lr, warmup_steps=s.lr_warmup_samples,
                   decay_steps=s.lr_decay_samples, decay_style=s.lr_decay_style, optimizer=optimizer)

    def get_lr(self, step: Optional[float] = None) -> float:
        """The learning rate at ``step`` (default: the current step)."""
        n = self.num_steps if step is None else step
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * float(n) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        t = float(n - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - t
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.min_lr + (self.max_lr - self.min_lr) * coeff

    @property
    def lr(self) -> float:
        return self.get_lr()

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` steps (samples or iterations); returns and applies the new lr."""
        self.num_steps += int(increment)
        return self._apply()

    def _apply(self) -> float:
        lr = self.get_lr()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the exact curve (plain Python values)."""
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.decay_style, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any], *, use_checkpoint_values: bool = False) -> None:
        """Resume at the checkpoint's step.

        By default the schedule's hyper-parameters must match the checkpoint's (a silent
        change of schedule on resume is a classic way to ruin a run); with
        ``use_checkpoint_values=True`` the checkpoint's values replace the current ones.
        """
        for key in _HYPER:
            if key not in state:
                continue
            if use_checkpoint_values:
                setattr(self, key, type(getattr(self, key))(state[key]))
            elif state[key] != getattr(self, key):
                raise ValueError(f"LR schedule {key} differs from the checkpoint: current {getattr(self, key)!r}, "
                                 f"checkpoint {state[key]!r}; restore the original flag or resume with "
                                 f"use_checkpoint_values=True to keep the checkpoint's schedule")
        self.num_steps = int(state["num_steps"])
        self._apply()
