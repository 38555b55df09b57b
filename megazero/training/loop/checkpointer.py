"""The loop's checkpointer: where a run starts, and when and what it saves."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from megazero import mpu
from megazero.checkpoint.async_save import BackgroundSave, PendingSave, finish_write, writer_group
from megazero.checkpoint.formats import TorchDistFormat, format_to_load, format_to_save
from megazero.checkpoint.native import CheckpointError, checkpoint_dir, latest_iteration
from megazero.config.train_config import TrainConfig
from megazero.training.health import PhaseBoard
from megazero.training.health.watchdog import warn_if_save_near_timeout
from megazero.training.loop.state import Callback, TrainState
from megazero.training.lr_schedule import LRScheduler
from megazero.training.step import TrainModel
from megazero.utils.output import rank_zero_logger
from megazero.utils.phase_agreement import RunAborted, agree, attempt

__all__ = ["Checkpointer"]

log = rank_zero_logger(__name__)


class Checkpointer:
    """Loads the start of a run (``--load``, ``--pretrained-checkpoint``, ``--finetune``, ``--no-load-*``)
    and saves: every ``--save-interval`` iterations, at a planned exit (unless that iteration was just
    saved), at the end of training (unless ``latest`` is already that iteration), and a debug copy
    when the run diverges. Without ``--save`` it saves nothing but the debug copy (under ``./debug``).

    A checkpoint holds the engine's state, every rank's RNG, the train state (iteration, consumed
    samples, LR schedule), the config and the tokenizer's files. ``callbacks`` hear ``on_load``,
    ``on_save_written`` and ``on_save``.

    With ``--async-save`` a save into ``--save`` is staged (host copies of the rank's state, logged
    with their size) and written by a background thread while training goes on; at most one is in
    flight (the next save waits for it). Every iteration while it is in flight, one small all-reduce
    on the savers' gloo group asks whether every rank has written; then it is committed (``latest``
    moves) and ``on_save`` is heard. A planned exit, the end of training and a failure inside an
    iteration wait for it; ``on_save_written`` is then heard on the writer thread. A failed write
    stops every rank with that rank's message, ``latest`` left on the previous checkpoint.
    """

    def __init__(self, config: TrainConfig, run: TrainModel, scheduler: LRScheduler, tokenizer=None,
                 callbacks: Optional[Callback] = None, board: Optional[PhaseBoard] = None) -> None:
        self.config, self.run, self.scheduler, self.tokenizer = config, run, scheduler, tokenizer
        self.board = board or PhaseBoard()  # where the rank is, for the watchdog
        self.callbacks = callbacks or Callback()
        self.last_saved: Optional[int] = None  # the iteration of the latest save into --save
        self.in_flight: Optional[BackgroundSave] = None  # the background save not committed yet
        self._writers: Optional[list] = None  # [the background saves' gloo group], made at the first one
        ck = config.checkpoint
        self.format = format_to_save(ck.ckpt_format, config.model, ck.transformer_impl)  # what saves write

    # -- saving

    def after_step(self, state: TrainState) -> None:
        """Commit the background save once every rank has written it; save at every
        ``--save-interval``-th iteration."""
        self.poll()
        ck = self.config.checkpoint
        if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
            self.save(state)

    def on_exit(self, state: TrainState) -> None:
        """A planned exit (signal, duration, interval): save unless this iteration is saved already;
        the save in flight is committed before the run ends."""
        if self.config.checkpoint.save and self.last_saved != state.iteration:
            self.save(state)
        self.wait()

    def at_end(self, state: TrainState) -> None:
        """The end of training: save unless ``latest`` is this iteration (or training was skipped);
        the save in flight is committed before the run ends."""
        self.wait()
        save = self.config.checkpoint.save
        if (save and not self.config.schedule.skip_train and self.last_saved != state.iteration
                and latest_iteration(save) != state.iteration):
            self.save(state)
        self.wait()

    def poll(self) -> None:
        """Collective, every iteration while a background save is in flight (one small all-reduce on
        the savers' group): commit it once every rank has written."""
        if self.in_flight is not None and self.in_flight.ready():
            self.wait()

    def wait(self) -> None:
        """Collective: wait for the background save in flight (if any) and commit it."""
        pending = self.in_flight
        if pending is None:
            return
        self.board.enter("checkpoint save")
        t0 = time.perf_counter()
        self.in_flight = None  # a failed one is not waited for twice
        pending.wait()
        log.info(f"saved checkpoint {pending.pending.directory} (written in the background in "
                 f"{pending.write_seconds:.2f}s; {time.perf_counter() - t0:.2f}s waited and committed)")
        warn_if_save_near_timeout(self.config, pending.write_seconds)
        self.callbacks.on_save(pending.pending.directory)

    def settle(self) -> None:
        """Collective, on the way out of a failed iteration: commit the background save in flight; its own
        failure is logged, the iteration's failure stays the run's."""
        try:
            self.wait()
        except RunAborted as e:
            log.warning(f"the background checkpoint save in flight failed too: {e}")

    def save_debug(self, state: TrainState) -> str:
        """The current state into ``SAVE/debug`` (``./debug`` without ``--save``); its directory."""
        debug = os.path.join(self.config.checkpoint.save or ".", "debug")
        return self.save(state, save_dir=debug)

    def save(self, state: TrainState, save_dir: Optional[str] = None) -> str:
        """Collective: the checkpoint of ``state.iteration`` into ``save_dir`` (default ``--save``); with
        ``--async-save`` one into ``--save`` is staged and written in the background (its directory is
        returned; it is complete once committed)."""
        save = save_dir or self.config.checkpoint.save
        background = self.config.checkpoint.async_save and save_dir is None
        self.wait()  # at most one save in flight
        self.board.enter("checkpoint save")
        t0 = time.perf_counter()
        pending = self._stage(state, save, background)
        if save_dir is None:
            self.last_saved = state.iteration
        if background:
            self.in_flight = BackgroundSave(pending)
            log.info(f"staged checkpoint {pending.directory} in {time.perf_counter() - t0:.2f}s "
                     f"({pending.host_bytes / 2 ** 20:.1f} MiB of host memory per rank); writing it in the background")
            return pending.directory
        _, failure = attempt(pending.write)
        finish_write(pending, failure)
        seconds = time.perf_counter() - t0
        log.info(f"saved checkpoint {checkpoint_dir(save, state.iteration)} in {seconds:.2f}s")
        warn_if_save_near_timeout(self.config, seconds)
        self.callbacks.on_save(pending.directory)
        return pending.directory

    def _stage(self, state: TrainState, save: str, background: bool) -> PendingSave:
        """The save staged in the run's checkpoint format (``--ckpt-format``)."""
        kw = dict(train_state={"iteration": state.iteration, "consumed_samples": state.consumed_samples,
                               "lr_scheduler": self.scheduler.state_dict()},
                  config=self.config.to_dict(), tokenizer=self.tokenizer, pipeline=self.run.stage,
                  group=self._writer_group() if background else None)
        return self.format.stage(save, state.iteration, self.run.engine, **kw, copy=background,
                                 on_written=self.callbacks.on_save_written if background else self._written)

    def _writer_group(self):
        """Collective at the first background save: the gloo group the background saves poll and commit on."""
        if self._writers is None:
            self._writers = [writer_group()]
        return self._writers[0]

    def _written(self, partial: str) -> None:
        self.callbacks.on_save_written(partial)
        self.board.advance("files written")  # ranks still writing are behind the others

    # -- loading

    def load(self) -> tuple[int, int]:
        """``(iteration, consumed samples)`` where the run starts; the weights, optimizer, RNG and LR
        schedule restored as the flags ask."""
        ck, engine = self.config.checkpoint, self.run.engine
        self.board.enter("checkpoint load")
        fresh_rng = mpu.get_rng_tracker().get_states()
        fresh_cpu_rng = torch.get_rng_state()
        if ck.load:
            agree("checkpoint load", lambda: _refuse_foreign_checkpoint(ck.load))
        state = None
        if ck.load:  # --finetune / --no-load-optim read the weights only (any optimizer may have saved them)
            state = format_to_load(ck.load, self.config.model, ck.transformer_impl).load(
                ck.load, engine, iteration=ck.ckpt_step, pipeline=self.run.stage,
                load_optimizer=not (ck.finetune or ck.no_load_optim), finetune=ck.finetune)
        if state is None and ck.pretrained:
            _init_from_pretrained(engine, ck.pretrained)
        if state is None:
            if ck.load:
                log.info(f"> no checkpoint in {ck.load}: starting from "
                         + ("the pretrained weights" if ck.pretrained else "scratch"))
            return 0, 0
        self.callbacks.on_load(state)
        if ck.finetune or ck.no_load_optim:
            # Megatron's --finetune / --no-load-optim: keep the loaded weights, start the optimizer afresh.
            engine.optimizer.state.clear()
        if ck.finetune or ck.no_load_rng:
            torch.set_rng_state(fresh_cpu_rng)
            mpu.get_rng_tracker().set_states(fresh_rng)
        if state.get("scaler_note"):
            log.info(f"> {state['scaler_note']}")
        if ck.finetune:
            log.info(f"> --finetune: weights from iteration {state['iteration']} of {ck.load}; iteration, "
                     f"samples, optimizer and RNG start afresh")
            return 0, 0
        try:
            s = self.config.schedule
            if state["lr_scheduler"] is not None:  # None: a Megatron-LM checkpoint read without its optimizer
                self.scheduler.load_state_dict(state["lr_scheduler"],
                                               use_checkpoint_values=s.use_checkpoint_opt_param_scheduler,
                                               override=s.override_opt_param_scheduler)
        except ValueError as e:  # a changed schedule on resume: say so instead of a traceback
            raise CheckpointError(str(e)) from None
        log.info(f"> resumed from iteration {state['iteration']} ({state['consumed_samples']} samples)"
                 + (" with a new layout" if state["resharded"] else ""))
        return state["iteration"], state["consumed_samples"]


def _refuse_foreign_checkpoint(load: str) -> None:
    """A Megatron-LM or Megatron-DeepSpeed directory in --load: say what it is and how to convert it,
    instead of finding no megazero checkpoint there and silently starting from scratch."""
    from megazero.checkpoint.megatron_legacy import detect_foreign_checkpoint

    if TorchDistFormat.holds(load):
        return  # read as it is
    message = detect_foreign_checkpoint(load)
    if message is not None:
        raise CheckpointError(message)


def _init_from_pretrained(engine, directory: str) -> None:
    """Start from full weights (e.g. an imported Hugging Face model); each rank reads only its rows
    (a pipeline stage only its own layers: the engine names them as at pp = 1)."""
    from megazero.zero.checkpoint import load_full_weights_file

    path = os.path.join(directory, "model_full.safetensors")
    agree("pretrained weights load", lambda: load_full_weights_file(engine, path))
    log.info(f"> initialized the weights from {path}")
