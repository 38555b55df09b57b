"""The pre-training loop for ``--pp > 1``: the same run as :func:`trainer.pretrain`, every step through a pipeline.

What changes with a pipeline, as in Megatron: each rank builds only its stage's layers
(``build_pipeline_model``); a step's micro-batches all go through the 1F1B (or
interleaved) schedule of :class:`megazero.pipeline.PipelineStage` before the optimizer
steps, so gradient accumulation is the number of micro-batches per step; the loss exists
on the last stage only and is sent to the other stages (rank 0 prints the log line);
evaluation runs the pipeline forward only. Data sets, checkpoints, the LR schedule and the
log line are the trainer's own (imported, not copied); checkpoints name parameters as at
pp = 1, so they reload at any tp x pp x dp x ZeRO stage.
"""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from .. import mpu, zero
from ..model import num_parameters
from ..model.pipeline_split import build_pipeline_model
from ..pipeline import PipelineStage
from .arguments import pipeline_plan_line
from .checkpointing import CheckpointError, checkpoint_dir, latest_iteration, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .failures import agree
from .lr_schedule import LRScheduler
from .metrics import EVAL_LOSS_KEY, IntervalMeter, IterationStats, MetricsWriter, Throughput, format_log_line, memory_mb
from .run_control import SignalFlag, exit_reason, set_accumulation
from .trainer import (TrainingDiverged, TrainResult, _datasets, _loader, _print0, build_tokenizer_agreed,
                      megatron_no_weight_decay)

__all__ = ["pretrain_pipeline", "PipelineRun"]


