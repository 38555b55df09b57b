"""Megatron-style command line -> validated ``TrainConfig``.

Flag names follow Megatron-LM (and Megatron-DeepSpeed for ``--zero-stage``,
``--deepspeed_config``, ``--no-pipeline-parallel``), so existing launch scripts
mostly run unchanged. Everything is checked here, *before* ``torch.distributed``
starts: a bad batch split or a missing file found after the first collective
would hang or crash every rank at once, far from its cause.

Precedence of a value: command line > --deepspeed-config JSON > --model-preset >
built-in default. A value given on the command line *and* in the JSON must agree.

    cfg = parse_args_or_exit(None, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    tokenizer = megazero.data.build_tokenizer(cfg.data.tokenizer_type, **cfg.data.tokenizer_kwargs())
    check_vocab(cfg, tokenizer.vocab_size)
    engine = megazero.zero.initialize(model, cfg.to_deepspeed_config(), mpu=mpu)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from megazero.model.config import PRESETS, GPTConfig
from megazero.training.ds_keys import classify as classify_ds_keys
from megazero.training.flags import add_to_parser, refusals
from megazero.training.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    GenerateConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    ScheduleConfig,
    TrainConfig,
    rampup_global_batch_size,
)

__all__ = ["ConfigError", "build_parser", "parse_args", "parse_args_or_exit", "check_vocab", "describe"]

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer", "HFTokenizer", "NullTokenizer")
DEFAULT_TOKENIZER = "GPT2BPETokenizer"  # Megatron's pretrain_gpt.py args_defaults
GPT2_VOCAB_SIZE = 50257  # GPT-2 BPE (50,000 merges + 256 bytes + <|endoftext|>)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers (and tests) decide."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (run with --help for the list of flags)")


def build_parser() -> argparse.ArgumentParser:
    """The flag set, built from the table in ``megazero.training.flags``. Defaults are None
    on purpose: "not given" must be told apart from "given as the default" to merge presets
    and the DeepSpeed JSON correctly, and to find refused flags."""
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with tensor parallelism and ZeRO. "
                "[honoured]: Megatron's meaning; [mapped]: met by the megazero mechanism named; "
                "[refused]: stops before any process group starts.", allow_abbrev=False)
    add_to_parser(p)
    return p


# ------------------------------------------------------------------------------------------
# DeepSpeed JSON merge
# ------------------------------------------------------------------------------------------

# (JSON key path, namespace attribute, flag as the user spells it, JSON value -> flag value)
_DS_KEYS: list[tuple[str, str, str, Callable[[Any], Any]]] = [
    ("train_micro_batch_size_per_gpu", "micro_batch_size", "--micro-batch-size", int),
    ("train_batch_size", "global_batch_size", "--global-batch-size", int),
    ("zero_optimization.stage", "zero_stage", "--zero-stage", int),
    ("optimizer.params.lr", "lr", "--lr", float),
    ("optimizer.params.betas.0", "adam_beta1", "--adam-beta1", float),
    ("optimizer.params.betas.1", "adam_beta2", "--adam-beta2", float),
    ("optimizer.params.eps", "adam_eps", "--adam-eps", float),
    ("optimizer.params.weight_decay", "weight_decay", "--weight-decay", float),
    ("gradient_clipping", "clip_grad", "--clip-grad", float),
    ("bf16.enabled", "bf16", "--bf16", bool),
    ("bfloat16.enabled", "bf16", "--bf16", bool),  # DeepSpeed's older spelling
    ("fp16.enabled", "fp16", "--fp16", bool),
    ("optimizer.params.momentum", "sgd_momentum", "--sgd-momentum", float),
    # The fp16 loss-scaler keys are resolved in _resolve_precision: there the JSON's block governs.
]


def _json_get(d: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return None
    return None if d == "auto" else d  # HF-style "auto" means "take it from the command line"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _load_deepspeed_json(path: Optional[str]) -> Optional[dict[str, Any]]:
    if path is None:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed-config file '{path}' does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed-config file '{path}' is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed-config file '{path}' must hold a JSON object, got {type(data).__name__}")
    return data


def _merge_deepspeed_json(ns: argparse.Namespace, ds: dict[str, Any], path: str) -> None:
    """Fill flags the command line left unset from the JSON; refuse disagreements."""
    for key, attr, flag_name, convert in _DS_KEYS:
        raw = _json_get(ds, key)
        if raw is None:
            continue
        value = convert(raw)
        given = getattr(ns, attr)
        if isinstance(value, bool):
            other = {"bf16": ("fp16", "--fp16"), "fp16": ("bf16", "--bf16")}[attr]
            if value and getattr(ns, other[0]) and given is None:
                raise ConfigError(f"--deepspeed-config {path} has {key}=true but the command line passes "
                                  f"{other[1]}; choose one precision")
            if given is None:
                setattr(ns, attr, value or None)
            elif not value:  # flag present (True), JSON says disabled
                raise ConfigError(f"--deepspeed-config {path} has {key}={json.dumps(raw)} but the command line "
                                  f"passes {flag_name}; make them agree (drop {flag_name} or enable it in the JSON)")
            continue
        if given is None:
            setattr(ns, attr, value)
        elif not _same(given, value):
            raise ConfigError(f"--deepspeed-config {path} has {key}={json.dumps(raw)} but the command line has "
                              f"{flag_name} {given}; make them agree or set it in one place only")


# ------------------------------------------------------------------------------------------
# resolution, one concern at a time
# ------------------------------------------------------------------------------------------

def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _check_local_rank(ns: argparse.Namespace) -> None:
    """The `deepspeed` launcher and torch.distributed.launch pass --local_rank=N and also set LOCAL_RANK;
    the environment is what megazero reads, so the two must agree."""
    env = os.environ.get("LOCAL_RANK")
    if ns.local_rank is not None and env is not None and int(env) != ns.local_rank:
        raise ConfigError(f"--local_rank={ns.local_rank} disagrees with LOCAL_RANK={env} in the environment; "
                          f"launch with torchrun, deepspeed or srun, which set both consistently")


def _resolve_parallel(ns: argparse.Namespace, world_size: int, notes: list[str], check_files: bool) -> ParallelConfig:
    tp, pp = _default(ns.tp, 1), _default(ns.pp, 1)
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp and --pp must be >= 1, got --tp {tp} --pp {pp}")
    if ns.no_pipeline_parallel and pp > 1:
        raise ConfigError(f"--no-pipeline-parallel (Megatron-DeepSpeed: pipeline size 1) contradicts "
                          f"--pipeline-model-parallel-size {pp}; drop one of them")
    for flag_name, value in (("--virtual-pipeline-model-parallel-size", ns.virtual_pipeline_model_parallel_size),
                             ("--num-layers-per-virtual-pipeline-stage", ns.num_layers_per_virtual_pipeline_stage),
                             ("--decoder-first-pipeline-num-layers", ns.decoder_first_pipeline_num_layers),
                             ("--decoder-last-pipeline-num-layers", ns.decoder_last_pipeline_num_layers)):
        if value is not None and pp == 1:
            raise ConfigError(f"{flag_name} {value} needs a pipeline (--pipeline-model-parallel-size > 1), got --pp 1")
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}; "
                          f"launch a multiple of {tp * pp} processes or change --tp")
    zero_stage = ns.zero_stage
    if ns.use_distributed_optimizer:
        if zero_stage == 0:
            raise ConfigError("--use-distributed-optimizer (optimizer states sharded over data parallel, i.e. "
                              "ZeRO-1) contradicts --zero-stage 0; drop one of them")
        if zero_stage is None:
            zero_stage = 1
            notes.append("--use-distributed-optimizer: ZeRO stage 1 (optimizer states sharded over data parallel)")
    zero_stage = _default(zero_stage, 1)
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    sp = bool(ns.sequence_parallel)
    if sp and tp == 1:
        raise ConfigError("--sequence-parallel needs --tp > 1 (it shards activations over the tensor-parallel "
                          "group); drop --sequence-parallel or raise --tp")
    backend = ns.distributed_backend
    if backend == "nccl" and check_files and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs and none is visible; use "
                          "--distributed-backend gloo to run on CPUs")
    return ParallelConfig(tp=tp, pp=pp, dp=world_size // (tp * pp), world_size=world_size,
                          zero_stage=zero_stage, sequence_parallel=sp, distributed_backend=backend,
                          decoder_first_pipeline_num_layers=ns.decoder_first_pipeline_num_layers,
                          decoder_last_pipeline_num_layers=ns.decoder_last_pipeline_num_layers)


def _resolve_pipeline(ns: argparse.Namespace, par: ParallelConfig, model: GPTConfig, schedule: ScheduleConfig) -> None:
    """Virtual stages and the layer split, checked against the layers and micro-batches before any collective."""
    from ..model.pipeline_split import PipelineSplitError, layers_per_chunk_table, virtual_stages_from_layers_per_stage

    if par.pp == 1:
        return
    v_given, per_chunk = ns.virtual_pipeline_model_parallel_size, ns.num_layers_per_virtual_pipeline_stage
    try:
        v = 1 if v_given is None else v_given
        if per_chunk is not None:
            if par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None:
                raise ConfigError("--num-layers-per-virtual-pipeline-stage assumes an even split; with "
                                  "--decoder-first/last-pipeline-num-layers give --virtual-pipeline-model-parallel-size")
            v = virtual_stages_from_layers_per_stage(model.num_layers, par.pp, per_chunk)
            if v_given is not None and v_given != v:
                raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} gives {v} model chunks per "
                                  f"rank ({model.num_layers} layers / (pp {par.pp} x {per_chunk})) but "
                                  f"--virtual-pipeline-model-parallel-size is {v_given}; give one of them")
        if v < 1:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {v}")
        layers_per_chunk_table(model.num_layers, par.pp, v, par.decoder_first_pipeline_num_layers,
                               par.decoder_last_pipeline_num_layers)
    except PipelineSplitError as e:
        raise ConfigError(f"pipeline layout: {e}") from None
    m = schedule.grad_accum_steps
    if v > 1:
        per_micro = schedule.micro_batch_size * par.dp
        sizes = [m] + ([schedule.rampup_batch_size[0] // per_micro, schedule.rampup_batch_size[1] // per_micro]
                       if schedule.rampup_batch_size else [])
        for n in sizes:
            if n % par.pp:
                raise ConfigError(
                    f"interleaved 1F1B (v = {v}) runs micro-batches in groups of pp = {par.pp}, but a step has {n} "
                    f"micro-batches (global batch / (micro batch {schedule.micro_batch_size} x dp {par.dp})); use a "
                    f"--global-batch-size giving a multiple of {par.pp} micro-batches, or drop the virtual stages")
    par.virtual_pp = v


# DeepSpeed's fp16 block: (JSON key, DeepSpeed's default, namespace attribute, flag, JSON -> PrecisionConfig value)
_FP16_KEYS: list[tuple[str, Any, str, str, Callable[[Any], Any]]] = [
    ("loss_scale", 0, "loss_scale", "--loss-scale", lambda v: float(v) if float(v) > 0 else None),
    ("initial_scale_power", 16, "initial_loss_scale", "--initial-loss-scale", lambda v: 2.0 ** int(v)),
    ("loss_scale_window", 1000, "loss_scale_window", "--loss-scale-window", int),
    ("hysteresis", 2, "hysteresis", "--hysteresis", int),
    ("min_loss_scale", 1, "min_loss_scale", "--min-loss-scale", float),
]


def _resolve_precision(ns: argparse.Namespace, ds: Optional[dict[str, Any]], ds_path: Optional[str],
                       notes: list[str]) -> PrecisionConfig:
    if ns.bf16 and ns.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive; choose one (bf16 needs no loss scaling)")
    dtype = "bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32"
    prec = PrecisionConfig(dtype=dtype, accumulate_grads_fp32=bool(ns.accumulate_allreduce_grads_in_fp32))
    block = (ds or {}).get("fp16")
    if dtype == "fp16" and isinstance(block, dict):
        # As in Megatron-DeepSpeed, the JSON's fp16 block drives DeepSpeed's loss scaler and the
        # --loss-scale family is not read; DeepSpeed's defaults fill what the block leaves out.
        for key, ds_default, attr, flag_name, convert in _FP16_KEYS:
            explicit = key in block and block[key] != "auto"
            value = convert(block[key] if explicit else ds_default)
            setattr(prec, attr, value)
            given = getattr(ns, attr)
            if given is None or _same(given, value):
                continue
            static_pair = attr == "loss_scale" and value is not None
            if explicit and (attr != "loss_scale" or static_pair):
                raise ConfigError(f"--deepspeed_config {ds_path} has fp16.{key}={json.dumps(block[key])} but the "
                                  f"command line has {flag_name} {given:g}; make them agree or set it in one place")
            shown = "dynamic" if value is None else f"{value:g}"
            notes.append(f"{flag_name} {given:g} is superseded by the DeepSpeed JSON's fp16 block "
                         f"({key} {'=' if explicit else 'default'} {shown}), as in Megatron-DeepSpeed")
        prec.consecutive_hysteresis = bool(block.get("consecutive_hysteresis", False))
    else:
        prec.loss_scale = ns.loss_scale
        for attr in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
            if getattr(ns, attr) is not None:
                setattr(prec, attr, getattr(ns, attr))
    if prec.loss_scale is not None and prec.loss_scale <= 0:
        raise ConfigError(f"--loss-scale must be > 0 (omit it for dynamic scaling), got {prec.loss_scale}")
    power = math.log2(prec.initial_loss_scale) if prec.initial_loss_scale > 0 else 0.5
    if power != int(power):
        raise ConfigError(f"--initial-loss-scale must be a power of 2 (e.g. 65536), got {prec.initial_loss_scale}")
    if prec.min_loss_scale <= 0 or prec.loss_scale_window < 1 or prec.hysteresis < 1:
        raise ConfigError(f"need --min-loss-scale > 0, --loss-scale-window >= 1, --hysteresis >= 1; got "
                          f"{prec.min_loss_scale}, {prec.loss_scale_window}, {prec.hysteresis}")
    return prec


def _resolve_optim(ns: argparse.Namespace, ds: Optional[dict[str, Any]]) -> OptimConfig:
    if ns.lr is None:
        raise ConfigError("--lr is required (the peak learning rate, e.g. --lr 3e-4), or set "
                          "optimizer.params.lr in --deepspeed-config")
    o = OptimConfig(lr=ns.lr)
    ds_type = _json_get(ds or {}, "optimizer.type")
    if ds_type is not None:
        if str(ds_type).lower() not in ("adam", "adamw", "fusedadam", "sgd"):
            raise ConfigError(f"--deepspeed-config optimizer.type {ds_type!r} is not supported; use Adam, AdamW "
                              f"or SGD")
        if ns.optimizer is not None and (ns.optimizer == "sgd") != (str(ds_type).lower() == "sgd"):
            raise ConfigError(f"--deepspeed-config optimizer.type {ds_type!r} disagrees with --optimizer "
                              f"{ns.optimizer}; set it in one place")
        o.type = "SGD" if str(ds_type).lower() == "sgd" else str(ds_type)
    if ns.optimizer == "sgd":
        o.type = "SGD"
    if o.type == "SGD":
        _check_engine_has_sgd()
    elif ns.sgd_momentum is not None:
        raise ConfigError("--sgd-momentum needs --optimizer sgd")
    for attr in ("min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "sgd_momentum"):
        if getattr(ns, attr) is not None:
            setattr(o, attr, getattr(ns, attr))
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr and --lr > 0, got --lr {o.lr} --min-lr {o.min_lr}")
    if not (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1) or o.adam_eps <= 0:
        raise ConfigError(f"Adam needs betas in [0, 1) and eps > 0, got --adam-beta1 {o.adam_beta1} "
                          f"--adam-beta2 {o.adam_beta2} --adam-eps {o.adam_eps}")
    if not 0 <= o.sgd_momentum < 1:
        raise ConfigError(f"--sgd-momentum must be in [0, 1), got {o.sgd_momentum}")
    if o.weight_decay < 0 or o.clip_grad < 0:
        raise ConfigError(f"--weight-decay and --clip-grad must be >= 0, got {o.weight_decay} and {o.clip_grad}")
    style = _default(ns.weight_decay_incr_style, "constant")
    o.weight_decay_incr_style = style
    if style == "constant":
        # Megatron: a constant schedule is --weight-decay; start/end belong to the other styles.
        if ns.start_weight_decay is not None or ns.end_weight_decay is not None:
            raise ConfigError("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
                              "cosine (with the default 'constant', use --weight-decay)")
    else:
        if ns.start_weight_decay is None or ns.end_weight_decay is None:
            raise ConfigError(f"--weight-decay-incr-style {style} needs both --start-weight-decay and "
                              f"--end-weight-decay")
        if ns.start_weight_decay < 0 or ns.end_weight_decay < 0:
            raise ConfigError(f"weight decays must be >= 0, got --start-weight-decay {ns.start_weight_decay} "
                              f"--end-weight-decay {ns.end_weight_decay}")
        o.start_weight_decay, o.end_weight_decay = ns.start_weight_decay, ns.end_weight_decay
        # The engine puts parameters into the decayed group when its weight decay is > 0; the
        # schedule then sets the value every step.
        o.weight_decay = max(o.start_weight_decay, o.end_weight_decay)
    return o


def _check_engine_has_sgd() -> None:
    """SGD needs the ZeRO engine to build torch.optim.SGD over its fp32 partitions; refuse it up
    front on a build whose engine config does not know the type (rather than train with Adam)."""
    from megazero.zero.config import ZeroConfigError, load_config

    try:
        load_config({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})
    except ZeroConfigError as e:
        raise ConfigError(f"--optimizer sgd is not available in this build's ZeRO engine ({e}); use --optimizer "
                          f"adam") from None


_DS_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def _merge_deepspeed_scheduler(ns: argparse.Namespace, ds: dict[str, Any], path: str, notes: list[str]) -> None:
    """DeepSpeed's `scheduler` block -> the --lr* flags (in iterations), refusing disagreements."""
    sched = ds.get("scheduler")
    if not sched:
        return
    kind = sched.get("type")
    if kind not in _DS_SCHEDULERS:
        raise ConfigError(f"--deepspeed_config {path}: scheduler.type {kind!r} is not supported; remove the "
                          f"scheduler block and use --lr-decay-style (constant, linear, cosine, "
                          f"inverse-square-root, WSD) with --lr-warmup-iters/--lr-decay-iters")
    p = dict(sched.get("params", {}))
    if p.get("warmup_type", "log") != "linear" and int(p.get("warmup_num_steps", 1000)) > 0:
        raise ConfigError(f"--deepspeed_config {path}: scheduler.params.warmup_type "
                          f"{p.get('warmup_type', 'log')!r} (DeepSpeed's default is 'log') is not supported; set "
                          f"\"warmup_type\": \"linear\" (Megatron's warmup) or use --lr-warmup-iters")
    lr = ns.lr if ns.lr is not None else _json_get(ds, "optimizer.params.lr")
    values: dict[str, tuple[str, Any]] = {"lr_decay_style": ("--lr-decay-style", _DS_SCHEDULERS[kind]),
                                          "lr_warmup_iters": ("--lr-warmup-iters", int(p.get("warmup_num_steps", 1000)))}
    if kind in ("WarmupLR", "WarmupDecayLR"):
        values["lr_warmup_init"] = ("--lr-warmup-init", float(p.get("warmup_min_lr", 0.0)))
        values["lr"] = ("--lr", float(p.get("warmup_max_lr", 0.001)))
        if kind == "WarmupDecayLR":
            values["min_lr"] = ("--min-lr", float(p.get("warmup_min_lr", 0.0)))
    else:
        if lr is None:
            raise ConfigError(f"--deepspeed_config {path}: WarmupCosineLR scales the optimizer's lr; give --lr")
        values["lr_warmup_init"] = ("--lr-warmup-init", float(lr) * float(p.get("warmup_min_ratio", 0.0)))
        values["min_lr"] = ("--min-lr", float(lr) * float(p.get("cos_min_ratio", 0.0001)))
    if kind != "WarmupLR":
        if "total_num_steps" not in p:
            raise ConfigError(f"--deepspeed_config {path}: scheduler {kind} needs params.total_num_steps")
        values["lr_decay_iters"] = ("--lr-decay-iters", int(p["total_num_steps"]))
    for attr, (flag_name, value) in values.items():
        given = getattr(ns, attr)
        if given is None:
            setattr(ns, attr, value)
        elif not _same(given, value):
            raise ConfigError(f"--deepspeed_config {path} scheduler {kind} gives {flag_name} {value} but the command "
                              f"line has {flag_name} {given}; make them agree or drop the scheduler block")
    notes.append(f"DeepSpeed scheduler {kind} -> " + " ".join(f"{f} {v}" for f, v in values.values()))


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


