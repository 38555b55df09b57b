"""The pre-training loop, one for every layout: TrainConfig -> groups -> this rank's model -> ZeRO -> data -> steps.

Megatron's loop, without its globals: every piece receives what it needs. A run at
pp = 1 and one at pp = 8 differ only in the schedule the step hands its micro-batches to
(:mod:`megazero.training.step`), so ramp-up, per-document masks, pretrained starts,
Megatron-checkpoint refusal, RNG restore, logging flags and evaluation exist once.
Checkpoints resume exactly (same losses iteration by iteration) and reload at a
different tp x pp x dp x ZeRO stage; non-finite gradients in bf16/fp32 stop the run with
the iteration number after saving a debug checkpoint.

Host synchronisations: the loss stays on the device until the log interval; the step
itself waits only for the gradient norm (clipping, fp16 overflow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .. import mpu
from ..model import num_parameters
from .arguments import check_vocab, pipeline_plan_line
from .checkpointing import CheckpointError, checkpoint_dir, latest_iteration, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .failures import Failure, agree, attempt, conclude, failure_of
from .lr_schedule import LRScheduler
from .metrics import EVAL_LOSS_KEY, IntervalMeter, IterationStats, MetricsWriter, Throughput, format_log_line
from .norms import count_zeros_in_grads, optimizer_state_stats, params_norm
from .run_control import PhaseClock, SignalFlag, exit_reason
from .step import LossLog, TrainModel, megatron_no_weight_decay
from ..utils.memory_tracker import step_peak_memory

__all__ = ["TrainingDiverged", "TrainResult", "pretrain", "megatron_no_weight_decay", "evaluate"]

# Megatron's _set_random_seed: each pipeline stage draws its own dropout masks.
PIPELINE_SEED_OFFSET = 100


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient outside fp16 loss scaling."""


@dataclasses.dataclass
class TrainResult:
    iteration: int
    consumed_samples: int
    losses: dict[int, float]  # iteration -> lm loss (DP mean) of the iterations run in this process
    eval_losses: dict[int, float]
    sample: Optional[str] = None
    final_eval: dict[str, float] = dataclasses.field(default_factory=dict)  # 'valid'/'test' -> loss at the end
    exit_reason: Optional[str] = None  # why the loop stopped before train_iters (signal, duration, interval, tokens)