class PipelineRun:
    """One rank's pipeline: groups, engine, stage; turns data-loader batches into pipeline micro-batches."""

    def __init__(self, config: TrainConfig, groups, device: torch.device) -> None:
        p = config.parallel
        self.config, self.groups, self.device = config, groups, device
        module, chunks = build_pipeline_model(config.model, groups, first=p.decoder_first_pipeline_num_layers,
                                              last=p.decoder_last_pipeline_num_layers, device="meta")
        self.engine = zero.initialize(module, config.to_deepspeed_config(), mpu=mpu,
                                      no_weight_decay=megatron_no_weight_decay, device=device)
        self.stage = PipelineStage(self.engine, chunks, groups, micro_batch_size=config.schedule.micro_batch_size,
                                   seq_length=config.model.seq_length)

    def _micro_batches(self, batches: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for b in batches:
            text = b["text"].to(self.device)
            out.append((text[:, :-1], text[:, 1:]))
        return out

    def _everywhere(self, losses: list[float]) -> float:
        """The last stage's mean micro-batch loss, averaged over DP, on every rank (Megatron logs it from
        the last stage; here every rank holds it so that divergence stops all of them together)."""
        value = sum(losses) / len(losses) if losses else 0.0
        t = torch.tensor([value if self.stage.is_last_stage else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.groups.pp_group)
        dist.all_reduce(t, group=self.groups.dp_group)
        return float(t) / self.groups.dp_size

    def train_step(self, batches: list[dict]) -> tuple[float, bool]:
        losses, updated = self.stage.train_step(self._micro_batches(batches))
        return self._everywhere(losses), updated

    def evaluate(self, dataset) -> Optional[float]:
        """Mean loss over ``eval_iters`` global batches (always the same ones), forward only through the pipeline."""
        s = self.config.schedule
        if dataset is None or s.eval_iters == 0:
            return None
        it = _loader(dataset, 0, self.config)
        batches = []
        try:
            for _ in range(s.eval_iters * s.grad_accum_steps):
                batches.append(next(it))
        except StopIteration:
            pass
        if not batches:
            return None
        self.engine.eval()
        try:
            losses = self.stage.forward_only(self._micro_batches(batches))
        finally:
            self.engine.train()
        return self._everywhere(losses)


def _save(config: TrainConfig, run: PipelineRun, iteration: int, consumed: int, scheduler: LRScheduler,
          save_dir: Optional[str] = None) -> None:
    save = save_dir or config.checkpoint.save
    t0 = time.perf_counter()
    save_checkpoint(save, iteration, run.engine,
                    train_state={"iteration": iteration, "consumed_samples": consumed,
                                 "lr_scheduler": scheduler.state_dict()},
                    config=config.to_dict(), pipeline=run.stage, tokenizer=getattr(run, "tokenizer", None))
    _print0(f"saved checkpoint {checkpoint_dir(save, iteration)} in {time.perf_counter() - t0:.2f}s")


def _eval(run: PipelineRun, dataset, iteration: int, writer, label: str, key: str = EVAL_LOSS_KEY) -> Optional[float]:
    val = run.evaluate(dataset)
    if val is not None:
        ppl = math.exp(min(val, 50))
        _print0(f" {label} loss at iteration {iteration}: {val:.6E} | perplexity: {ppl:.4E}")
        writer.write(iteration, {"iteration": iteration, key: val, key.replace("lm_loss", "ppl"): ppl})
    return val


def _load(config: TrainConfig, run: PipelineRun, scheduler: LRScheduler) -> tuple[int, int]:
    ck = config.checkpoint
    if not ck.load:
        return 0, 0
    fresh_cpu_rng = torch.get_rng_state()
    state = load_checkpoint(ck.load, run.engine, pipeline=run.stage,
                            load_optimizer=not (ck.finetune or ck.no_load_optim))
    if state is None:
        _print0(f"> no checkpoint in {ck.load}: starting from scratch")
        return 0, 0
    if ck.finetune or ck.no_load_optim:
        run.engine.optimizer.state.clear()
    if ck.finetune or ck.no_load_rng:
        torch.set_rng_state(fresh_cpu_rng)
    if ck.finetune:
        _print0(f"> --finetune: weights from iteration {state['iteration']} of {ck.load}")
        return 0, 0
    try:
        scheduler.load_state_dict(state["lr_scheduler"],
                                  use_checkpoint_values=config.schedule.use_checkpoint_opt_param_scheduler,
                                  override=config.schedule.override_opt_param_scheduler)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    _print0(f"> resumed from iteration {state['iteration']} ({state['consumed_samples']} samples)"
            + (" with a new tp x pp x dp layout" if state["resharded"] else ""))
    return state["iteration"], state["consumed_samples"]


def pretrain_pipeline(config: TrainConfig) -> TrainResult:
    """Run (or resume) a ``--pp > 1`` training job; collective over all ranks."""
    train_start = time.time()
    p = config.parallel
    mpu.init_distributed(p.distributed_backend)
    groups = (mpu.get_parallel_groups() if mpu.model_parallel_is_initialized() else
              mpu.initialize_model_parallel(p.tp, p.pp, virtual_pipeline_model_parallel_size=p.virtual_pp
                                            if p.virtual_pp > 1 else None))
    if (groups.pp_size, groups.virtual_pp_size) != (p.pp, p.virtual_pp):
        raise RuntimeError(f"model parallel groups were set up for pp {groups.pp_size} x v {groups.virtual_pp_size}, "
                           f"the run asks pp {p.pp} x v {p.virtual_pp}")
    device = mpu.get_device()
    mpu.model_parallel_manual_seed(config.seed)
    tokenizer = build_tokenizer_agreed(config)

    run = PipelineRun(config, groups, device)
    run.tokenizer = tokenizer  # recorded by content in every checkpoint
    engine = run.engine
    scheduler = LRScheduler.from_config(config, engine.optimizer)
    for note in config.notes:
        _print0(f"> {note}")
    _print0(f"> pipeline: {pipeline_plan_line(config)}")
    _print0(f"> model: {num_parameters(config.model):,} parameters; tp={p.tp} pp={p.pp} dp={p.dp} "
            f"ZeRO-{engine.stage} {config.precision.dtype}; this rank (pp stage {groups.pp_rank}) holds "
            f"{engine.num_local_parameters():,} parameters, model state {engine.model_state_bytes()['total'] / 2**20:.1f} MiB")
    if config.generate.prompt is not None:
        _print0("> --generate-prompt with --pp > 1: sample from the saved checkpoint with tools/generate.py")

    iteration, consumed = _load(config, run, scheduler)
    train_ds, valid_ds, test_ds = agree("data set-up",
                                        lambda: _datasets(config, tokenizer.vocab_size if tokenizer else None),
                                        user_errors=(ValueError, OSError))
    s, log = config.schedule, config.logging
    train_it = _loader(train_ds, consumed, config) if not s.skip_train else None
    writer = MetricsWriter(log.metrics_file, log.tensorboard_dir, rank=dist.get_rank(), options=log)
    throughput = Throughput.from_config(config)
    meter = IntervalMeter()
    result = TrainResult(iteration, consumed, {}, {})
    signals = SignalFlag(s.exit_signal_handler)
    per_micro = s.micro_batch_size * p.dp
    tokens = consumed * config.model.seq_length
    try:
        while iteration < s.train_iters and not s.skip_train:
            if s.train_tokens is not None and tokens >= s.train_tokens:
                result.exit_reason = f"--train-tokens {s.train_tokens} reached"
                _print0(f"> stopping at iteration {iteration}: --train-tokens {s.train_tokens:,} reached")
                break
            batch_size = s.global_batch_size_at(consumed)
            if s.rampup_batch_size is not None:
                set_accumulation(engine, batch_size // per_micro)
            loss, updated = run.train_step([next(train_it) for _ in range(batch_size // per_micro)])
            iteration += 1
            consumed += batch_size
            tokens += batch_size * config.model.seq_length
            if updated:
                scheduler.step(LRScheduler.increment(config, batch_size))
            result.losses[iteration] = loss
            if (not math.isfinite(loss) or engine.last_overflow) and config.precision.dtype != "fp16":
                debug = os.path.join(config.checkpoint.save or ".", "debug")
                _save(config, run, iteration, consumed, scheduler, save_dir=debug)
                raise TrainingDiverged(
                    f"non-finite {'loss' if not math.isfinite(loss) else 'gradients'} at iteration {iteration} "
                    f"(loss {loss}); state saved to {checkpoint_dir(debug, iteration)} for debugging. "
                    "Lower --lr, raise --clip-grad or check the data of this iteration.")
            meter.update({"lm loss": loss}, skipped=not updated)
            if iteration % log.log_interval == 0 or iteration == s.train_iters:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                stats = IterationStats.from_summary(
                    meter.pop(), iteration=iteration, train_iters=s.train_iters, consumed_samples=consumed,
                    lr=scheduler.lr, global_batch_size=batch_size, throughput=throughput,
                    loss_scale=engine.get_loss_scale(), grad_norm=engine.get_global_grad_norm(),
                    memory=memory_mb(device))
                _print0(format_log_line(stats))
                writer.write(iteration, stats.to_record())
            if s.eval_interval and iteration % s.eval_interval == 0:
                val = _eval(run, valid_ds, iteration, writer, "validation")
                if val is not None:
                    result.eval_losses[iteration] = val
            saved = False
            if config.checkpoint.save and config.checkpoint.save_interval and \
                    iteration % config.checkpoint.save_interval == 0:
                _save(config, run, iteration, consumed, scheduler)
                saved = True
            reason = exit_reason(s, iteration, signals, train_start, device)
            if reason is not None:
                if config.checkpoint.save and not saved:
                    _save(config, run, iteration, consumed, scheduler)
                _print0(f"exiting at iteration {iteration} after {reason}")
                result.exit_reason = reason
                break
        if result.exit_reason is None or result.exit_reason.startswith("--train-tokens"):
            if config.checkpoint.save and not s.skip_train and latest_iteration(config.checkpoint.save) != iteration:
                _save(config, run, iteration, consumed, scheduler)
            for label, dataset, name in (("validation", valid_ds, "valid"), ("test", test_ds, "test")):
                val = _eval(run, dataset, iteration, writer, f"the end of training for {label} data:",
                            key=f"{name}_end_lm_loss")
                if val is not None:
                    result.final_eval[name] = val
    finally:
        signals.restore()
        writer.close()
    result.iteration, result.consumed_samples = iteration, consumed
    return result