def _resolve_schedule(ns: argparse.Namespace, par: ParallelConfig, ds: Optional[dict[str, Any]],
                      ds_path: Optional[str], seq_length: int) -> ScheduleConfig:
    mbs = ns.micro_batch_size
    if mbs is None:
        raise ConfigError("--micro-batch-size is required (sequences per rank per forward pass), or set "
                          "train_micro_batch_size_per_gpu in --deepspeed-config")
    if mbs < 1:
        raise ConfigError(f"--micro-batch-size must be >= 1, got {mbs}")
    dp = par.dp
    ds_accum = _json_get(ds or {}, "gradient_accumulation_steps")
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

    if (ns.train_iters is None) == (ns.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples "
                          f"(got {'both' if ns.train_iters is not None else 'neither'})")
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
        decay_iters = _default(ns.lr_decay_iters, train_iters)
        decay = decay_iters * gbs
        warmup = int(frac * decay) if frac is not None else _default(ns.lr_warmup_iters, 0) * gbs
        if ns.lr_wsd_decay_iters is not None:
            wsd = ns.lr_wsd_decay_iters * gbs
        warmup_flag = (f"--lr-warmup-fraction {frac}" if frac is not None else
                       f"--lr-warmup-iters {_default(ns.lr_warmup_iters, 0)}")
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
        decay = _default(ns.lr_decay_samples, train_samples)
        warmup = int(frac * decay) if frac is not None else _default(ns.lr_warmup_samples, 0)
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
    style = _default(ns.lr_decay_style, "linear")
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
        lr_warmup_samples=warmup, lr_decay_samples=decay, lr_warmup_init=_default(ns.lr_warmup_init, 0.0),
        lr_wsd_decay_style=_default(ns.lr_wsd_decay_style, "exponential"), lr_wsd_decay_samples=wsd,
        rampup_batch_size=rampup, train_tokens=ns.train_tokens,
        eval_interval=_default(ns.eval_interval, 1000), eval_iters=_default(ns.eval_iters, 100),
        exit_interval=ns.exit_interval, exit_duration_in_mins=ns.exit_duration_in_mins,
        exit_signal_handler=bool(ns.exit_signal_handler), skip_train=bool(ns.skip_train),
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


