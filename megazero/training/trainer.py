"""The pre-training loop: TrainConfig -> groups -> partitioned model -> ZeRO -> data -> steps.

Megatron's loop, without its globals: every piece receives what it needs.
Checkpoints resume exactly (same losses iteration by iteration) and reload at
a different tp x dp x ZeRO stage; a non-finite loss or gradient in bf16/fp32
stops the run with the iteration number after saving a debug checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .. import mpu, zero
from ..model import GPTModel, num_parameters
from .arguments import check_vocab
from .checkpointing import CheckpointError, checkpoint_dir, latest_iteration, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .failures import agree
from .lr_schedule import LRScheduler
from .metrics import EVAL_LOSS_KEY, IntervalMeter, IterationStats, MetricsWriter, Throughput, format_log_line
from .norms import count_zeros_in_grads, optimizer_state_stats, params_norm
from .run_control import PhaseClock, SignalFlag, exit_reason, set_accumulation
from ..utils.memory_tracker import step_peak_memory

__all__ = ["TrainingDiverged", "TrainResult", "pretrain", "megatron_no_weight_decay"]


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


def megatron_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and normalization weights (1-D) train without weight decay."""
    return param.dim() == 1 or name.endswith(".bias")


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


def _loader(dataset, consumed: int, config: TrainConfig) -> Optional[Iterator]:
    from ..data import build_pretraining_data_loader

    loader = build_pretraining_data_loader(dataset, consumed, config.schedule.micro_batch_size,
                                           mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                                           num_workers=config.data.num_workers)
    return iter(loader) if loader is not None else None


