"""The loop's evaluator: the validation loss every ``--eval-interval`` iterations, and both held-out
splits at the end of training."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.config.train_config import TrainConfig
from megazero.training.health import PhaseBoard
from megazero.training.loop.data import loader, read_agreed
from megazero.training.loop.state import TrainState
from megazero.training.meters import EVAL_LOSS_KEY, MetricsWriter
from megazero.training.step import LossLog, TrainModel
from megazero.utils.output import rank_zero_logger
from megazero.utils.progress import Progress

__all__ = ["Evaluator", "evaluate"]

log = rank_zero_logger(__name__)


@torch.no_grad()
def evaluate(run: TrainModel, dataset, config: TrainConfig, eod: Optional[int] = None,
             split: str = "validation", on_batch: Optional[Callable[[], None]] = None) -> Optional[float]:
    """Mean loss over ``eval_iters`` global batches of ``dataset`` (always the same ones), forward
    only; None without a dataset or with ``--eval-iters 0``. Collective over all ranks. Rank 0 reports
    its progress (``megazero.utils.progress``: a bar on a terminal, a line every few seconds otherwise);
    the losses stay on the device until the end. ``on_batch()`` hears each evaluated batch."""
    s = config.schedule
    if dataset is None or s.eval_iters == 0:
        return None
    it = loader(dataset, 0, config, run.groups, run.device)
    losses = []
    with Progress("evaluated", total=s.eval_iters, unit=f"{split} batches", logger=log,
                  enabled=not dist.is_initialized() or dist.get_rank() == 0) as progress:
        for _ in range(s.eval_iters):
            batches = read_agreed(it, s.grad_accum_steps, "evaluation data read", partial=True) \
                if it is not None else None
            if not batches:
                break
            losses.append(run.eval_step(batches, eod))
            progress.update()
            if on_batch is not None:
                on_batch()
    if not losses:
        return None
    values = [v["lm loss"] for v in LossLog(run.groups).reduce(losses)]
    return sum(values) / len(values)


class Evaluator:
    """Evaluates every ``--eval-interval`` iterations on the validation split, and at the end of
    training (or with ``--skip-train``) on the validation and test splits, as Megatron does. Each
    result is logged (loss and perplexity) and written as a metrics record."""

    def __init__(self, config: TrainConfig, run: TrainModel, valid, test, eod: Optional[int],
                 writer: MetricsWriter, board: Optional[PhaseBoard] = None) -> None:
        self.board = board or PhaseBoard()  # where the rank is, for the watchdog
        self.config, self.run, self.valid, self.test, self.eod, self.writer = config, run, valid, test, eod, writer
        self.losses: dict[int, float] = {}  # iteration -> validation loss of the periodic evaluations
        self.final: dict[str, float] = {}  # 'valid' / 'test' -> loss at the end

    def after_step(self, state: TrainState) -> None:
        interval = self.config.schedule.eval_interval
        if interval and state.iteration % interval == 0:
            val = self._run(self.valid, state.iteration, "validation")
            if val is not None:
                self.losses[state.iteration] = val

    def at_end(self, state: TrainState) -> None:
        for label, dataset, name in (("validation", self.valid, "valid"), ("test", self.test, "test")):
            val = self._run(dataset, state.iteration, f"the end of training for {label} data:",
                            key=f"{name}_end_lm_loss", split=label)
            if val is not None:
                self.final[name] = val

    def _run(self, dataset, iteration: int, label: str, key: str = EVAL_LOSS_KEY,
             split: str = "validation") -> Optional[float]:
        self.board.enter("evaluation")
        val = evaluate(self.run, dataset, self.config, self.eod, split,
                       on_batch=lambda: self.board.advance(f"{self.board.now.steps + 1} batches evaluated"))
        if val is not None:
            ppl = math.exp(min(val, 50))
            log.info(f" {label} loss at iteration {iteration}: {val:.6E} | perplexity: {ppl:.4E}")
            self.writer.write(iteration, {"iteration": iteration, key: val, key.replace("lm_loss", "ppl"): ppl})
        return val