def _parse_prefixes(flag_name: str, items: list[str]) -> tuple[list[str], Optional[list[float]]]:
    from megazero.data.gpt_dataset import parse_data_prefix  # lazy: numpy etc.

    try:
        return parse_data_prefix(items)
    except ValueError as e:
        raise ConfigError(f"{flag_name}: {e}") from None


def _resolve_data(ns: argparse.Namespace, check_files: bool) -> DataConfig:
    from megazero.data.gpt_dataset import parse_split  # lazy: numpy etc.

    d = DataConfig(data_path=list(ns.data_path or []), split=_default(ns.split, "969,30,1"),
                   mock_data=bool(ns.mock_data), tokenizer_type=ns.tokenizer_type,
                   tokenizer_model=ns.tokenizer_model, vocab_file=ns.vocab_file, merge_file=ns.merge_file,
                   vocab_size=ns.vocab_size, train_data_path=list(ns.train_data_path or []),
                   valid_data_path=list(ns.valid_data_path or []), test_data_path=list(ns.test_data_path or []),
                   data_cache_path=ns.data_cache_path, num_workers=_default(ns.num_workers, 0),
                   reset_position_ids=bool(ns.reset_position_ids), reset_attention_mask=bool(ns.reset_attention_mask),
                   eod_mask_loss=bool(ns.eod_mask_loss), vocab_extra_ids=_default(ns.vocab_extra_ids, 0))
    if d.num_workers < 0 or d.vocab_extra_ids < 0:
        raise ConfigError(f"--num-workers and --vocab-extra-ids must be >= 0, got {d.num_workers}, {d.vocab_extra_ids}")
    try:
        parse_split(d.split)
    except ValueError as e:
        raise ConfigError(f"--split: {e}") from None
    separate = d.train_data_path or d.valid_data_path or d.test_data_path
    if separate and d.data_path:
        raise ConfigError("give either --data-path (split by --split) or --train-data-path/--valid-data-path/"
                          "--test-data-path, not both")
    if separate and not d.train_data_path:
        raise ConfigError("--valid-data-path/--test-data-path need --train-data-path")
    if not d.data_path and not separate and not d.mock_data:
        raise ConfigError("--data-path is required (a prefix of PREFIX.bin/PREFIX.idx from tools/preprocess_data.py), "
                          "or --train-data-path, or --mock-data for synthetic tokens")
    prefixes = []
    if d.data_path:
        d.prefixes, d.weights = _parse_prefixes("--data-path", d.data_path)
        prefixes += d.prefixes
    for flag_name, items in (("--train-data-path", d.train_data_path), ("--valid-data-path", d.valid_data_path),
                             ("--test-data-path", d.test_data_path)):
        if items:
            prefixes += _parse_prefixes(flag_name, items)[0]
    if check_files and not d.mock_data:
        for prefix in prefixes:
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ConfigError(f"data prefix '{prefix}': missing {' and '.join(missing)}; give the prefix "
                                  f"without extension, as written by tools/preprocess_data.py (or use --mock-data)")

    t = d.tokenizer_type
    if t is None:
        if d.mock_data and d.vocab_file is None:
            asked = [f for f, on in (("--reset-position-ids", d.reset_position_ids),
                                     ("--reset-attention-mask", d.reset_attention_mask),
                                     ("--eod-mask-loss", d.eod_mask_loss)) if on]
            if asked:
                raise ConfigError(f"{', '.join(asked)} need the end-of-document token of a tokenizer; with "
                                  f"--mock-data pass --tokenizer-type (e.g. NullTokenizer --vocab-size N)")
            return d
        t = d.tokenizer_type = DEFAULT_TOKENIZER
    from megazero.data.tokenizer import TOKENIZER_TYPES as built

    if t not in built:
        raise ConfigError(f"--tokenizer-type {t} is not available in this build's megazero.data (it has "
                          f"{', '.join(built)}); use one of those")
    model_file = ("--tokenizer-model", d.tokenizer_model, "file")
    needs = {"SentencePieceTokenizer": [model_file], "GPTSentencePieceTokenizer": [model_file],
             "Llama2Tokenizer": [model_file],
             "HuggingFaceTokenizer": [("--tokenizer-model", d.tokenizer_model, "directory")],
             "HFTokenizer": [("--tokenizer-model", d.tokenizer_model, "directory")],
             "GPT2BPETokenizer": [("--vocab-file", d.vocab_file, "file"), ("--merge-file", d.merge_file, "file")],
             "NullTokenizer": []}[t]
    default_note = " (the default without --tokenizer-type, as Megatron's pretrain_gpt.py)" \
        if ns.tokenizer_type is None else ""
    for flag_name, value, kind in needs:
        if value is None:
            raise ConfigError(f"--tokenizer-type {t}{default_note} needs {flag_name}")
        if check_files and not os.path.exists(value):
            raise ConfigError(f"{flag_name} '{value}' does not exist (the {kind} of the {t})")
    if d.vocab_extra_ids and t != "SentencePieceTokenizer":
        raise ConfigError(f"--vocab-extra-ids {d.vocab_extra_ids}: Megatron adds the <extra_id_N> sentinels to "
                          f"SentencePieceTokenizer only ({t} would ignore them); drop the flag or use "
                          f"--tokenizer-type SentencePieceTokenizer")
    if t == "NullTokenizer" and (d.vocab_size is None or d.vocab_size < 1):
        raise ConfigError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got {d.vocab_size})")
    return d


