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
import json
import math
import os
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from megazero.model.config import PRESETS, GPTConfig
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
)

__all__ = ["ConfigError", "build_parser", "parse_args", "parse_args_or_exit", "check_vocab", "describe"]

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
GPT2_VOCAB_SIZE = 50257  # GPT-2 BPE (50,000 merges + 256 bytes + <|endoftext|>)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers (and tests) decide."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (run with --help for the list of flags)")


def build_parser() -> argparse.ArgumentParser:
    """The flag set. Defaults are None on purpose: "not given" must be told apart from
    "given as the default" to merge presets and the DeepSpeed JSON correctly."""
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with tensor parallelism and ZeRO.",
                allow_abbrev=False)
    flag = dict(action="store_true", default=None)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int)
    g.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int)
    g.add_argument("--zero-stage", type=int, help="ZeRO stage 0-3 (default 1, as Megatron-DeepSpeed)")
    g.add_argument("--sequence-parallel", **flag)
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON; its values are merged, conflicts with flags are errors")
    g.add_argument("--deepspeed", **flag, help="accepted for Megatron-DeepSpeed compatibility")
    g.add_argument("--no-pipeline-parallel", **flag, help="accepted for Megatron-DeepSpeed compatibility")
    g.add_argument("--deepspeed-activation-checkpointing", **flag, help="accepted for compatibility")

    g = p.add_argument_group("model")
    g.add_argument("--model-preset", help=f"one of {', '.join(PRESETS)} ('gpt-' optional); shape flags override it")
    for name in ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups",
                 "--ffn-hidden-size", "--seq-length", "--max-position-embeddings"):
        g.add_argument(name, type=int)
    g.add_argument("--group-query-attention", **flag, help="accepted; --num-query-groups alone enables GQA")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "learned", "rope"))
    g.add_argument("--rotary-base", type=float)
    g.add_argument("--normalization", type=str.lower, choices=("layernorm", "rmsnorm"))
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float)
    g.add_argument("--swiglu", **flag)
    g.add_argument("--disable-bias-linear", **flag)
    g.add_argument("--untie-embeddings-and-output-weights", **flag)
    g.add_argument("--init-method-std", type=float)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--make-vocab-size-divisible-by", type=int)
    g.add_argument("--recompute-granularity", choices=("full", "selective"))
    g.add_argument("--recompute-method", choices=("uniform", "block"))
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--checkpoint-activations", **flag, help="Megatron-DeepSpeed alias of --recompute-granularity full")
    g.add_argument("--recompute-activations", **flag, help="Megatron alias of --recompute-granularity selective")
    g.add_argument("--use-flash-attn", "--use-flash-attn-v2", dest="use_flash_attn", **flag)

    g = p.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"))
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-samples", type=int)
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-decay-samples", type=int)
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int)
    g.add_argument("--exit-interval", type=int)

    g = p.add_argument_group("optimizer and precision")
    g.add_argument("--optimizer", type=str.lower, choices=("adam", "adamw"),
                   help="Megatron's 'adam' has decoupled weight decay: both mean AdamW")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip-grad", type=float)
    g.add_argument("--adam-beta1", type=float)
    g.add_argument("--adam-beta2", type=float)
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--bf16", **flag)
    g.add_argument("--fp16", **flag)
    g.add_argument("--loss-scale", type=float, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, help="dynamic scaler start, a power of 2 (default 2**16)")
    g.add_argument("--min-loss-scale", type=float)
    g.add_argument("--loss-scale-window", type=int)
    g.add_argument("--hysteresis", type=int)
    g.add_argument("--seed", type=int)

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="+", help="PREFIX or 'W1 PREFIX1 W2 PREFIX2 ...' (files PREFIX.bin/.idx)")
    g.add_argument("--split", help="train,valid,test weights (default 969,30,1)")
    g.add_argument("--mock-data", **flag, help="synthetic tokens; no data files needed")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary; with other tokenizers an override")

    g = p.add_argument_group("checkpoints, logging, sampling")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="initialize the weights from a full checkpoint (model_full.safetensors + config.json, "
                        "e.g. from tools/convert_from_hf.py); ignored when --load finds a checkpoint")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--log-interval", type=int)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-file", help="JSONL metrics (default: SAVE/metrics.jsonl when --save is given)")
    g.add_argument("--generate-prompt")
    g.add_argument("--generate-tokens", type=int)
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
    # DeepSpeed's loss_scale 0 means "dynamic", i.e. no --loss-scale.
    ("fp16.loss_scale", "loss_scale", "--loss-scale", lambda v: float(v) if float(v) > 0 else None),
    ("fp16.initial_scale_power", "initial_loss_scale", "--initial-loss-scale", lambda v: 2.0 ** int(v)),
    ("fp16.loss_scale_window", "loss_scale_window", "--loss-scale-window", int),
    ("fp16.hysteresis", "hysteresis", "--hysteresis", int),
    ("fp16.min_loss_scale", "min_loss_scale", "--min-loss-scale", float),
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


