"""The loop's failure protocol: a failure inside an iteration stops every rank together, and a run
that diverges stops with its state saved for debugging."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from megazero.config.train_config import TrainConfig
from megazero.training.loop.checkpointer import Checkpointer
from megazero.training.loop.data import take
from megazero.training.loop.metrics_logger import MetricsLogger
from megazero.training.loop.state import TrainState
from megazero.training.step import TrainModel
from megazero.utils.phase_agreement import Failure, attempt, conclude, failure_of

__all__ = ["TrainingDiverged", "FailureProtocol"]


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient outside fp16 loss scaling."""


class FailureProtocol:
    """An iteration's data read is attempted on this rank alone (an agreement per iteration would
    cost a collective and a host synchronisation): a rank whose read fails flags it into the step's
    own all-reduce and steps on zeros, so no rank updates, and after the step every rank concludes
    together with the failing rank's message (``failures.py``). An offload read or write that failed
    during the step concludes the same way.

    Outside fp16 (whose loss scaler skips such steps), a non-finite gradient or loss stops the run:
    the current state is saved (``Checkpointer.save_debug``) and :class:`TrainingDiverged` names the
    iteration. With ``--no-check-for-nan-in-loss-and-grad`` the run goes on: the engine skipped the
    step, and the log line counts it among the skipped iterations.
    """

    def __init__(self, config: TrainConfig, run: TrainModel, checkpointer: Checkpointer) -> None:
        self.config, self.run, self.checkpointer = config, run, checkpointer
        self.failure: Failure | None = None  # this rank's failed read of the current iteration
        # a non-finite loss or gradient stops the run, but not under fp16 (its scaler skips the step) nor with the check off
        self.stops_on_nan = config.precision.dtype != "fp16" and config.schedule.check_for_nan_in_loss_and_grad

    def read(self, it: Iterator, n: int, state: TrainState) -> list[dict]:
        """The next iteration's ``n`` micro-batches, without an agreement of their own."""
        batches, self.failure = attempt(lambda: take(it, n), user_errors=(ValueError,))
        if self.failure is not None:
            self.run.engine.flag_failure()
            shape = (self.config.schedule.micro_batch_size, self.config.model.seq_length + 1)
            return [{"text": torch.zeros(shape, dtype=torch.int64)} for _ in range(n)]
        if batches is None:
            raise RuntimeError(f"the training data ran out at iteration {state.iteration + 1} "
                               f"({state.consumed_samples} samples)")
        return batches

    def after_step(self) -> None:
        """Every rank knows from the step's all-reduce whether any failed: if so, all conclude together."""
        engine = self.run.engine
        if engine.failed_ranks:
            phase, failure = "training data read", self.failure
            if failure is None and engine.deferred_failure is not None:  # an offload read or write
                phase, error = engine.deferred_failure
                failure = failure_of(error)
            self.checkpointer.settle()  # every rank is here: the background save in flight is committed
            conclude(phase, failure)
        self.failure = None

    def check_update(self, state: TrainState, metrics: MetricsLogger) -> None:
        """The step of ``state.iteration`` overflowed outside fp16: stop, unless the check is off (every
        rank takes part in bringing the losses to the host; the loss is for the message)."""
        if self.run.engine.last_overflow and self.stops_on_nan:
            loss = metrics.drain().get(state.iteration, {}).get("lm loss", float("nan"))
            raise self.diverged(state, state.iteration, "gradients" if math.isfinite(loss) else "loss", loss)

    def check_loss(self, state: TrainState, iteration: int, loss: float) -> None:
        """A loss on the host: non-finite outside fp16 stops the run (unless the check is off)."""
        if not math.isfinite(loss) and self.stops_on_nan:
            raise self.diverged(state, iteration, "loss", loss)

    def diverged(self, state: TrainState, iteration: int, what: str, loss: float) -> TrainingDiverged:
        """Save the current state (``state.iteration``) for debugging; ``iteration`` is where it went non-finite."""
        path = self.checkpointer.save_debug(state)
        return TrainingDiverged(
            f"non-finite {what} at iteration {iteration} (loss {loss}); state saved to {path} "
            "for debugging. Lower --lr, raise --clip-grad or check the data of this iteration.")
