"""Batch schedule: micro/global batch, ramp-up, iterations or samples, the LR schedule, evaluation and exit."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megazero.config.resolve.common import default, json_get
from megazero.config.train_config import ConfigError, ParallelConfig, ScheduleConfig, rampup_global_batch_size


def _rampup_iterations(rampup: tuple[int, int, int], gbs: int, train_samples: int) -> int:
    """Megatron's update_train_iters for a sample-based run with ramp-up (drops a partial last batch)."""
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += rampup_global_batch_size(rampup, gbs, consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


def _rampup_samples(rampup: tuple[int, int, int], gbs: int, iterations: int) -> int:
    """Samples consumed by ``iterations`` iterations under the ramp."""
    consumed = 0
    for done in range(iterations):
        if consumed > rampup[2]:
            return consumed + (iterations - done) * gbs
        consumed += rampup_global_batch_size(rampup, gbs, consumed)
    return consumed


def resolve_schedule(ns: argparse.Namespace, par: ParallelConfig, ds: Optional[dict[str, Any]],
                      ds_path: Optional[str], seq_length: int) -> ScheduleConfig:
    mbs = ns.micro_batch_size  # present: parse_args checked the required flags
    if mbs < 1:
        raise ConfigError(f"--micro-batch-size must be >= 1, got {mbs}")
    dp = par.dp
    ds_accum = json_get(ds or {}, "gradient_accumulation_steps")
    gbs = ns.global_batch_size
    if gbs is None:
        gbs = mbs * dp * (int(ds_accum) if ds_accum is not None else 1)
    if gbs < 1 or gbs % (mbs * dp):
        raise ConfigError(
            f"global batch size {gbs} is not divisible by micro batch size {mbs} x data-parallel size {dp} "
            f"= {mbs * dp} (dp = world size {par.world_size} / (tp {par.tp} x pp {par.pp})); "
            f"use a --global-batch-size that is a multiple of {mbs * dp}")
    accum = gbs // (mbs * dp)
    if ds_accum is not None and int(ds_accum) != accum:
        raise ConfigError(f"--deepspeed-config {ds_path} has gradient_accumulation_steps={ds_accum} but the command "
                          f"line gives {accum} (= --global-batch-size {gbs} / (--micro-batch-size {mbs} x dp {dp})); "
                          f"make them agree or drop gradient_accumulation_steps from the JSON")
    rampup = tuple(ns.rampup_batch_size) if ns.rampup_batch_size is not None else None
    if rampup is not None:
        start, incr, ramp = rampup
        if start < 1 or incr < 1 or ramp < 0:
            raise ConfigError(f"--rampup-batch-size START INCR SAMPLES needs START >= 1, INCR >= 1, SAMPLES >= 0; "
                              f"got {start} {incr} {ramp}")
        if start >= gbs or (gbs - start) % incr:
            raise ConfigError(f"--rampup-batch-size {start} {incr} {ramp}: --global-batch-size {gbs} minus START "
                              f"must be a positive multiple of INCR {incr}")
        if start % (mbs * dp) or incr % (mbs * dp):
            raise ConfigError(f"--rampup-batch-size {start} {incr} {ramp}: START and INCR must be multiples of "
                              f"micro batch {mbs} x data-parallel size {dp} = {mbs * dp}, so every ramp batch "
                              f"splits into whole micro-batches")

    if ns.train_iters is not None and ns.train_samples is not None:
        raise ConfigError("give exactly one of --train-iters and --train-samples (got both)")
    frac = ns.lr_warmup_fraction
    if frac is not None and not 0.0 <= frac <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got {frac}")
    wsd = None
    if ns.train_iters is not None:
        # Iteration-based run: LR flags in iterations too (Megatron refuses the mix).
        if ns.lr_decay_samples is not None or ns.lr_warmup_samples is not None or ns.lr_wsd_decay_samples is not None:
            raise ConfigError("with --train-iters give the LR schedule in iterations (--lr-decay-iters, "
                              "--lr-warmup-iters or --lr-warmup-fraction, --lr-wsd-decay-iters), not in samples")
        if ns.lr_warmup_iters is not None and frac is not None:
            raise ConfigError("give only one of --lr-warmup-iters and --lr-warmup-fraction")
        train_iters = ns.train_iters
        train_samples = train_iters * gbs if rampup is None else _rampup_samples(rampup, gbs, train_iters)
        # Megatron counts the schedule in samples of the *final* global batch here, ramp or not.
        decay_iters = default(ns.lr_decay_iters, train_iters)
        decay = decay_iters * gbs
        warmup = int(frac * decay) if frac is not None else default(ns.lr_warmup_iters, 0) * gbs
        if ns.lr_wsd_decay_iters is not None:
            wsd = ns.lr_wsd_decay_iters * gbs
        warmup_flag = (f"--lr-warmup-fraction {frac}" if frac is not None else
                       f"--lr-warmup-iters {default(ns.lr_warmup_iters, 0)}")
        decay_flag = f"--lr-decay-iters {decay_iters}"
    else:
        if ns.lr_decay_iters is not None or ns.lr_warmup_iters is not None or ns.lr_wsd_decay_iters is not None:
            raise ConfigError("with --train-samples give the LR schedule in samples (--lr-decay-samples, "
                              "--lr-warmup-samples or --lr-warmup-fraction, --lr-wsd-decay-samples), not in "
                              "iterations")
        if ns.lr_warmup_samples is not None and frac is not None:
            raise ConfigError("give only one of --lr-warmup-samples and --lr-warmup-fraction")
        train_samples = ns.train_samples
        train_iters = train_samples // gbs if rampup is None else _rampup_iterations(rampup, gbs, train_samples)
        if train_iters < 1:
            raise ConfigError(f"--train-samples {train_samples} is less than one global batch ({gbs})")
        decay = default(ns.lr_decay_samples, train_samples)
        warmup = int(frac * decay) if frac is not None else default(ns.lr_warmup_samples, 0)
        wsd = ns.lr_wsd_decay_samples
        warmup_flag = (f"--lr-warmup-fraction {frac}" if frac is not None else f"--lr-warmup-samples {warmup}")
        decay_flag = f"--lr-decay-samples {decay}"
    unit = "samples"
    if ns.lr_decay_tokens is not None or ns.lr_warmup_tokens is not None:
        # Megatron-DeepSpeed's token schedule. Without curriculum learning a sample is exactly
        # seq_length tokens, so the sample-counted parts convert exactly.
        unit = "tokens"
        if ns.lr_decay_tokens is not None:
            decay, decay_flag = ns.lr_decay_tokens, f"--lr-decay-tokens {ns.lr_decay_tokens}"
        else:
            decay *= seq_length
        if ns.lr_warmup_tokens is not None:
            if frac is not None:
                raise ConfigError("give only one of --lr-warmup-tokens and --lr-warmup-fraction")
            warmup, warmup_flag = ns.lr_warmup_tokens, f"--lr-warmup-tokens {ns.lr_warmup_tokens}"
        else:
            warmup = int(frac * decay) if frac is not None else warmup * seq_length
        if wsd is not None:
            wsd *= seq_length
    if ns.train_tokens is not None and ns.train_tokens < 1:
        raise ConfigError(f"--train-tokens must be >= 1, got {ns.train_tokens}")
    if train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {train_iters}")
    if decay < 1 or warmup < 0:
        raise ConfigError(f"the LR decay must be >= 1 step and warmup >= 0; got {decay_flag}, {warmup_flag}")
    if warmup > decay:
        raise ConfigError(f"LR warmup ({warmup_flag} = {warmup} {unit}) is longer than the LR decay "
                          f"({decay_flag} = {decay} {unit}); shorten the warmup or lengthen the decay")
    style = default(ns.lr_decay_style, "linear")
    if style == "WSD":
        if wsd is None:
            raise ConfigError("--lr-decay-style WSD needs the length of its final decay: --lr-wsd-decay-iters "
                              "(with --train-iters) or --lr-wsd-decay-samples (with --train-samples)")
        if not 0 < wsd <= decay - warmup:
            raise ConfigError(f"the WSD decay ({wsd} {unit}) must be > 0 and fit between the end of warmup "
                              f"({warmup}) and the end of the LR decay ({decay})")
    elif wsd is not None or ns.lr_wsd_decay_style is not None:
        raise ConfigError("--lr-wsd-decay-style/--lr-wsd-decay-iters/--lr-wsd-decay-samples need "
                          "--lr-decay-style WSD")
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                          "each other; the first keeps the command line's schedule, the second the checkpoint's")
    sched = ScheduleConfig(
        micro_batch_size=mbs, global_batch_size=gbs, grad_accum_steps=accum,
        train_iters=train_iters, train_samples=train_samples,
        lr_decay_style=style, lr_unit=unit,
        lr_warmup_samples=warmup, lr_decay_samples=decay, lr_warmup_init=default(ns.lr_warmup_init, 0.0),
        lr_wsd_decay_style=default(ns.lr_wsd_decay_style, "exponential"), lr_wsd_decay_samples=wsd,
        rampup_batch_size=rampup, train_tokens=ns.train_tokens,
        eval_interval=default(ns.eval_interval, 1000), eval_iters=default(ns.eval_iters, 100),
        exit_interval=ns.exit_interval, exit_duration_in_mins=ns.exit_duration_in_mins,
        exit_signal_handler=bool(ns.exit_signal_handler), skip_train=bool(ns.skip_train),
        check_for_nan_in_loss_and_grad=ns.check_for_nan_in_loss_and_grad is not False,
        override_opt_param_scheduler=bool(ns.override_opt_param_scheduler),
        use_checkpoint_opt_param_scheduler=bool(ns.use_checkpoint_opt_param_scheduler))
    if sched.lr_warmup_init < 0:
        raise ConfigError(f"--lr-warmup-init must be >= 0, got {sched.lr_warmup_init}")
    if sched.eval_interval < 0 or sched.eval_iters < 0:
        raise ConfigError(f"--eval-interval and --eval-iters must be >= 0, got {sched.eval_interval}, {sched.eval_iters}")
    if sched.exit_interval is not None and sched.exit_interval < 1:
        raise ConfigError(f"--exit-interval must be >= 1, got {sched.exit_interval}")
    if sched.exit_duration_in_mins is not None and sched.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins must be > 0, got {sched.exit_duration_in_mins}")
    return sched
