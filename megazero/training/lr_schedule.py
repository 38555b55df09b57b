"""Learning-rate schedule with Megatron's ``OptimizerParamScheduler`` semantics.

    step <= warmup:          lr = init + (max_lr - init) * step / warmup   (linear from --lr-warmup-init)
    constant style:          lr = max_lr                            (after warmup)
    step > decay:            lr = min_lr
    inverse-square-root:     lr = max(min_lr, max_lr * sqrt(max(warmup, 1)) / sqrt(max(step, 1)))
    otherwise, t = (step - warmup) / (decay - warmup):
        linear               lr = min_lr + (max_lr - min_lr) * (1 - t)
        cosine               lr = min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi t))
        WSD                  max_lr until decay - wsd, then over the last wsd steps, r = progress in [0, 1]:
                             coeff = 2 * 0.5**r - 1 (exponential) | 1 - r (linear) |
                             0.5 * (1 + cos(pi r)) (cosine) | 1 - sqrt(r) (minus_sqrt)

Weight decay (Megatron's ``get_wd``) over ``wd_incr_steps``: constant ``end_wd``, or from
``start_wd`` to ``end_wd`` linearly or by a half cosine; it is written into the optimizer's
decayed param groups (those with weight decay > 0 when the scheduler was built).

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

    from megazero.config.train_config import TrainConfig

__all__ = ["LRScheduler", "DECAY_STYLES"]

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")
_HYPER = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style", "init_lr", "wsd_decay_steps",
          "wsd_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


class LRScheduler:
    """Warmup + decay schedule; optionally drives an optimizer's ``param_groups[i]['lr']``.

    Each param group's lr is ``get_lr() * group.get('lr_mult', 1.0)`` (Megatron's knob
    for e.g. a smaller LR on some parameters).
    """

    def __init__(self, *, max_lr: float, min_lr: float = 0.0, warmup_steps: int = 0, decay_steps: int,
                 decay_style: str = "linear", num_steps: int = 0, init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, wsd_decay_style: str = "exponential",
                 start_wd: Optional[float] = None, end_wd: Optional[float] = None, wd_incr_steps: int = 1,
                 wd_incr_style: str = "constant",
                 optimizer: Optional["torch.optim.Optimizer"] = None) -> None:
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if wsd_decay_style not in WSD_STYLES or wd_incr_style not in WD_STYLES:
            raise ValueError(f"wsd_decay_style must be one of {WSD_STYLES} and wd_incr_style one of {WD_STYLES}")
        if decay_style == "WSD" and not (wsd_decay_steps and 0 < wsd_decay_steps <= decay_steps - warmup_steps):
            raise ValueError(f"WSD needs 0 < wsd_decay_steps <= decay_steps - warmup_steps, got {wsd_decay_steps}")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"a constant weight decay needs start_wd == end_wd, got {start_wd}, {end_wd}")
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
        self.init_lr = float(init_lr)
        self.wsd_decay_steps = None if wsd_decay_steps is None else int(wsd_decay_steps)
        self.wsd_decay_style = wsd_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = max(int(wd_incr_steps), 1), wd_incr_style
        self.optimizer = optimizer
        # The decayed groups are fixed when the scheduler is built: a weight decay scheduled
        # down to 0 must not turn them into "no decay" groups for good.
        self._decayed = [g for g in optimizer.param_groups if g.get("weight_decay", 0.0) > 0] if optimizer else []
        self._apply()

    @classmethod
    def from_config(cls, config: "TrainConfig", optimizer: Optional["torch.optim.Optimizer"] = None) -> "LRScheduler":
        """The run's schedule in samples: call ``step(config.schedule.global_batch_size)`` per iteration."""
        s, o = config.schedule, config.optim
        scheduled_wd = o.weight_decay_incr_style != "constant"
        return cls(max_lr=o.lr, min_lr=o.min_lr, warmup_steps=s.lr_warmup_samples,
                   decay_steps=s.lr_decay_samples, decay_style=s.lr_decay_style, init_lr=s.lr_warmup_init,
                   wsd_decay_steps=s.lr_wsd_decay_samples, wsd_decay_style=s.lr_wsd_decay_style,
                   start_wd=o.start_weight_decay if scheduled_wd else None,
                   end_wd=o.end_weight_decay if scheduled_wd else None,
                   wd_incr_steps=s.train_samples * (config.model.seq_length if s.lr_unit == "tokens" else 1),
                   wd_incr_style=o.weight_decay_incr_style, optimizer=optimizer)

    @staticmethod
    def increment(config: "TrainConfig", global_batch_size: int) -> int:
        """How far one iteration of ``global_batch_size`` samples moves the schedule (samples or tokens)."""
        return global_batch_size * (config.model.seq_length if config.schedule.lr_unit == "tokens" else 1)

    def get_lr(self, step: Optional[float] = None) -> float:
        """The learning rate at ``step`` (default: the current step)."""
        n = self.num_steps if step is None else step
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * float(n) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5)
        t = float(n - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - t
        elif self.decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * t))
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = float(n - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (1.0 + math.cos(math.pi * r)),
                         "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.wsd_decay_style]
        return self.min_lr + (self.max_lr - self.min_lr) * coeff

    def get_wd(self, step: Optional[float] = None) -> Optional[float]:
        """The scheduled weight decay at ``step`` (None: no weight-decay schedule)."""
        if self.end_wd is None:
            return None
        n = self.num_steps if step is None else step
        if n > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        r = float(n) / float(self.wd_incr_steps)
        coeff = r if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

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
            wd = self.get_wd()
            if wd is not None:
                for group in self._decayed:
                    group["weight_decay"] = wd * group.get("wd_mult", 1.0)
        return lr

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the exact curve (plain Python values)."""
        state = {key: getattr(self, key) for key in _HYPER}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict[str, Any], *, use_checkpoint_values: bool = False,
                        override: bool = False) -> None:
        """Resume at the checkpoint's step.

        By default the schedule's hyper-parameters must match the checkpoint's (a silent
        change of schedule on resume is a classic way to ruin a run); with
        ``use_checkpoint_values=True`` the checkpoint's values replace the current ones
        (--use-checkpoint-opt_param-scheduler); with ``override=True`` the current ones
        stand (--override-opt_param-scheduler). Only the position is always restored.
        """
        for key in _HYPER:
            if key not in state or override:
                continue
            if use_checkpoint_values:
                setattr(self, key, state[key])
            elif state[key] != getattr(self, key):
                raise ValueError(f"LR schedule {key} differs from the checkpoint: current {getattr(self, key)!r}, "
                                 f"checkpoint {state[key]!r}; restore the original flag or resume with "
                                 f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule, or "
                                 f"--override-opt_param-scheduler to take the new one")
        self.num_steps = int(state["num_steps"])
        self._apply()