def _dp_mean(values: list[float], device: torch.device) -> float:
    t = torch.tensor([sum(values) / max(len(values), 1)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=mpu.get_data_parallel_group())
    return float(t) / mpu.get_data_parallel_world_size()


def _micro_batch(text: torch.Tensor, config: TrainConfig, eod: Optional[int], device):
    """Megatron's get_batch: inputs, labels, loss mask, positions and attention mask of a micro-batch."""
    from ..data import build_batch

    d = config.data
    b = build_batch(text.to(device), eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)
    # Plain positions and plain causality are the model's defaults: passing nothing keeps flash attention usable.
    position_ids = b.position_ids if d.reset_position_ids else None
    return b, position_ids


def _lm_loss(engine, text: torch.Tensor, config: TrainConfig, eod: Optional[int], device) -> torch.Tensor:
    """The micro-batch's loss: mean per-token loss over the loss mask (Megatron's loss_func)."""
    from ..data import masked_mean

    b, position_ids = _micro_batch(text, config, eod, device)
    per_token = engine(b.tokens, position_ids=position_ids, attention_mask=b.attention_mask, labels=b.labels)
    return masked_mean(per_token, b.loss_mask)


def _train_step(engine, batches: list[dict], device, config: TrainConfig, eod: Optional[int],
                timers: Optional[dict] = None) -> tuple[float, bool]:
    """One iteration; with ``timers`` (a dict) adds the seconds spent in fwd / bwd / step to it."""
    losses = []
    updated = False
    clock = PhaseClock(timers, device)
    for batch in batches:
        loss = _lm_loss(engine, batch["text"], config, eod, device)
        clock.lap("fwd")
        engine.backward(loss)
        clock.lap("bwd")
        updated = engine.step()
        clock.lap("step")
        losses.append(float(loss.detach()))
    return _dp_mean(losses, device), updated


@torch.no_grad()
def evaluate(engine, dataset, config: TrainConfig, device, eod: Optional[int] = None) -> Optional[float]:
    """Mean validation loss over ``eval_iters`` global batches (always the same ones)."""
    if dataset is None or config.schedule.eval_iters == 0:
        return None
    it = _loader(dataset, 0, config)
    engine.eval()
    losses = []
    try:
        for _ in range(config.schedule.eval_iters * config.schedule.grad_accum_steps):
            batch = agree("evaluation data read", lambda: next(it, None), user_errors=(ValueError,))
            if batch is None:
                break
            losses.append(float(_lm_loss(engine, batch["text"], config, eod, device)))
    finally:
        engine.train()
    return _dp_mean(losses, device) if losses else None


def _save(config: TrainConfig, iteration: int, consumed: int, engine, scheduler: LRScheduler,
          save_dir: Optional[str] = None, tokenizer=None) -> None:
    save = save_dir or config.checkpoint.save
    t0 = time.perf_counter()
    save_checkpoint(save, iteration, engine,
                    train_state={"iteration": iteration, "consumed_samples": consumed,
                                 "lr_scheduler": scheduler.state_dict()},
                    config=config.to_dict(), tokenizer=tokenizer)
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
    """Start from full weights (e.g. an imported Hugging Face model); each rank reads only its rows."""
    from ..zero.checkpoint import load_full_weights_file

    path = os.path.join(directory, "model_full.safetensors")
    agree("pretrained weights load", lambda: load_full_weights_file(engine, path))
    _print0(f"> initialized the weights from {path}")


def _run_eval(engine, dataset, config: TrainConfig, device, iteration: int, writer, label: str,
              key: str = EVAL_LOSS_KEY, eod: Optional[int] = None) -> Optional[float]:
    val = evaluate(engine, dataset, config, device, eod)
    if val is not None:
        ppl = math.exp(min(val, 50))
        _print0(f" {label} loss at iteration {iteration}: {val:.6E} | perplexity: {ppl:.4E}")
        writer.write(iteration, {"iteration": iteration, key: val, key.replace("lm_loss", "ppl"): ppl})
    return val


def pretrain(config: TrainConfig) -> TrainResult:
    """Run (or resume) a training job described by ``config``; collective over all ranks."""
    if config.parallel.pp > 1:
        from .pipeline_trainer import pretrain_pipeline

        return pretrain_pipeline(config)
    train_start = time.time()
    mpu.init_distributed(config.parallel.distributed_backend)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(config.parallel.tp, config.parallel.pp)
    device = mpu.get_device()
    mpu.model_parallel_manual_seed(config.seed)

    tokenizer = build_tokenizer_agreed(config)

    # Built on the meta device: every ZeRO stage materializes it partition by partition,
    # with values identical to a full initialization.
    model = GPTModel(config.model, device="meta")
    engine = zero.initialize(model, config.to_deepspeed_config(), mpu=mpu,
                             no_weight_decay=megatron_no_weight_decay, device=device)
    if config.optim.type == "SGD" and not isinstance(engine.optimizer, torch.optim.SGD):
        raise RuntimeError(f"--optimizer sgd: the ZeRO engine built {type(engine.optimizer).__name__}; this build's "
                           "engine does not construct SGD yet")
    scheduler = LRScheduler.from_config(config, engine.optimizer)
    for note in config.notes:
        _print0(f"> {note}")
    _print0(f"> model: {num_parameters(config.model):,} parameters "
            f"(per TP rank {engine.num_local_parameters():,}); tp={config.parallel.tp} dp={config.parallel.dp} "
            f"ZeRO-{engine.stage} {config.precision.dtype}; model state per rank "
            f"{engine.model_state_bytes()['total'] / 2**20:.1f} MiB")

    iteration, consumed = 0, 0
    ck = config.checkpoint
    fresh_rng = mpu.get_cuda_rng_tracker().get_states() if hasattr(mpu, "get_cuda_rng_tracker") else None
    fresh_cpu_rng = torch.get_rng_state()
    if ck.load:
        agree("checkpoint load", lambda: _refuse_foreign_checkpoint(ck.load))
    # --finetune / --no-load-optim read the weights only (any optimizer may have saved them)
    state = load_checkpoint(ck.load, engine, load_optimizer=not (ck.finetune or ck.no_load_optim)) if ck.load else None
    if state is None and ck.pretrained:
        _init_from_pretrained(engine, ck.pretrained)
    if ck.load:
        if state is None:
            _print0(f"> no checkpoint in {ck.load}: starting from "
                    + ("the pretrained weights" if ck.pretrained else "scratch"))
        else:
            if ck.finetune or ck.no_load_optim:
                # Megatron's --finetune / --no-load-optim: keep the loaded weights, start the optimizer afresh.
                engine.optimizer.state.clear()
            if ck.finetune or ck.no_load_rng:
                torch.set_rng_state(fresh_cpu_rng)
                if fresh_rng is not None:
                    mpu.get_cuda_rng_tracker().set_states(fresh_rng)
            if ck.finetune:
                _print0(f"> --finetune: weights from iteration {state['iteration']} of {ck.load}; iteration, "
                        f"samples, optimizer and RNG start afresh")
            else:
                iteration, consumed = state["iteration"], state["consumed_samples"]
                try:
                    scheduler.load_state_dict(state["lr_scheduler"],
                                              use_checkpoint_values=config.schedule.use_checkpoint_opt_param_scheduler,
                                              override=config.schedule.override_opt_param_scheduler)
                except ValueError as e:  # a changed schedule on resume: say so instead of a traceback
                    raise CheckpointError(str(e)) from None
                _print0(f"> resumed from iteration {iteration} ({consumed} samples)"
                        + (" with a new tp x dp layout" if state["resharded"] else ""))
            if state.get("scaler_note"):
                _print0(f"> {state['scaler_note']}")

    train_ds, valid_ds, test_ds = agree("data set-up",
                                        lambda: _datasets(config, tokenizer.vocab_size if tokenizer else None),
                                        user_errors=(ValueError, OSError))
    train_it = _loader(train_ds, consumed, config) if not config.schedule.skip_train else None
    eod = tokenizer.eod if tokenizer is not None else None

    s, log = config.schedule, config.logging
    writer = MetricsWriter(log.metrics_file, log.tensorboard_dir, rank=dist.get_rank(), options=log)
    timers: Optional[dict] = {} if (log.wall_clock_breakdown or log.log_timers_to_tensorboard) else None
    zeros = count_zeros_in_grads(engine) if log.log_num_zeros_in_grad else None
    throughput = Throughput.from_config(config)
    meter = IntervalMeter()
    result = TrainResult(iteration, consumed, {}, {})
    signals = SignalFlag(s.exit_signal_handler)
    last_log = iteration
    per_micro = s.micro_batch_size * config.parallel.dp
    tokens = consumed * config.model.seq_length  # no curriculum: every sample is seq_length tokens
    tracking = contextlib.ExitStack()
    if log.track_memory and device.type == "cpu":
        from ..utils.memory_tracker import LiveMemoryTracker

        # Entered after the engine exists, so its state is part of the baseline and the peak is absolute.
        tracking.enter_context(LiveMemoryTracker("cpu"))
    try:
        while iteration < s.train_iters and not s.skip_train:
            if s.train_tokens is not None and tokens >= s.train_tokens:
                result.exit_reason = f"--train-tokens {s.train_tokens} reached"
                _print0(f"> stopping at iteration {iteration}: {tokens:,} tokens consumed, "
                        f"--train-tokens {s.train_tokens:,} reached")
                break
            batch_size = s.global_batch_size_at(consumed)
            if s.rampup_batch_size is not None:
                set_accumulation(engine, batch_size // per_micro)
            # Agreed: a bad sample (a token outside the vocabulary) raises on the ranks that read it only.
            batches = agree("training data read", lambda: [next(train_it) for _ in range(batch_size // per_micro)],
                            user_errors=(ValueError,))
            loss, updated = _train_step(engine, batches, device, config, eod, timers)
            iteration += 1
            consumed += batch_size
            tokens += batch_size * config.model.seq_length
            if updated:  # Megatron and DeepSpeed: a skipped fp16 step does not advance the schedule
                scheduler.step(LRScheduler.increment(config, batch_size))
            result.losses[iteration] = loss
            skipped = not updated
            if (not math.isfinite(loss) or engine.last_overflow) and config.precision.dtype != "fp16":
                debug = os.path.join(config.checkpoint.save or ".", "debug")
                _save(config, iteration, consumed, engine, scheduler, save_dir=debug, tokenizer=tokenizer)
                raise TrainingDiverged(
                    f"non-finite {'loss' if not math.isfinite(loss) else 'gradients'} at iteration {iteration} "
                    f"(loss {loss}); state saved to {checkpoint_dir(debug, iteration)} for debugging. "
                    "Lower --lr, raise --clip-grad or check the data of this iteration.")
            meter.update({"lm loss": loss}, skipped=skipped)
            if iteration % log.log_interval == 0 or iteration == s.train_iters:
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
                    stats.tokens_per_second = throughput.at_batch(batch_size, s.global_batch_size) \
                        .tokens_per_second(stats.seconds_per_iteration)
                    stats.tflops_per_rank = throughput.at_batch(batch_size, s.global_batch_size) \
                        .tflops_per_rank(stats.seconds_per_iteration)
                if timers is not None:
                    n = max(iteration - last_log, 1)
                    stats.timers_ms = {k: v * 1000.0 / n for k, v in timers.items()}
                    timers.clear()
                last_log = iteration
                if log.log_params_norm:
                    stats.extra["params_norm"] = params_norm(engine)
                if zeros is not None and zeros.zeros is not None:
                    stats.extra["num_zeros"] = zeros.zeros
                if log.log_optimizer_states_to_tensorboard:
                    stats.extra.update(optimizer_state_stats(engine))
                _print0(format_log_line(stats))
                writer.write(iteration, stats.to_record())
            if s.eval_interval and iteration % s.eval_interval == 0:
                val = _run_eval(engine, valid_ds, config, device, iteration, writer, "validation", eod=eod)
                if val is not None:
                    result.eval_losses[iteration] = val
            saved = False
            if config.checkpoint.save and config.checkpoint.save_interval and iteration % config.checkpoint.save_interval == 0:
                _save(config, iteration, consumed, engine, scheduler, tokenizer=tokenizer)
                saved = True
            reason = exit_reason(s, iteration, signals, train_start, device)
            if reason is not None:
                if config.checkpoint.save and not saved:
                    _save(config, iteration, consumed, engine, scheduler, tokenizer=tokenizer)
                _print0(f"exiting at iteration {iteration} after {reason}")
                result.exit_reason = reason
                break
        if result.exit_reason is None or result.exit_reason.startswith("--train-tokens"):
            if config.checkpoint.save and not s.skip_train and latest_iteration(config.checkpoint.save) != iteration:
                _save(config, iteration, consumed, engine, scheduler, tokenizer=tokenizer)
            # Megatron ends training (or --skip-train) with an evaluation on the validation and test splits.
            for label, dataset, name in (("validation", valid_ds, "valid"), ("test", test_ds, "test")):
                val = _run_eval(engine, dataset, config, device, iteration, writer,
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