def _model_vocab_size(ns: argparse.Namespace, data: DataConfig, preset: dict[str, Any], check_files: bool) -> int:
    """The model's (unpadded) vocabulary, Megatron's way: the tokenizer decides.

    NullTokenizer: --vocab-size + 1 (its EOD id). Other tokenizers: read from the
    tokenizer files (or --vocab-size, an explicit override that must not be smaller).
    No tokenizer (mock data): --vocab-size, else the preset's.
    """
    t = data.tokenizer_type
    if t == "NullTokenizer":
        return data.vocab_size + 1
    if t is not None and ns.vocab_size is None:
        if check_files:
            from megazero.data import build_tokenizer  # lazy: tokenizer libraries

            try:
                return build_tokenizer(t, **data.tokenizer_kwargs()).vocab_size
            except (OSError, ValueError, RuntimeError) as e:
                raise ConfigError(f"could not load the {t} to read its vocabulary size: {e}") from None
        if t == "GPT2BPETokenizer":
            return GPT2_VOCAB_SIZE
    if ns.vocab_size is not None:
        if ns.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {ns.vocab_size}")
        return ns.vocab_size
    if "vocab_size" in preset:
        return preset["vocab_size"]
    raise ConfigError("cannot tell the vocabulary size: pass --vocab-size (or --tokenizer-type with its files, "
                      "or a --model-preset)")


