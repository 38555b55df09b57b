"""Loss scaling for fp16 with DeepSpeed's semantics.

Dynamic scaling starts at ``2**initial_scale_power``. An overflow skips the
step; the scale is halved (not below ``min_loss_scale``) once ``hysteresis``
overflows have been seen since the last growth (DeepSpeed's "delayed shift").
After ``loss_scale_window`` consecutive steps without overflow the scale
doubles and the hysteresis budget is restored.
"""

from __future__ import annotations

from typing import Optional

from .config import FP16Config

__all__ = ["LossScaler"]


class LossScaler:
    """Static (``loss_scale > 0``), dynamic (fp16) or identity (bf16/fp32) scaling."""

    def __init__(self, fp16: Optional[FP16Config]) -> None:
        self.dynamic = fp16 is not None and fp16.loss_scale == 0
        if fp16 is None:
            self.scale = 1.0
        elif fp16.loss_scale > 0:
            self.scale = float(fp16.loss_scale)
        else:
            self.scale = float(2 ** fp16.initial_scale_power)
        self.window = fp16.loss_scale_window if fp16 else 1000
        self.min_scale = fp16.min_loss_scale if fp16 else 1.0
        self.hysteresis = fp16.hysteresis if fp16 else 1
        self.consecutive_hysteresis = fp16.consecutive_hysteresis if fp16 else False
        self.cur_hysteresis = self.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Advance one step; ``overflow`` says whether this step's gradients had inf/nan."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.cur_hysteresis == 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iteration = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.hysteresis
                    self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "cur_hysteresis", "iteration", "last_overflow_iteration")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
