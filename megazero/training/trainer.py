"""The pre-training loop, one for every layout: TrainConfig -> groups -> this rank's model -> ZeRO -> data -> steps.

Megatron's loop, without its globals: every piece receives what it needs. A run at
pp = 1 and one at pp = 8 differ only in the schedule the step hands its micro-batches to
(:mod:`megazero.training.step`), so ramp-up, per-document masks, pretrained starts,
Megatron-checkpoint refusal, RNG restore, logging flags and evaluation exist once.
The loop itself only orders its components (:mod:`megazero.training.loop`), each of which
decides when it acts: the checkpointer, the evaluator, the metrics logger, the stop policy
and the failure protocol. Callers hook in with :class:`~megazero.training.loop.Callback`.

Host synchronisations: the loss stays on the device until the log interval; the step
itself waits only for the gradient norm (clipping, fp16 overflow).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch

from megazero import mpu
from megazero.config.arguments import check_vocab
from megazero.config.train_config import TrainConfig
from megazero.training.health import PhaseBoard
from megazero.training.health.watchdog import Watchdog, check_timeout_covers_save
from megazero.training.loop import (
    Callback,
    Callbacks,
    Checkpointer,
    Evaluator,
    FailureProtocol,
    MetricsLogger,
    StepResult,
    StopPolicy,
    TrainingDiverged,
    TrainState,
    build_datasets,
    describe_model,
    evaluate,
    loader,
)
from megazero.training.lr_schedule import LRScheduler
from megazero.training.step import TrainModel, megatron_no_weight_decay
from megazero.utils.output import rank_zero_logger
from megazero.utils.phase_agreement import agree

__all__ = ["TrainingDiverged", "TrainResult", "pretrain", "megatron_no_weight_decay", "evaluate", "Callback"]

log = rank_zero_logger(__name__)

# Megatron's _set_random_seed: each pipeline stage draws its own dropout masks.
PIPELINE_SEED_OFFSET = 100


@dataclasses.dataclass
class TrainResult:
    iteration: int
    consumed_samples: int
    losses: dict[int, float]  # iteration -> lm loss (DP mean) of the iterations run in this process
    eval_losses: dict[int, float]
    sample: Optional[str] = None
    final_eval: dict[str, float] = dataclasses.field(default_factory=dict)  # 'valid'/'test' -> loss at the end
    exit_reason: Optional[str] = None  # why the loop stopped before train_iters (signal, duration, interval, tokens)


def pretrain(config: TrainConfig, *, device: Optional[torch.device] = None,
             callbacks: Iterable[Callback] = ()) -> TrainResult:
    """Run (or resume) a training job described by ``config``, at any tp x pp x dp; collective over all ranks.

    ``device``: where this rank computes; by default ``mpu.get_device()`` (its CUDA device under
    NCCL, else the CPU). A rehearsal passes the meta device. ``callbacks`` hear the loop's events
    (:class:`~megazero.training.loop.Callback`).
    """
    state = TrainState()  # its start_time is the run's
    board = PhaseBoard()  # where this rank is: the watchdog and the straggler report read it
    groups = _set_up_groups(config)
    with Watchdog.for_run(config, board):
        return _train(config, state, board, groups, device, callbacks)


def _train(config: TrainConfig, state: TrainState, board: PhaseBoard, groups, device: Optional[torch.device],
           callbacks: Iterable[Callback]) -> TrainResult:
    device = torch.device(device) if device is not None else mpu.get_device()
    # One seed for the weights on every rank: they are drawn by pp = 1 name, so any layout gets the same model.
    mpu.model_parallel_manual_seed(config.seed)
    tokenizer = build_tokenizer_agreed(config)
    run = TrainModel(config, groups, device)
    # Dropout streams: stage r draws from seed + 100 r (Megatron), layers of a stage in turn.
    mpu.model_parallel_manual_seed(config.seed + PIPELINE_SEED_OFFSET * groups.pp_rank)
    scheduler = LRScheduler.from_config(config, run.engine.optimizer)
    _announce(config, run)
    hooks = Callbacks(callbacks)
    check_timeout_covers_save(config, run)
    checkpointer = Checkpointer(config, run, scheduler, tokenizer, hooks, board=board)
    state.iteration, state.consumed_samples = checkpointer.load()
    state.tokens = state.consumed_samples * config.model.seq_length
    vocab = tokenizer.vocab_size if tokenizer else None
    train_ds, valid_ds, test_ds = agree("data set-up", lambda: build_datasets(config, vocab),
                                        user_errors=(ValueError, OSError))
    s, eod = config.schedule, tokenizer.eod if tokenizer is not None else None
    train_it = loader(train_ds, state.consumed_samples, config, groups, device) if not s.skip_train else None
    per_micro = s.micro_batch_size * config.parallel.dp
    failures = FailureProtocol(config, run, checkpointer)
    with MetricsLogger(config, run, scheduler, state.iteration, check=failures.check_loss, board=board) as metrics, \
            StopPolicy(config, device) as stop:
        evaluator = Evaluator(config, run, valid_ds, test_ds, eod, metrics.writer, board=board)
        hooks.on_train_start(state, run)
        while not stop.before_step(state):
            batch_size = s.global_batch_size_at(state.consumed_samples)
            board.enter("data", iteration=state.iteration + 1)
            batches = failures.read(train_it, batch_size // per_micro, state)
            hooks.on_step_start(state, batches)
            board.enter("forward-backward", passes=len(batches) * len(run.chunks))
            figures, updated = run.train_step(batches, eod, board.lap_with(metrics.lap()))
            failures.after_step()
            state.advance(batch_size, config.model.seq_length)
            if updated:  # Megatron and DeepSpeed: a skipped fp16 step does not advance the schedule
                scheduler.step(LRScheduler.increment(config, batch_size))
            result = StepResult(figures, updated, batch_size)
            metrics.record(state, result)
            hooks.on_step_end(state, result)
            failures.check_update(state, metrics)
            metrics.after_step(state)
            evaluator.after_step(state)
            checkpointer.after_step(state)
            if stop.after_step(state):
                metrics.flush(state)
                checkpointer.on_exit(state)
                stop.announce(state)
                break
        board.enter("logging")
        metrics.flush(state)
        if stop.ends_training:
            checkpointer.at_end(state)
            # Megatron ends training (or --skip-train) with an evaluation on the validation and test splits.
            evaluator.at_end(state)
        board.enter("end")
        sample = _sample(config, run, tokenizer)
    return TrainResult(state.iteration, state.consumed_samples, metrics.losses, evaluator.losses, sample=sample,
                       final_eval=evaluator.final, exit_reason=stop.reason)


def _announce(config: TrainConfig, run: TrainModel) -> None:
    for note in config.notes:
        log.info(f"> {note}")
    log.info(describe_model(config, run))  # (the stages' split is in arguments.describe's 'pipeline:' line)


def _sample(config: TrainConfig, run: TrainModel, tokenizer) -> Optional[str]:
    """--prompt: the trained model's continuation, logged and returned."""
    if config.generate.prompt is None or tokenizer is None:
        return None
    from megazero.model.sampling import generate_text

    sample = generate_text(run.engine.module, tokenizer, config.generate.prompt,
                           max_new_tokens=config.generate.tokens, seed=config.seed)
    log.info(f"> sample: {config.generate.prompt!r} ->\n{sample}")
    return sample