# Model options whose GPTConfig fields come with the model work of issue 12 (the "megaworld" branch):
# (GPTConfig field, flag, value that means "off"). A flag is passed only when set; a build whose
# GPTConfig lacks the field refuses the flag instead of dropping it.
MODEL_FIELD_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("rotary_percent", "--rotary-percent", 1.0),
    ("kv_channels", "--kv-channels", None),
    ("qk_layernorm", "--qk-layernorm", False),
    ("apply_layernorm_1p", "--apply-layernorm-1p", False),
    ("init_method", "--init-method-xavier-uniform", "normal"),
    ("fp32_residual_connection", "--fp32-residual-connection", False),
    ("apply_query_key_layer_scaling", "--apply-query-key-layer-scaling", False),
)


def model_field_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """GPTConfig keyword arguments of the newer model flags that the command line set."""
    kw: dict[str, Any] = {}
    if ns.rotary_percent is not None:
        kw["rotary_percent"] = ns.rotary_percent
    if ns.kv_channels is not None:
        kw["kv_channels"] = ns.kv_channels
    for attr in ("qk_layernorm", "apply_layernorm_1p", "fp32_residual_connection"):
        if getattr(ns, attr):
            kw[attr] = True
    if ns.init_method_xavier_uniform:
        kw["init_method"] = "xavier_uniform"
    if ns.apply_query_key_layer_scaling is not None:
        kw["apply_query_key_layer_scaling"] = bool(ns.apply_query_key_layer_scaling)
    return kw