def _resolve_parallel(ns: argparse.Namespace, world_size: int) -> ParallelConfig:
    tp, pp = _default(ns.tp, 1), _default(ns.pp, 1)
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp and --pp must be >= 1, got --tp {tp} --pp {pp}")
    if pp > 1:
        raise ConfigError(f"pipeline parallelism is not supported yet (--pipeline-model-parallel-size {pp}); "
                          f"use --pp 1 and scale with --tp and --zero-stage 3 instead")
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by --tp {tp} x --pp {pp} = {tp * pp}; "
                          f"launch a multiple of {tp * pp} processes or change --tp")
    zero_stage = _default(ns.zero_stage, 1)
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    sp = bool(ns.sequence_parallel)
    if sp and tp == 1:
        raise ConfigError("--sequence-parallel needs --tp > 1 (it shards activations over the tensor-parallel "
                          "group); drop --sequence-parallel or raise --tp")
    return ParallelConfig(tp=tp, pp=pp, dp=world_size // (tp * pp), world_size=world_size,
                          zero_stage=zero_stage, sequence_parallel=sp)


def _resolve_precision(ns: argparse.Namespace) -> PrecisionConfig:
    if ns.bf16 and ns.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive; choose one (bf16 needs no loss scaling)")
    dtype = "bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32"
    prec = PrecisionConfig(dtype=dtype, loss_scale=ns.loss_scale)
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
        if str(ds_type).lower() not in ("adam", "adamw"):
            raise ConfigError(f"--deepspeed-config optimizer.type {ds_type!r} is not supported; use Adam or AdamW")
        o.type = str(ds_type)
    for attr in ("min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        if getattr(ns, attr) is not None:
            setattr(o, attr, getattr(ns, attr))
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr and --lr > 0, got --lr {o.lr} --min-lr {o.min_lr}")
    if not (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1) or o.adam_eps <= 0:
        raise ConfigError(f"Adam needs betas in [0, 1) and eps > 0, got --adam-beta1 {o.adam_beta1} "
                          f"--adam-beta2 {o.adam_beta2} --adam-eps {o.adam_eps}")
    if o.weight_decay < 0 or o.clip_grad < 0:
        raise ConfigError(f"--weight-decay and --clip-grad must be >= 0, got {o.weight_decay} and {o.clip_grad}")
    return o


def _resolve_schedule(ns: argparse.Namespace, par: ParallelConfig, ds: Optional[dict[str, Any]],
                      ds_path: Optional[str]) -> ScheduleConfig:
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

    if (ns.train_iters is None) == (ns.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples "
                          f"(got {'both' if ns.train_iters is not None else 'neither'})")
    frac = ns.lr_warmup_fraction
    if frac is not None and not 0.0 <= frac <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got {frac}")
    if ns.train_iters is not None:
        # Iteration-based run: LR flags in iterations too (Megatron refuses the mix).
        if ns.lr_decay_samples is not None or ns.lr_warmup_samples is not None:
            raise ConfigError("with --train-iters give the LR schedule in iterations (--lr-decay-iters, "
                              "--lr-warmup-iters or --lr-warmup-fraction), not in samples")
        if ns.lr_warmup_iters is not None and frac is not None:
            raise ConfigError("give only one of --lr-warmup-iters and --lr-warmup-fraction")
        train_iters = ns.train_iters
        train_samples = train_iters * gbs
        decay_iters = _default(ns.lr_decay_iters, train_iters)
        decay = decay_iters * gbs
        warmup = int(frac * decay) if frac is not None else _default(ns.lr_warmup_iters, 0) * gbs
        warmup_flag = (f"--lr-warmup-fraction {frac}" if frac is not None else
                       f"--lr-warmup-iters {_default(ns.lr_warmup_iters, 0)}")
        decay_flag = f"--lr-decay-iters {decay_iters}"
    else:
        if ns.lr_decay_iters is not None or ns.lr_warmup_iters is not None:
            raise ConfigError("with --train-samples give the LR schedule in samples (--lr-decay-samples, "
                              "--lr-warmup-samples or --lr-warmup-fraction), not in iterations")
        if ns.lr_warmup_samples is not None and frac is not None:
            raise ConfigError("give only one of --lr-warmup-samples and --lr-warmup-fraction")
        train_samples = ns.train_samples
        train_iters = train_samples // gbs
        if train_iters < 1:
            raise ConfigError(f"--train-samples {train_samples} is less than one global batch ({gbs})")
        decay = _default(ns.lr_decay_samples, train_samples)
        warmup = int(frac * decay) if frac is not None else _default(ns.lr_warmup_samples, 0)
        warmup_flag = (f"--lr-warmup-fraction {frac}" if frac is not None else f"--lr-warmup-samples {warmup}")
        decay_flag = f"--lr-decay-samples {decay}"
    if train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {train_iters}")
    if decay < 1 or warmup < 0:
        raise ConfigError(f"the LR decay must be >= 1 step and warmup >= 0; got {decay_flag}, {warmup_flag}")
    if warmup > decay:
        raise ConfigError(f"LR warmup ({warmup_flag} = {warmup} samples) is longer than the LR decay "
                          f"({decay_flag} = {decay} samples); shorten the warmup or lengthen the decay")
    sched = ScheduleConfig(
        micro_batch_size=mbs, global_batch_size=gbs, grad_accum_steps=accum,
        train_iters=train_iters, train_samples=train_samples,
        lr_decay_style=_default(ns.lr_decay_style, "linear"),
        lr_warmup_samples=warmup, lr_decay_samples=decay,
        eval_interval=_default(ns.eval_interval, 1000), eval_iters=_default(ns.eval_iters, 100),
        exit_interval=ns.exit_interval)
    if sched.eval_interval < 0 or sched.eval_iters < 0:
        raise ConfigError(f"--eval-interval and --eval-iters must be >= 0, got {sched.eval_interval}, {sched.eval_iters}")
    if sched.exit_interval is not None and sched.exit_interval < 1:
        raise ConfigError(f"--exit-interval must be >= 1, got {sched.exit_interval}")
    return sched


def _resolve_data(ns: argparse.Namespace, check_files: bool) -> DataConfig:
    from megazero.data.gpt_dataset import parse_data_prefix, parse_split  # lazy: numpy etc.

    d = DataConfig(data_path=list(ns.data_path or []), split=_default(ns.split, "969,30,1"),
                   mock_data=bool(ns.mock_data), tokenizer_type=ns.tokenizer_type,
                   tokenizer_model=ns.tokenizer_model, vocab_file=ns.vocab_file, merge_file=ns.merge_file,
                   vocab_size=ns.vocab_size)
    try:
        parse_split(d.split)
    except ValueError as e:
        raise ConfigError(f"--split: {e}") from None
    if not d.data_path and not d.mock_data:
        raise ConfigError("--data-path is required (a prefix of PREFIX.bin/PREFIX.idx from tools/preprocess_data.py), "
                          "or pass --mock-data for synthetic tokens")
    if d.data_path:
        try:
            d.prefixes, d.weights = parse_data_prefix(d.data_path)
        except ValueError as e:
            raise ConfigError(f"--data-path: {e}") from None
    if check_files and not d.mock_data:
        for prefix in d.prefixes:
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ConfigError(f"--data-path prefix '{prefix}': missing {' and '.join(missing)}; give the prefix "
                                  f"without extension, as written by tools/preprocess_data.py (or use --mock-data)")

    t = d.tokenizer_type
    if t is None:
        if not d.mock_data:
            raise ConfigError(f"--tokenizer-type is required with --data-path; one of {', '.join(TOKENIZER_TYPES)}")
        return d
    needs = {"SentencePieceTokenizer": [("--tokenizer-model", d.tokenizer_model, "file")],
             "HuggingFaceTokenizer": [("--tokenizer-model", d.tokenizer_model, "directory")],
             "GPT2BPETokenizer": [("--vocab-file", d.vocab_file, "file"), ("--merge-file", d.merge_file, "file")],
             "NullTokenizer": []}[t]
    for flag_name, value, kind in needs:
        if value is None:
            raise ConfigError(f"--tokenizer-type {t} needs {flag_name}")
        if check_files and not os.path.exists(value):
            raise ConfigError(f"{flag_name} '{value}' does not exist (the {kind} of the {t})")
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


def _resolve_model(ns: argparse.Namespace, par: ParallelConfig, prec: PrecisionConfig, data: DataConfig,
                   check_files: bool) -> GPTConfig:
    preset: dict[str, Any] = {}
    if ns.model_preset is not None:
        key = ns.model_preset.lower()
        key = key if key in PRESETS else "gpt-" + key
        if key not in PRESETS:
            raise ConfigError(f"unknown --model-preset {ns.model_preset!r}; choose one of {', '.join(PRESETS)}")
        preset = dict(PRESETS[key])
    kw: dict[str, Any] = {}
    for attr in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        kw[attr] = _default(getattr(ns, attr), preset.get(attr))
    missing = [f"--{a.replace('_', '-')}" for a, v in kw.items() if v is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (or pass --model-preset, e.g. --model-preset gpt-125m)")
    kw["num_query_groups"] = _default(ns.num_query_groups, preset.get("num_query_groups"))
    kw["ffn_hidden_size"] = _default(ns.ffn_hidden_size, preset.get("ffn_hidden_size"))
    pos = {"learned_absolute": "learned"}.get(ns.position_embedding_type, ns.position_embedding_type)
    kw["position_embedding_type"] = _default(pos, preset.get("position_embedding_type", "learned"))
    max_pos = _default(ns.max_position_embeddings, preset.get("max_position_embeddings", kw["seq_length"]))
    if kw["position_embedding_type"] == "rope" and ns.max_position_embeddings is None:
        max_pos = max(max_pos, kw["seq_length"])  # RoPE has no position table to outgrow
    kw["max_position_embeddings"] = max_pos
    if kw["seq_length"] > max_pos:
        raise ConfigError(f"--seq-length {kw['seq_length']} exceeds --max-position-embeddings {max_pos}; "
                          f"raise --max-position-embeddings to at least {kw['seq_length']}")
    granularity = ns.recompute_granularity
    if ns.checkpoint_activations or ns.recompute_activations:
        alias = "full" if ns.checkpoint_activations else "selective"
        if granularity not in (None, alias) or (ns.checkpoint_activations and ns.recompute_activations):
            raise ConfigError("conflicting recompute flags: --checkpoint-activations means --recompute-granularity "
                              "full and --recompute-activations means selective; pass one")
        granularity = alias
    if granularity != "full" and (ns.recompute_method is not None or ns.recompute_num_layers is not None):
        raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    kw.update(
        vocab_size=_model_vocab_size(ns, data, preset, check_files),
        normalization=_default(ns.normalization, preset.get("normalization", "layernorm")),
        activation="swiglu" if ns.swiglu else preset.get("activation", "gelu"),
        add_bias_linear=not ns.disable_bias_linear and preset.get("add_bias_linear", True),
        tie_embeddings=not ns.untie_embeddings_and_output_weights and preset.get("tie_embeddings", True),
        sequence_parallel=par.sequence_parallel,
        recompute_granularity=granularity,
        recompute_method=_default(ns.recompute_method, "uniform"),
        recompute_num_layers=_default(ns.recompute_num_layers, 1),
        attention_backend="flash" if ns.use_flash_attn else "auto",
        params_dtype=prec.torch_dtype,  # as Megatron: compute weights in the training dtype
    )
    for attr, ns_attr in (("rotary_base", "rotary_base"), ("layernorm_epsilon", "norm_epsilon"),
                          ("init_method_std", "init_method_std"), ("hidden_dropout", "hidden_dropout"),
                          ("attention_dropout", "attention_dropout"),
                          ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by")):
        value = _default(getattr(ns, ns_attr), preset.get(attr))
        if value is not None:
            kw[attr] = value
    if ns.use_flash_attn and check_files:  # a real launch on this machine, not a plan for another
        _check_flash_attn(prec)
    try:
        return GPTConfig(**kw).validate(par.tp)
    except ValueError as e:
        raise ConfigError(f"model config: {e}") from None


def _check_flash_attn(prec: PrecisionConfig) -> None:
    """Refuse --use-flash-attn up front where it cannot run (it would fail at the first forward)."""
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
    ds = _load_deepspeed_json(ns.deepspeed_config)
    if ds is not None:
        _merge_deepspeed_json(ns, ds, ns.deepspeed_config)
    parallel = _resolve_parallel(ns, world_size)
    precision = _resolve_precision(ns)
    optim = _resolve_optim(ns, ds)
    schedule = _resolve_schedule(ns, parallel, ds, ns.deepspeed_config)
    data = _resolve_data(ns, check_files)
    model = _resolve_model(ns, parallel, precision, data, check_files)
    if ns.pretrained_checkpoint is not None and check_files and not os.path.exists(
            os.path.join(ns.pretrained_checkpoint, "model_full.safetensors")):
        raise ConfigError(f"--pretrained-checkpoint {ns.pretrained_checkpoint} has no model_full.safetensors "
                          "(make one with tools/convert_from_hf.py)")
    if ns.save_interval is not None and ns.save is None:
        raise ConfigError(f"--save-interval {ns.save_interval} needs --save DIR (where to write checkpoints)")
    if ns.save_interval is not None and ns.save_interval < 1:
        raise ConfigError(f"--save-interval must be >= 1, got {ns.save_interval}")
    log_interval = _default(ns.log_interval, 100)
    if log_interval < 1:
        raise ConfigError(f"--log-interval must be >= 1, got {log_interval}")
    metrics_file = ns.metrics_file
    if metrics_file is None and ns.save is not None:
        metrics_file = os.path.join(ns.save, "metrics.jsonl")
    generate = GenerateConfig(prompt=ns.generate_prompt, tokens=_default(ns.generate_tokens, 32))
    if generate.tokens < 0:
        raise ConfigError(f"--generate-tokens must be >= 0, got {generate.tokens}")
    cfg = TrainConfig(
        model=model, parallel=parallel, precision=precision, optim=optim, schedule=schedule, data=data,
        checkpoint=CheckpointConfig(save=ns.save, load=ns.load, save_interval=ns.save_interval,
                                    pretrained=ns.pretrained_checkpoint),
        logging=LoggingConfig(log_interval=log_interval, tensorboard_dir=ns.tensorboard_dir,
                              metrics_file=metrics_file,
                              wall_clock_breakdown=bool(_json_get(ds or {}, "wall_clock_breakdown") or False)),
        generate=generate, seed=_default(ns.seed, 1234), deepspeed_json=ds)
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
        f"{s.train_samples * m.seq_length:,} tokens)",
        f"lr: {o.lr:g} -> {o.min_lr:g} {s.lr_decay_style}, warmup {s.lr_warmup_samples} samples, decay "
        f"{s.lr_decay_samples} samples; {o.type} betas ({o.adam_beta1}, {o.adam_beta2}) eps {o.adam_eps:g} "
        f"wd {o.weight_decay}, clip {o.clip_grad}",
    ]
    return "\n".join(lines)