def build_tokenizer_agreed(config: TrainConfig):
    """The run's tokenizer (None for mock data without one), built on every rank; a bad file on
    any rank stops all of them with its message."""
    if config.data.tokenizer_type is None:
        return None
    from megazero.data import build_tokenizer

    def build():
        tok = build_tokenizer(config.data.tokenizer_type, **config.data.tokenizer_kwargs())
        check_vocab(config, tok.vocab_size)
        return tok

    return agree("tokenizer set-up", build, user_errors=(ValueError, OSError))


def _set_up_groups(config: TrainConfig):
    p = config.parallel
    mpu.init_distributed(p.distributed_backend, p.distributed_timeout_minutes * 60)
    if not mpu.model_parallel_is_initialized():
        return mpu.initialize_model_parallel(p.tp, p.pp, virtual_pipeline_model_parallel_size=p.virtual_pp
                                             if p.virtual_pp > 1 else None, context_parallel_size=p.cp,
                                             hierarchical_context_parallel_sizes=p.hierarchical_cp or None,
                                             expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp)
    groups = mpu.get_parallel_groups()
    if (groups.tp_size, groups.pp_size, groups.virtual_pp_size, groups.cp_size, groups.ep_size, groups.etp_size) != (
            p.tp, p.pp, p.virtual_pp, p.cp, p.ep, p.etp):
        raise RuntimeError(f"model parallel groups were set up for tp {groups.tp_size} x pp {groups.pp_size} x "
                           f"v {groups.virtual_pp_size} x cp {groups.cp_size} (ep {groups.ep_size}, etp {groups.etp_size}), the run "
                           f"asks tp {p.tp} x pp {p.pp} x v {p.virtual_pp} x cp {p.cp} (ep {p.ep}, etp {p.etp})")
    return groups