def build_gpt_config(kw: dict[str, Any]) -> GPTConfig:
    """GPTConfig(**kw), refusing (not dropping) options this build's GPTConfig has no field for."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    flag_of = {name: flag_name for name, flag_name, _ in MODEL_FIELD_FLAGS}
    off = {name: value for name, _, value in MODEL_FIELD_FLAGS}
    for name in [k for k in kw if k not in fields]:
        if name in off and kw[name] == off[name]:
            kw.pop(name)  # asks for what this model does anyway
        else:
            raise ConfigError(f"{flag_of.get(name, name)} is not supported by this build's model "
                              f"(GPTConfig has no field '{name}')")
    return GPTConfig(**kw)


_ATTENTION_BACKENDS = {"auto": "auto", "flash": "flash", "fused": "sdpa", "unfused": "math", "local": "math"}


def _checkpoint_model(load: str) -> dict[str, Any]:
    """The model section of the config saved with the latest checkpoint in ``load`` (--use-checkpoint-args)."""
    from megazero.training.checkpointing import checkpoint_dir, latest_iteration

    iteration = latest_iteration(load) if os.path.isdir(load) else None
    if iteration is None:
        raise ConfigError(f"--use-checkpoint-args: {load} holds no megazero checkpoint ('latest' is missing)")
    path = os.path.join(checkpoint_dir(load, iteration), "config.json")
    try:
        with open(path) as f:
            return json.load(f)["model"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"--use-checkpoint-args: cannot read the model config from {path}: {e}") from None


# --use-checkpoint-args, as Megatron's load_args_from_checkpoint: shapes fill what the command line
# left unset; the architecture is forced to the checkpoint's (the weights only mean something with it).
_CHECKPOINT_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size",
                            "max_position_embeddings", "seq_length", "kv_channels", "layernorm_epsilon",
                            "norm_epsilon", "make_vocab_size_divisible_by")
_CHECKPOINT_FORCED_FIELDS = ("num_query_groups", "position_embedding_type", "rotary_base", "rotary_percent",
                             "add_bias_linear", "activation", "tie_embeddings", "apply_layernorm_1p", "normalization",
                             "qk_layernorm", "apply_query_key_layer_scaling")


def _resolve_model(ns: argparse.Namespace, par: ParallelConfig, prec: PrecisionConfig, data: DataConfig,
                   check_files: bool, notes: list[str]) -> GPTConfig:
    preset: dict[str, Any] = {}
    if ns.model_preset is not None:
        key = ns.model_preset.lower()
        key = key if key in PRESETS else "gpt-" + key
        if key not in PRESETS:
            raise ConfigError(f"unknown --model-preset {ns.model_preset!r}; choose one of {', '.join(PRESETS)}")
        preset = dict(PRESETS[key])
    forced: dict[str, Any] = {}
    if ns.use_checkpoint_args:
        if ns.load is None:
            raise ConfigError("--use-checkpoint-args needs --load (the checkpoint whose model arguments to use)")
        if check_files:
            saved = _checkpoint_model(ns.load)
            preset.update({k: v for k, v in saved.items() if k in _CHECKPOINT_SHAPE_FIELDS})
            forced = {k: v for k, v in saved.items() if k in _CHECKPOINT_FORCED_FIELDS}
            notes.append(f"--use-checkpoint-args: model architecture from {ns.load}")
    if ns.num_key_value_heads is not None:
        if ns.num_query_groups is not None and ns.num_query_groups != ns.num_key_value_heads:
            raise ConfigError(f"--num-key-value-heads {ns.num_key_value_heads} disagrees with --num-query-groups "
                              f"{ns.num_query_groups}; they are the same setting")
        ns.num_query_groups = ns.num_key_value_heads
    kw: dict[str, Any] = {}
    for attr in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        kw[attr] = _default(getattr(ns, attr), preset.get(attr))
    missing = [f"--{a.replace('_', '-')}" for a, v in kw.items() if v is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (or pass --model-preset, e.g. --model-preset gpt-125m)")
    kw["num_query_groups"] = _default(ns.num_query_groups, preset.get("num_query_groups"))
    kw["ffn_hidden_size"] = _default(ns.ffn_hidden_size, preset.get("ffn_hidden_size"))
    pos = {"learned_absolute": "learned"}.get(ns.position_embedding_type, ns.position_embedding_type)
    for alias, flag_name, value in ((ns.use_rotary_position_embeddings, "--use-rotary-position-embeddings", "rope"),
                                    (ns.no_position_embedding, "--no-position-embedding", "none")):
        if alias:
            if pos not in (None, value):
                raise ConfigError(f"{flag_name} contradicts --position-embedding-type {ns.position_embedding_type}")
            pos = value
    kw["position_embedding_type"] = _default(pos, preset.get("position_embedding_type", "learned"))
    max_pos = _default(ns.max_position_embeddings, preset.get("max_position_embeddings", kw["seq_length"]))
    if kw["position_embedding_type"] != "learned" and ns.max_position_embeddings is None:
        max_pos = max(max_pos, kw["seq_length"])  # no position table to outgrow
    kw["max_position_embeddings"] = max_pos
    if kw["position_embedding_type"] == "learned" and kw["seq_length"] > max_pos:
        raise ConfigError(f"--seq-length {kw['seq_length']} exceeds --max-position-embeddings {max_pos}; "
                          f"raise --max-position-embeddings to at least {kw['seq_length']}")
    granularity = ns.recompute_granularity
    if ns.checkpoint_activations or ns.recompute_activations:
        alias = "full" if ns.checkpoint_activations else "selective"
        if granularity not in (None, alias) or (ns.checkpoint_activations and ns.recompute_activations):
            raise ConfigError("conflicting recompute flags: --checkpoint-activations means --recompute-granularity "
                              "full and --recompute-activations means selective; pass one")
        granularity = alias
    if ns.checkpoint_num_layers is not None:
        if ns.recompute_num_layers not in (None, ns.checkpoint_num_layers):
            raise ConfigError(f"--checkpoint-num-layers {ns.checkpoint_num_layers} disagrees with "
                              f"--recompute-num-layers {ns.recompute_num_layers}; they are the same setting")
        ns.recompute_num_layers = ns.checkpoint_num_layers
    if granularity != "full" and ns.recompute_method is not None:
        raise ConfigError("--recompute-method needs --recompute-granularity full")
    if granularity != "full" and ns.recompute_num_layers is not None and not ns.checkpoint_num_layers:
        raise ConfigError("--recompute-num-layers needs --recompute-granularity full")
    if ns.squared_relu and ns.swiglu:
        raise ConfigError("--squared-relu and --swiglu are two different MLP activations; pass one")
    backend = _ATTENTION_BACKENDS[_default(ns.attention_backend, "auto")]
    if ns.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn contradicts --attention-backend {ns.attention_backend}")
        backend = "flash"
    activation = "swiglu" if ns.swiglu else "squared_relu" if ns.squared_relu else preset.get("activation", "gelu")
    kw.update(
        vocab_size=preset["vocab_size"] if forced and "vocab_size" in preset and ns.vocab_size is None
        else _model_vocab_size(ns, data, preset, check_files),
        normalization=_default(ns.normalization, preset.get("normalization", "layernorm")),
        activation=activation,
        add_bias_linear=not ns.disable_bias_linear and preset.get("add_bias_linear", True),
        tie_embeddings=not ns.untie_embeddings_and_output_weights and preset.get("tie_embeddings", True),
        sequence_parallel=par.sequence_parallel,
        recompute_granularity=granularity,
        recompute_method=_default(ns.recompute_method, "uniform"),
        recompute_num_layers=_default(ns.recompute_num_layers, 1),
        attention_backend=backend,
        params_dtype=prec.torch_dtype,  # as Megatron: compute weights in the training dtype
    )
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    eps_field = "norm_epsilon" if "norm_epsilon" in fields else "layernorm_epsilon"
    for attr, ns_attr in (("rotary_base", "rotary_base"), (eps_field, "norm_epsilon"),
                          ("init_method_std", "init_method_std"), ("hidden_dropout", "hidden_dropout"),
                          ("attention_dropout", "attention_dropout"), ("label_smoothing", "label_smoothing"),
                          ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by")):
        value = _default(getattr(ns, ns_attr), preset.get(attr))
        if value is not None:
            kw[attr] = value
    kw.update(model_field_kwargs(ns))
    for key in ("kv_channels", eps_field):
        if key in preset and key not in kw and key in fields:
            kw[key] = preset[key]
    kw.update({k: v for k, v in forced.items() if k in fields})
    kw["vocab_padding_tp"] = par.tp  # Megatron pads to make_vocab_size_divisible_by x tp
    if check_files:
        _keep_saved_vocab_padding(ns, kw, par.tp, notes)
    if backend == "flash" and check_files:  # a real launch on this machine, not a plan for another
        _check_flash_attn(prec)
    config = build_gpt_config(kw)
    try:
        return config.validate(par.tp)
    except ValueError as e:
        raise ConfigError(f"model config: {e}") from None


def _saved_model_fields(ns: argparse.Namespace) -> Optional[tuple[str, dict[str, Any]]]:
    """``(where, saved GPTConfig dict)`` of the weights this run starts from: the latest checkpoint in
    --load, else --pretrained-checkpoint's config.json; None for a fresh start."""
    from megazero.training.checkpointing import checkpoint_dir, latest_iteration

    if ns.load is not None and os.path.isdir(ns.load):
        try:
            iteration = latest_iteration(ns.load)
        except Exception:  # a damaged 'latest' is the load's to report, with its own message
            iteration = None
        if iteration is not None:
            path = os.path.join(checkpoint_dir(ns.load, iteration), "config.json")
            try:
                with open(path) as f:
                    return path, json.load(f)["model"]
            except (OSError, KeyError, ValueError, TypeError):
                return None  # the checkpoint load names what is wrong with it
    if ns.pretrained_checkpoint is not None:
        path = os.path.join(ns.pretrained_checkpoint, "config.json")
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return None
        return (path, saved) if isinstance(saved, dict) else None
    return None


