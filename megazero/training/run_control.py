"""Run control pieces of the training loop: SIGTERM save-and-exit, agreeing on a stop across ranks,
the per-iteration micro-batch count under batch ramp-up, and the per-phase wall clock."""

from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["SignalFlag", "any_rank", "PhaseClock", "exit_reason"]


class SignalFlag:
    """--exit-signal-handler: remember a SIGTERM; the loop agrees on it across ranks each iteration
    (a cluster may signal only some ranks) and then saves and exits, as Megatron's handler does."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle) if enabled else None
        self.enabled = enabled

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)
            self.enabled = False


def any_rank(flag: bool, device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


class PhaseClock:
    """Wall time per phase (DeepSpeed's wall_clock_breakdown); a no-op without a ``timers`` dict."""

    def __init__(self, timers: Optional[dict], device) -> None:
        self.timers, self.device = timers, device
        self.t = time.perf_counter() if timers is not None else 0.0

    def lap(self, name: str) -> None:
        if self.timers is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.timers[name] = self.timers.get(name, 0.0) + now - self.t
        self.t = now


def exit_reason(schedule, iteration: int, signals: "SignalFlag", train_start: float, device) -> Optional[str]:
    """Why the run should stop after ``iteration`` (agreed over ranks where it can differ), or None:
    a SIGTERM (--exit-signal-handler), --exit-duration-in-mins, --exit-interval."""
    s = schedule
    if s.exit_signal_handler and any_rank(signals.received, device):
        return "a SIGTERM (--exit-signal-handler)"
    if s.exit_duration_in_mins is not None and any_rank((time.time() - train_start) / 60.0 > s.exit_duration_in_mins,
                                                         device):
        return f"--exit-duration-in-mins {s.exit_duration_in_mins:g}"
    if s.exit_interval and iteration % s.exit_interval == 0:
        return f"--exit-interval {s.exit_interval}"
    return None