def _print0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class MockGPTDataset(torch.utils.data.Dataset):
    """Synthetic ``seq_length + 1`` token samples, a pure function of (seed, index) (``--mock-data``)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"text": torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g).numpy()}


def _datasets(config: TrainConfig, tokenizer_vocab: Optional[int]):
    s = config.schedule
    # Every evaluation reads the same first eval_iters global batches of the validation (or test) split.
    eval_samples = s.eval_iters * s.global_batch_size
    num_samples = (s.train_samples, eval_samples, eval_samples)
    if config.data.mock_data:
        vocab = tokenizer_vocab or config.model.vocab_size
        return (MockGPTDataset(num_samples[0], config.model.seq_length, vocab, config.seed),
                MockGPTDataset(max(num_samples[1], 1), config.model.seq_length, vocab, config.seed + 1),
                MockGPTDataset(max(num_samples[2], 1), config.model.seq_length, vocab, config.seed + 2))
    from ..data import build_train_valid_test_datasets

    d = config.data
    # vocab_size: a token id outside the tokenizer's vocabulary is an error naming the dataset and
    # document when it is read (the embedding would otherwise take it silently at tp > 1).
    common = dict(cache_dir=d.data_cache_path, vocab_size=tokenizer_vocab)
    if d.train_data_path:
        # Megatron's separate split files: each path list is a whole split of its own.
        return build_train_valid_test_datasets(
            None, d.split, config.model.seq_length, config.seed, num_samples,
            train_data_path=d.train_data_path, valid_data_path=d.valid_data_path or None,
            test_data_path=d.test_data_path or None, **common)
    # Unweighted 'A B' passes through as is: megatron-core blends such prefixes by their sizes.
    return build_train_valid_test_datasets(d.data_path, d.split, config.model.seq_length,
                                           config.seed, num_samples, **common)


def _loader(dataset, consumed: int, config: TrainConfig, device: torch.device) -> Optional[Iterator]:
    from ..data import build_pretraining_data_loader

    loader = build_pretraining_data_loader(dataset, consumed, config.schedule.micro_batch_size,
                                           mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                                           num_workers=config.data.num_workers, device=device)
    return iter(loader) if loader is not None else None


def _train_step(run: TrainModel, batches: list[dict], eod: Optional[int],
                lap: Optional[Callable[[str], None]] = None) -> tuple[torch.Tensor, bool]:
    """One iteration: ``(this rank's loss on the device, parameters updated)``."""
    return run.train_step(batches, eod, lap)


def _take(it: Iterator, n: int, partial: bool = False) -> Optional[list[dict]]:
    """``n`` loader batches; when the loader runs out (on every rank alike): what was read
    (``partial``) or None."""
    out = []
    for _ in range(n):
        b = next(it, None)
        if b is None:
            return out if partial and out else None
        out.append(b)
    return out


def _read(it: Iterator, n: int, phase: str, partial: bool = False) -> Optional[list[dict]]:
    """``n`` loader batches, agreed: a bad sample (a token outside the vocabulary) raises on the
    ranks that read it only, and must stop every rank."""
    return agree(phase, lambda: _take(it, n, partial), user_errors=(ValueError,))


def _read_train(it: Iterator, n: int, run: TrainModel, config: TrainConfig) -> tuple[list[dict], Optional[Failure]]:
    """A training iteration's batches, without an agreement of their own: a rank whose read
    fails flags it into the step's all-reduce and steps on zeros (no rank updates), and the
    loop then concludes on every rank (see ``failures.py``)."""
    batches, failure = attempt(lambda: _take(it, n), user_errors=(ValueError,))
    if failure is not None:
        run.engine.flag_failure()
        shape = (config.schedule.micro_batch_size, config.model.seq_length + 1)
        return [{"text": torch.zeros(shape, dtype=torch.int64)} for _ in range(n)], failure
    return batches, None


@torch.no_grad()
def evaluate(run: TrainModel, dataset, config: TrainConfig, eod: Optional[int] = None) -> Optional[float]:
    """Mean validation loss over ``eval_iters`` global batches (always the same ones), forward only."""
    s = config.schedule
    if dataset is None or s.eval_iters == 0:
        return None
    it = _loader(dataset, 0, config, run.device)
    losses = []
    for _ in range(s.eval_iters):
        batches = _read(it, s.grad_accum_steps, "evaluation data read", partial=True) if it is not None else None
        if not batches:
            break
        losses.append(run.eval_step(batches, eod))
    if not losses:
        return None
    values = LossLog(run.groups).reduce(losses)
    return sum(values) / len(values)


def _save(config: TrainConfig, iteration: int, consumed: int, run: TrainModel, scheduler: LRScheduler,
          save_dir: Optional[str] = None, tokenizer=None) -> None:
    save = save_dir or config.checkpoint.save
    t0 = time.perf_counter()
    save_checkpoint(save, iteration, run.engine,
                    train_state={"iteration": iteration, "consumed_samples": consumed,
                                 "lr_scheduler": scheduler.state_dict()},
                    config=config.to_dict(), tokenizer=tokenizer, pipeline=run.stage)
    _print0(f"saved checkpoint {checkpoint_dir(save, iteration)} in {time.perf_counter() - t0:.2f}s")


def build_tokenizer_agreed(config: TrainConfig):
    """The run's tokenizer (None for mock data without one), built on every rank; a bad file on
    any rank stops all of them with its message."""
    if config.data.tokenizer_type is None:
        return None
    from ..data import build_tokenizer

    def build():
        tok = build_tokenizer(config.data.tokenizer_type, **config.data.tokenizer_kwargs())
        check_vocab(config, tok.vocab_size)
        return tok

    return agree("tokenizer set-up", build, user_errors=(ValueError, OSError))


def _refuse_foreign_checkpoint(load: str) -> None:
    """A Megatron-LM or Megatron-DeepSpeed directory in --load: say what it is and how to convert it,
    instead of finding no megazero checkpoint there and silently starting from scratch."""
    from .megatron_ckpt import detect_foreign_checkpoint

    message = detect_foreign_checkpoint(load)
    if message is not None:
        raise CheckpointError(message)


def _init_from_pretrained(engine, directory: str) -> None:
    """Start from full weights (e.g. an imported Hugging Face model); each rank reads only its rows
    (a pipeline stage only its own layers: the engine names them as at pp = 1)."""
    from ..zero.checkpoint import load_full_weights_file

    path = os.path.join(directory, "model_full.safetensors")
    agree("pretrained weights load", lambda: load_full_weights_file(engine, path))
    _print0(f"> initialized the weights from {path}")


def _run_eval(run: TrainModel, dataset, config: TrainConfig, iteration: int, writer, label: str,
              key: str = EVAL_LOSS_KEY, eod: Optional[int] = None) -> Optional[float]:
    val = evaluate(run, dataset, config, eod)
    if val is not None:
        ppl = math.exp(min(val, 50))
        _print0(f" {label} loss at iteration {iteration}: {val:.6E} | perplexity: {ppl:.4E}")
        writer.write(iteration, {"iteration": iteration, key: val, key.replace("lm_loss", "ppl"): ppl})
    return val


def _set_up_groups(config: TrainConfig):
    p = config.parallel
    mpu.init_distributed(p.distributed_backend)
    if not mpu.model_parallel_is_initialized():
        return mpu.initialize_model_parallel(p.tp, p.pp, virtual_pipeline_model_parallel_size=p.virtual_pp
                                             if p.virtual_pp > 1 else None)
    groups = mpu.get_parallel_groups()
    if (groups.tp_size, groups.pp_size, groups.virtual_pp_size) != (p.tp, p.pp, p.virtual_pp):
        raise RuntimeError(f"model parallel groups were set up for tp {groups.tp_size} x pp {groups.pp_size} x "
                           f"v {groups.virtual_pp_size}, the run asks tp {p.tp} x pp {p.pp} x v {p.virtual_pp}")
    return groups


def _load(config: TrainConfig, run: TrainModel, scheduler: LRScheduler) -> tuple[int, int]:
    """--load / --pretrained-checkpoint / --finetune / --no-load-*: where the run starts."""
    ck = config.checkpoint
    engine = run.engine
    fresh_rng = mpu.get_rng_tracker().get_states()
    fresh_cpu_rng = torch.get_rng_state()
    if ck.load:
        agree("checkpoint load", lambda: _refuse_foreign_checkpoint(ck.load))
    # --finetune / --no-load-optim read the weights only (any optimizer may have saved them)
    state = load_checkpoint(ck.load, engine, ck.ckpt_step, pipeline=run.stage,
                            load_optimizer=not (ck.finetune or ck.no_load_optim)) if ck.load else None
    if state is None and ck.pretrained:
        _init_from_pretrained(engine, ck.pretrained)
    if state is None:
        if ck.load:
            _print0(f"> no checkpoint in {ck.load}: starting from "
                    + ("the pretrained weights" if ck.pretrained else "scratch"))
        return 0, 0
    if ck.finetune or ck.no_load_optim:
        # Megatron's --finetune / --no-load-optim: keep the loaded weights, start the optimizer afresh.
        engine.optimizer.state.clear()
    if ck.finetune or ck.no_load_rng:
        torch.set_rng_state(fresh_cpu_rng)
        mpu.get_rng_tracker().set_states(fresh_rng)
    if state.get("scaler_note"):
        _print0(f"> {state['scaler_note']}")
    if ck.finetune:
        _print0(f"> --finetune: weights from iteration {state['iteration']} of {ck.load}; iteration, "
                f"samples, optimizer and RNG start afresh")
        return 0, 0
    try:
        scheduler.load_state_dict(state["lr_scheduler"],
                                  use_checkpoint_values=config.schedule.use_checkpoint_opt_param_scheduler,
                                  override=config.schedule.override_opt_param_scheduler)
    except ValueError as e:  # a changed schedule on resume: say so instead of a traceback
        raise CheckpointError(str(e)) from None
    _print0(f"> resumed from iteration {state['iteration']} ({state['consumed_samples']} samples)"
            + (" with a new layout" if state["resharded"] else ""))
    return state["iteration"], state["consumed_samples"]


def pretrain(config: TrainConfig, *, device: Optional[torch.device] = None,
             on_iteration_end: Optional[Callable[[int, TrainModel], None]] = None) -> TrainResult:
    """Run (or resume) a training job described by ``config``, at any tp x pp x dp; collective over all ranks.

    ``device``: where this rank computes; by default ``mpu.get_device()`` (its CUDA device under
    NCCL, else the CPU). A rehearsal (``megazero.training.rehearsal``) passes the meta device.
    ``on_iteration_end(iteration, run)`` is called after each training iteration's step, before
    its log line, evaluation and checkpoint: where a rehearsal or a benchmark measures.
    """
    train_start = time.time()
    p = config.parallel
    groups = _set_up_groups(config)
    device = torch.device(device) if device is not None else mpu.get_device()
    # One seed for the weights on every rank: they are drawn by pp = 1 name, so any layout gets the same model.
    mpu.model_parallel_manual_seed(config.seed)
    tokenizer = build_tokenizer_agreed(config)
    run = TrainModel(config, groups, device)
    engine = run.engine
    # Dropout streams: stage r draws from seed + 100 r (Megatron), layers of a stage in turn.
    mpu.model_parallel_manual_seed(config.seed + PIPELINE_SEED_OFFSET * groups.pp_rank)
    scheduler = LRScheduler.from_config(config, engine.optimizer)
    for note in config.notes:
        _print0(f"> {note}")
    if p.pp > 1:
        _print0(f"> pipeline: {pipeline_plan_line(config)}")
    state = engine.model_state_bytes()
    host = sum(state.get(k, 0) for k in ("host_optimizer", "host_ring", "host_params", "host_param_ring"))
    files = state.get("nvme", 0) + state.get("nvme_params", 0)
    offloaded = f"; offloaded: host {host / 2**20:.1f} MiB, NVMe {files / 2**20:.1f} MiB" if host or files else ""
    _print0(f"> model: {num_parameters(config.model):,} parameters (this rank {engine.num_local_parameters():,}); "
            f"tp={p.tp} pp={p.pp} dp={p.dp} ZeRO-{engine.stage} {config.precision.dtype}; model state per rank "
            f"{state['total'] / 2**20:.1f} MiB on the device{offloaded}")

    iteration, consumed = _load(config, run, scheduler)
    train_ds, valid_ds, test_ds = agree("data set-up",
                                        lambda: _datasets(config, tokenizer.vocab_size if tokenizer else None),
                                        user_errors=(ValueError, OSError))
    s, log = config.schedule, config.logging
    train_it = _loader(train_ds, consumed, config, device) if not s.skip_train else None
    eod = tokenizer.eod if tokenizer is not None else None

    writer = MetricsWriter(log.metrics_file, log.tensorboard_dir, rank=dist.get_rank(), options=log)
    timers: Optional[dict] = {} if (log.wall_clock_breakdown or log.log_timers_to_tensorboard) else None
    zeros = count_zeros_in_grads(engine) if log.log_num_zeros_in_grad else None
    throughput = Throughput.from_config(config)
    meter = IntervalMeter()
    loss_log = LossLog(groups)
    skipped_at: dict[int, bool] = {}
    result = TrainResult(iteration, consumed, {}, {})
    signals = SignalFlag(s.exit_signal_handler)
    last_log = iteration
    per_micro = s.micro_batch_size * p.dp
    tokens = consumed * config.model.seq_length  # no curriculum: every sample is seq_length tokens
    tracking = contextlib.ExitStack()
    if log.track_memory and device.type == "cpu":
        from ..utils.memory_tracker import LiveMemoryTracker

        # Entered after the engine exists, so its state is part of the baseline and the peak is absolute.
        tracking.enter_context(LiveMemoryTracker("cpu"))

    def diverged(it: int, what: str, loss) -> TrainingDiverged:
        """Save the current state (iteration ``iteration``) for debugging; ``it`` is where it went non-finite."""
        debug = os.path.join(config.checkpoint.save or ".", "debug")
        _save(config, iteration, consumed, run, scheduler, save_dir=debug, tokenizer=tokenizer)
        return TrainingDiverged(
            f"non-finite {what} at iteration {it} (loss {loss}); state saved to {checkpoint_dir(debug, iteration)} "
            "for debugging. Lower --lr, raise --clip-grad or check the data of this iteration.")

    def flush_losses() -> None:
        """The interval's losses to the host (one collective, one synchronisation), into the meter."""
        for it, loss in loss_log.flush().items():
            result.losses[it] = loss
            if not math.isfinite(loss) and config.precision.dtype != "fp16":
                raise diverged(it, "loss", loss)
            meter.update({"lm loss": loss}, skipped=skipped_at.pop(it, False))

    try:
        while iteration < s.train_iters and not s.skip_train:
            if s.train_tokens is not None and tokens >= s.train_tokens:
                result.exit_reason = f"--train-tokens {s.train_tokens} reached"
                _print0(f"> stopping at iteration {iteration}: {tokens:,} tokens consumed, "
                        f"--train-tokens {s.train_tokens:,} reached")
                break
            batch_size = s.global_batch_size_at(consumed)
            batches, failure = _read_train(train_it, batch_size // per_micro, run, config)
            if batches is None:
                raise RuntimeError(f"the training data ran out at iteration {iteration + 1} ({consumed} samples)")
            clock = PhaseClock(timers, device)
            loss, updated = _train_step(run, batches, eod, clock.lap if timers is not None else None)
            if engine.failed_ranks:  # every rank knows from the step's all-reduce: they conclude together
                phase = "training data read"
                if failure is None and engine.deferred_failure is not None:  # an offload read or write
                    phase, error = engine.deferred_failure
                    failure = failure_of(error)
                conclude(phase, failure)
            iteration += 1
            consumed += batch_size
            tokens += batch_size * config.model.seq_length
            if updated:  # Megatron and DeepSpeed: a skipped fp16 step does not advance the schedule
                scheduler.step(LRScheduler.increment(config, batch_size))
            loss_log.add(iteration, loss)
            skipped_at[iteration] = not updated
            if on_iteration_end is not None:
                on_iteration_end(iteration, run)
            if engine.last_overflow and config.precision.dtype != "fp16":
                losses = loss_log.flush()  # every rank takes part; the loss is for the message
                loss_value = losses.get(iteration, float("nan"))
                raise diverged(iteration, "gradients" if math.isfinite(loss_value) else "loss", loss_value)
            if iteration % log.log_interval == 0 or iteration == s.train_iters:
                flush_losses()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                peak_bytes, memory_source = step_peak_memory(device)
                stats = IterationStats.from_summary(
                    meter.pop(), iteration=iteration, train_iters=s.train_iters, consumed_samples=consumed,
                    lr=scheduler.lr, global_batch_size=batch_size, throughput=throughput,
                    loss_scale=engine.get_loss_scale(), grad_norm=engine.get_global_grad_norm(),
                    memory=peak_bytes / 2 ** 20)
                stats.peak_memory_source = memory_source
                if batch_size != s.global_batch_size:
                    at = throughput.at_batch(batch_size, s.global_batch_size)
                    stats.tokens_per_second = at.tokens_per_second(stats.seconds_per_iteration)
                    stats.tflops_per_rank = at.tflops_per_rank(stats.seconds_per_iteration)
                if timers is not None:
                    n = max(iteration - last_log, 1)
                    stats.timers_ms = {k: v * 1000.0 / n for k, v in timers.items()}
                    timers.clear()
                last_log = iteration
                if log.log_params_norm:
                    stats.extra["params_norm"] = params_norm(engine)
                if zeros is not None and zeros.zeros is not None:
                    stats.extra["num_zeros"] = float(zeros.zeros)
                if log.log_optimizer_states_to_tensorboard:
                    stats.extra.update(optimizer_state_stats(engine))
                _print0(format_log_line(stats))
                writer.write(iteration, stats.to_record())
            if s.eval_interval and iteration % s.eval_interval == 0:
                val = _run_eval(run, valid_ds, config, iteration, writer, "validation", eod=eod)
                if val is not None:
                    result.eval_losses[iteration] = val
            saved = False
            if config.checkpoint.save and config.checkpoint.save_interval and iteration % config.checkpoint.save_interval == 0:
                _save(config, iteration, consumed, run, scheduler, tokenizer=tokenizer)
                saved = True
            reason = exit_reason(s, iteration, signals, train_start, device)
            if reason is not None:
                flush_losses()
                if config.checkpoint.save and not saved:
                    _save(config, iteration, consumed, run, scheduler, tokenizer=tokenizer)
                _print0(f"exiting at iteration {iteration} after {reason}")
                result.exit_reason = reason
                break
        flush_losses()
        if result.exit_reason is None or result.exit_reason.startswith("--train-tokens"):
            if config.checkpoint.save and not s.skip_train and latest_iteration(config.checkpoint.save) != iteration:
                _save(config, iteration, consumed, run, scheduler, tokenizer=tokenizer)
            # Megatron ends training (or --skip-train) with an evaluation on the validation and test splits.
            for label, dataset, name in (("validation", valid_ds, "valid"), ("test", test_ds, "test")):
                val = _run_eval(run, dataset, config, iteration, writer,
                                f"the end of training for {label} data:", key=f"{name}_end_lm_loss", eod=eod)
                if val is not None:
                    result.final_eval[name] = val
        if config.generate.prompt is not None and tokenizer is not None:
            from ..model.sampling import generate_text

            result.sample = generate_text(engine.module, tokenizer, config.generate.prompt,
                                          max_new_tokens=config.generate.tokens, seed=config.seed)
            _print0(f"> sample: {config.generate.prompt!r} ->\n{result.sample}")
    finally:
        tracking.close()
        signals.restore()
        writer.close()
    result.iteration, result.consumed_samples = iteration, consumed
    return result