def _keep_saved_vocab_padding(ns: argparse.Namespace, kw: dict[str, Any], tp: int, notes: list[str]) -> None:
    """A resume at another tp keeps the embedding rows of the checkpoint: Megatron's padding depends
    on the tp of the run that *created* the weights, and the weights cannot change shape."""
    found = _saved_model_fields(ns)
    if found is None:
        return
    where, saved = found
    from megazero.mpu.utils import pad_vocab_size

    if saved.get("vocab_size") != kw["vocab_size"]:
        return  # another vocabulary altogether: the weight load reports the shape mismatch by name
    divisible = int(saved.get("make_vocab_size_divisible_by", 128))
    saved_tp = int(saved.get("vocab_padding_tp", 1))
    saved_padded = pad_vocab_size(kw["vocab_size"], saved_tp, divisible)
    padded = pad_vocab_size(kw["vocab_size"], kw["vocab_padding_tp"], kw.get("make_vocab_size_divisible_by", 128))
    if saved_padded == padded:
        return
    if saved_padded % tp:
        raise ConfigError(f"the weights in {os.path.dirname(where)} have a padded vocabulary of {saved_padded} rows "
                          f"({kw['vocab_size']} padded to a multiple of {divisible} x tp {saved_tp}), which does not "
                          f"split over --tp {tp}; resume with a --tp that divides {saved_padded}")
    kw["make_vocab_size_divisible_by"], kw["vocab_padding_tp"] = divisible, saved_tp
    notes.append(f"padded vocabulary {saved_padded} kept from {os.path.dirname(where)} (made at tp {saved_tp}); "
                 f"a fresh run at --tp {tp} would pad to {padded}")


def _check_flash_attn(prec: PrecisionConfig) -> None:
    """Refuse flash attention up front where it cannot run (it would fail at the first forward)."""
    from megazero.model.attention import flash_attn_available

    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device is visible")
    if not flash_attn_available():
        problems.append("the flash-attn package is not installed (pip install flash-attn --no-build-isolation)")
    if prec.dtype == "fp32":
        problems.append("flash attention needs --bf16 or --fp16")
    if problems:
        raise ConfigError("--use-flash-attn cannot run here: " + "; ".join(problems)
                          + "; drop the flag to use PyTorch's scaled_dot_product_attention")


