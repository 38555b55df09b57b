"""What the training loop's components share: the run's position (:class:`TrainState`), one
iteration's outcome (:class:`StepResult`) and the hooks a caller adds (:class:`Callback`)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from megazero.training.step import TrainModel

__all__ = ["TrainState", "StepResult", "Callback", "Callbacks"]


@dataclasses.dataclass
class TrainState:
    """Where the run stands. The loop alone advances it; the components read it."""

    iteration: int = 0  # iterations completed (including those of the run it resumed)
    consumed_samples: int = 0
    tokens: int = 0  # no curriculum: every sample is seq_length tokens
    batch_size: int = 0  # the global batch of the latest iteration
    start_time: float = dataclasses.field(default_factory=time.time)  # time.time() when the run began

    def advance(self, batch_size: int, seq_length: int) -> None:
        """One iteration of ``batch_size`` samples is done."""
        self.iteration += 1
        self.consumed_samples += batch_size
        self.tokens += batch_size * seq_length
        self.batch_size = batch_size


@dataclasses.dataclass
class StepResult:
    """One training iteration's outcome, as the step returned it."""

    # This rank's figures by name (TrainModel.metric_names: 'lm loss' first), still on the device: the
    # sum over stages and DP mean reach the host at the log interval.
    metrics: dict[str, torch.Tensor]
    updated: bool  # False when fp16 loss scaling skipped the update
    batch_size: int

    @property
    def loss(self) -> torch.Tensor:
        """This rank's LM loss on the device (the last stage's; 0 elsewhere)."""
        return self.metrics["lm loss"]


class Callback:
    """Hooks into :func:`megazero.training.trainer.pretrain`, called on every rank; each default does nothing.

    A hook that raises stops the run as an error inside the loop would (every rank must then
    raise alike, or the failure protocol must carry it). The ``state`` handed to a hook is the
    loop's own: read it, do not change it.
    """

    def on_load(self, loaded: dict) -> None:
        """A checkpoint was read: its train state (``iteration``, ``consumed_samples``, ``lr_scheduler``,
        ``resharded``, ``scaler_note`` where the loss scaler started afresh)."""

    def on_train_start(self, state: TrainState, run: "TrainModel") -> None:
        """The model is built and the checkpoint loaded; the first iteration comes next."""

    def on_step_start(self, state: TrainState, batches: list[dict]) -> None:
        """This iteration's batches are read; its step comes next (``state.iteration`` is the previous one)."""

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        """The step of ``state.iteration`` is done and counted; its log line, evaluation and save come next."""

    def on_save_written(self, directory: str) -> None:
        """This rank wrote its files of a checkpoint into ``directory`` (its ``.partial`` name), not yet
        committed. Raising here fails the save on every rank; the previous checkpoint stays in force."""

    def on_save(self, path: str) -> None:
        """The checkpoint ``path`` is committed (``latest`` points at it unless it is a debug copy)."""


class Callbacks(Callback):
    """Several callbacks as one: each hook calls theirs in the order given."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)

    def on_load(self, loaded: dict) -> None:
        for c in self.callbacks:
            c.on_load(loaded)

    def on_train_start(self, state: TrainState, run: "TrainModel") -> None:
        for c in self.callbacks:
            c.on_train_start(state, run)

    def on_step_start(self, state: TrainState, batches: list[dict]) -> None:
        for c in self.callbacks:
            c.on_step_start(state, batches)

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        for c in self.callbacks:
            c.on_step_end(state, result)

    def on_save_written(self, directory: str) -> None:
        for c in self.callbacks:
            c.on_save_written(directory)

    def on_save(self, path: str) -> None:
        for c in self.callbacks:
            c.on_save(path)

