"""The loop's stop policy: when a run ends, and whether it ended training or exited early."""

from __future__ import annotations

from typing import Optional

import torch

from megazero.config.train_config import TrainConfig
from megazero.training.loop.state import TrainState
from megazero.training.run_control import SignalFlag, exit_reason
from megazero.utils.output import rank_zero_logger

__all__ = ["StopPolicy"]

log = rank_zero_logger(__name__)


class StopPolicy:
    """Before an iteration: stop at ``--train-iters`` (or ``--train-samples``), with ``--skip-train``,
    or once ``--train-tokens`` are consumed; these end training (final save and evaluation follow).
    After an iteration: exit on a SIGTERM (``--exit-signal-handler``, agreed over ranks),
    ``--exit-duration-in-mins`` (agreed) or ``--exit-interval``; these save and exit without the
    final evaluation. ``reason`` says why it stopped early (None at ``--train-iters``).

    A context manager: the SIGTERM handler is installed while inside.
    """

    def __init__(self, config: TrainConfig, device: torch.device) -> None:
        self.schedule, self.device = config.schedule, device
        self.signals = SignalFlag(self.schedule.exit_signal_handler)
        self.reason: Optional[str] = None
        self.exited = False  # True after a planned exit (signal, duration, interval)

    def before_step(self, state: TrainState) -> bool:
        """True: no further iteration."""
        s = self.schedule
        if state.iteration >= s.train_iters or s.skip_train:
            return True
        if s.train_tokens is not None and state.tokens >= s.train_tokens:
            self.reason = f"--train-tokens {s.train_tokens} reached"
            log.info(f"> stopping at iteration {state.iteration}: {state.tokens:,} tokens consumed, "
                     f"--train-tokens {s.train_tokens:,} reached")
            return True
        return False

    def after_step(self, state: TrainState) -> bool:
        """True: exit after this iteration (every rank decides alike)."""
        reason = exit_reason(self.schedule, state.iteration, self.signals, state.start_time, self.device)
        if reason is None:
            return False
        self.reason, self.exited = reason, True
        return True

    def announce(self, state: TrainState) -> None:
        log.info(f"exiting at iteration {state.iteration} after {self.reason}")

    @property
    def ends_training(self) -> bool:
        """Whether the run reached the end of training (not a planned exit)."""
        return not self.exited

    def close(self) -> None:
        self.signals.restore()

    def __enter__(self) -> "StopPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