def _resolve_logging(ns: argparse.Namespace, ds: Optional[dict[str, Any]], notes: list[str],
                     check_files: bool) -> LoggingConfig:
    ds = ds or {}
    log_interval = _default(ns.log_interval, _json_get(ds, "steps_per_print") or 100)
    if log_interval < 1:
        raise ConfigError(f"--log-interval must be >= 1, got {log_interval}")
    metrics_file = ns.metrics_file
    if metrics_file is None and ns.save is not None:
        metrics_file = os.path.join(ns.save, "metrics.jsonl")
    tb_dir = ns.tensorboard_dir
    tb = ds.get("tensorboard") or {}
    if tb.get("enabled") and tb_dir is None:
        tb_dir = os.path.join(tb.get("output_path") or ".", tb.get("job_name") or "DeepSpeedJobName")
    csv = ds.get("csv_monitor") or {}
    csv_dir = os.path.join(csv.get("output_path") or ".", csv.get("job_name") or "DeepSpeedJobName") \
        if csv.get("enabled") else None
    wandb_block = ds.get("wandb") or {}
    wandb_project = ns.wandb_project or (wandb_block.get("project") or "deepspeed" if wandb_block.get("enabled")
                                         else None)
    if (wandb_project or ns.wandb_exp_name or ns.wandb_save_dir) and check_files:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("Weights & Biases logging (--wandb-project or the JSON's wandb block) needs the "
                              "wandb package, which is not installed: pip install wandb (WANDB_MODE=offline "
                              "works without a network), or drop the wandb options")
    if (ns.wandb_exp_name or ns.wandb_save_dir) and not wandb_project:
        raise ConfigError("--wandb-exp-name/--wandb-save-dir need --wandb-project")
    cfg = LoggingConfig(
        log_interval=log_interval, tensorboard_dir=tb_dir, metrics_file=metrics_file,
        wall_clock_breakdown=bool(_json_get(ds, "wall_clock_breakdown") or False),
        tensorboard_log_interval=_default(ns.tensorboard_log_interval, 1),
        tensorboard_queue_size=_default(ns.tensorboard_queue_size, 1000), csv_dir=csv_dir,
        wandb_project=wandb_project, wandb_exp_name=ns.wandb_exp_name, wandb_save_dir=ns.wandb_save_dir,
        track_memory=bool(ns.track_memory))
    for name in ("log_timers_to_tensorboard", "log_batch_size_to_tensorboard", "log_validation_ppl_to_tensorboard",
                 "log_memory_to_tensorboard", "log_optimizer_states_to_tensorboard", "log_params_norm",
                 "log_num_zeros_in_grad", "log_throughput"):
        setattr(cfg, name, bool(getattr(ns, name)))
    if cfg.tensorboard_log_interval < 1 or cfg.tensorboard_queue_size < 1:
        raise ConfigError(f"--tensorboard-log-interval and --tensorboard-queue-size must be >= 1, got "
                          f"{cfg.tensorboard_log_interval}, {cfg.tensorboard_queue_size}")
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None, *,
               check_files: bool = True) -> TrainConfig:
    """Parse and validate a Megatron-style command line into a ``TrainConfig``.

    ``argv`` defaults to ``sys.argv[1:]``; ``world_size`` to ``$WORLD_SIZE`` (else 1).
    ``check_files=False`` skips the existence checks on data/tokenizer files (for
    planning a run on another machine, e.g. the launch script's dry run). Raises
    ``ConfigError`` naming the offending flags and numbers.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ns = build_parser().parse_args(argv)
    refused = refusals(ns)
    if refused:
        raise ConfigError("refused before any process starts:\n  " + "\n  ".join(refused))
    _check_local_rank(ns)
    notes: list[str] = []
    ds = _load_deepspeed_json(ns.deepspeed_config)
    if ds is not None:
        ignored = classify_ds_keys(ds, f"--deepspeed_config {ns.deepspeed_config}")
        if ignored:
            notes.append("DeepSpeed JSON keys ignored (they tune DeepSpeed's own internals): " + ", ".join(ignored))
        _merge_deepspeed_json(ns, ds, ns.deepspeed_config)
        _merge_deepspeed_scheduler(ns, ds, ns.deepspeed_config, notes)
        ac = ds.get("activation_checkpointing") or {}
        full = ns.checkpoint_activations or ns.recompute_granularity == "full"
        if full and ac.get("number_checkpoints") is not None:
            n = int(ac["number_checkpoints"])
            if ns.recompute_num_layers not in (None, n) or ns.checkpoint_num_layers not in (None, n):
                raise ConfigError(f"--deepspeed_config {ns.deepspeed_config} has activation_checkpointing."
                                  f"number_checkpoints={n} but the command line gives another --recompute-num-layers "
                                  f"/ --checkpoint-num-layers; make them agree")
            ns.recompute_num_layers = n
        if ac and not (ns.checkpoint_activations or ns.recompute_granularity or ns.recompute_activations):
            notes.append("DeepSpeed activation_checkpointing block: it configures the checkpoint function; "
                         "recompute runs with --checkpoint-activations or --recompute-granularity, as in "
                         "Megatron-DeepSpeed")
    parallel = _resolve_parallel(ns, world_size, notes, check_files)
    parallel.local_rank = ns.local_rank
    precision = _resolve_precision(ns, ds, ns.deepspeed_config, notes)
    optim = _resolve_optim(ns, ds)
    data = _resolve_data(ns, check_files)
    model = _resolve_model(ns, parallel, precision, data, check_files, notes)
    schedule = _resolve_schedule(ns, parallel, ds, ns.deepspeed_config, model.seq_length)
    _resolve_pipeline(ns, parallel, model, schedule)
    if parallel.pp > 1:
        asked = [f for f, on in (("--reset-position-ids", data.reset_position_ids),
                                 ("--reset-attention-mask", data.reset_attention_mask),
                                 ("--eod-mask-loss", data.eod_mask_loss)) if on]
        if asked:
            raise ConfigError(f"{', '.join(asked)} with --pp {parallel.pp}: the pipeline stages do not carry "
                              "per-document positions and masks yet; run them with --pp 1 (tensor parallelism "
                              "and ZeRO-3 give the memory saving instead)")
    if ns.pretrained_checkpoint is not None and check_files and not os.path.exists(
            os.path.join(ns.pretrained_checkpoint, "model_full.safetensors")):
        raise ConfigError(f"--pretrained-checkpoint {ns.pretrained_checkpoint} has no model_full.safetensors "
                          "(make one with tools/convert_from_hf.py)")
    save_interval = ns.save_interval
    if save_interval is not None and save_interval < 1:
        raise ConfigError(f"--save-interval must be >= 1, got {save_interval}")
    if save_interval is not None and ns.save is None:
        notes.append(f"warning: --save-interval {save_interval} without --save: no checkpoints will be written "
                     "(as in Megatron)")
        save_interval = None
    for flag_name, value in (("--finetune", ns.finetune), ("--no-load-optim", ns.no_load_optim),
                             ("--no-load-rng", ns.no_load_rng)):
        if value and ns.load is None and ns.pretrained_checkpoint is None:
            raise ConfigError(f"{flag_name} needs --load (the checkpoint it changes how to load)")
    logging_cfg = _resolve_logging(ns, ds, notes, check_files)
    generate = GenerateConfig(prompt=ns.generate_prompt, tokens=_default(ns.generate_tokens, 32))
    if generate.tokens < 0:
        raise ConfigError(f"--generate-tokens must be >= 0, got {generate.tokens}")
    for note_flag, text in (("overlap_param_gather", "--overlap-param-gather: ZeRO-3 prefetches one unit ahead; "
                             "at stages 1/2 the post-step all-gather runs after the step"),):
        if getattr(ns, note_flag):
            notes.append(text)
    cfg = TrainConfig(
        model=model, parallel=parallel, precision=precision, optim=optim, schedule=schedule, data=data,
        checkpoint=CheckpointConfig(save=ns.save, load=ns.load, save_interval=save_interval,
                                    pretrained=ns.pretrained_checkpoint, finetune=bool(ns.finetune),
                                    no_load_optim=bool(ns.no_load_optim), no_load_rng=bool(ns.no_load_rng),
                                    use_checkpoint_args=bool(ns.use_checkpoint_args)),
        logging=logging_cfg, generate=generate, seed=_default(ns.seed, 1234), deepspeed_json=ds, notes=notes)
    return cfg


def check_vocab(config: TrainConfig, tokenizer_vocab_size: int) -> None:
    """Refuse a tokenizer (or data) vocabulary larger than the model's embedding.

    Call after building the tokenizer: ids >= padded_vocab_size would index past
    the embedding table (a CUDA assert deep in the first forward otherwise).
    """
    padded = config.model.padded_vocab_size
    if tokenizer_vocab_size > padded:
        raise ConfigError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but the model's embedding has only {padded} rows "
            f"(vocab_size {config.model.vocab_size} padded to a multiple of "
            f"{config.model.make_vocab_size_divisible_by}); pass --vocab-size >= {tokenizer_vocab_size} "
            f"or drop --vocab-size to take it from the tokenizer")


def parse_args_or_exit(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None, *,
                       check_files: bool = True) -> TrainConfig:
    """``parse_args`` for entry points: on ConfigError print only the message and exit 2.

    Only local rank 0 prints, so a multi-GPU node shows the message once.
    """
    try:
        return parse_args(argv, world_size, check_files=check_files)
    except ConfigError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def describe(config: TrainConfig) -> str:
    """A few human lines summarising the resolved run (printed at startup and by dry runs)."""
    m, p, s, o = config.model, config.parallel, config.schedule, config.optim
    lines = [
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.query_groups} kv groups), ffn {m.ffn_size}, seq {m.seq_length}, vocab {m.vocab_size} "
        f"(padded {m.padded_vocab_size}), {m.position_embedding_type}/{m.normalization}/{m.activation}",
        f"parallel: world {p.world_size} = tp {p.tp} x pp {p.pp} x dp {p.dp}, ZeRO stage {p.zero_stage}, "
        f"sequence parallel {'on' if p.sequence_parallel else 'off'}, precision {config.precision.dtype}, "
        f"recompute {m.recompute_granularity or 'none'}, attention {m.attention_backend}",
        f"batch: global {s.global_batch_size} = micro {s.micro_batch_size} x dp {p.dp} x accumulation "
        f"{s.grad_accum_steps}; {s.train_iters} iterations ({s.train_samples} samples, "
        f"{s.train_samples * m.seq_length:,} tokens)"
        + (f"; ramp-up {s.rampup_batch_size[0]} +{s.rampup_batch_size[1]} over {s.rampup_batch_size[2]} samples"
           if s.rampup_batch_size else "")
        + (f"; stop at {s.train_tokens:,} tokens" if s.train_tokens else ""),
        *([f"pipeline: {pipeline_plan_line(config)}"] if p.pp > 1 else []),
        f"lr: {o.lr:g} -> {o.min_lr:g} {s.lr_decay_style}, warmup {s.lr_warmup_samples} {s.lr_unit}, decay "
        f"{s.lr_decay_samples} {s.lr_unit}; {o.type} betas ({o.adam_beta1}, {o.adam_beta2}) eps {o.adam_eps:g} "
        f"wd {o.weight_decay}, clip {o.clip_grad}",
    ]
    return "\n".join(lines)


def pipeline_plan_line(config: TrainConfig) -> str:
    """The layers of each pipeline stage (and chunk), the schedule and its bubble, for the start-up plan."""
    from ..model.pipeline_split import layers_per_chunk_table

    p, m = config.parallel, config.schedule.grad_accum_steps
    table = layers_per_chunk_table(config.model.num_layers, p.pp, p.virtual_pp, p.decoder_first_pipeline_num_layers,
                                   p.decoder_last_pipeline_num_layers)

    def span(r: range) -> str:
        return f"{r.start}-{r.stop - 1}" if len(r) > 1 else (str(r.start) if len(r) else "none")

    stages = []
    for r in range(p.pp):
        parts = "+".join(span(table[c][r]) for c in range(p.virtual_pp))
        ends = ("embedding " if r == 0 else "") + ("head" if r == p.pp - 1 else "")
        stages.append(f"stage {r}: layers {parts}" + (f" ({ends.strip()})" if ends else ""))
    kind = "1F1B" if p.virtual_pp == 1 else f"interleaved 1F1B, {p.virtual_pp} chunks per rank"
    return (f"{kind}, {m} micro-batches per step, bubble (pp-1)/(v m) = {(p.pp - 1) / (p.virtual_pp * m):.3f}; "
            + "; ".join(stages))
