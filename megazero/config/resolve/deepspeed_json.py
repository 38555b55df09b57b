"""The --deepspeed-config JSON: loaded, merged into the command line's namespace, disagreements refused."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Optional

from megazero.config.ds_keys import classify as classify_ds_keys
from megazero.config.resolve.common import json_get, same_value
from megazero.config.train_config import ConfigError, OptimConfig
from megazero.zero.optimizers import ZeroConfigError, component

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
    # DeepSpeed-Ulysses: the sequence split over this many ranks, attention by all-to-all over heads
    ("sequence_parallel_size", "context_parallel_size", "--context-parallel-size", int),
    # The fp16 loss-scaler keys are resolved in resolve_precision: there the JSON's block governs.
]


def load_deepspeed_json(path: Optional[str]) -> Optional[dict[str, Any]]:
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


def merge_deepspeed_json(ns: argparse.Namespace, ds: dict[str, Any], path: str) -> None:
    """Fill flags the command line left unset from the JSON; refuse disagreements."""
    if json_get(ds, "sequence_parallel_size") not in (None, 1) and ns.cp_comm_type is None:
        ns.cp_comm_type = ["a2a"]  # Ulysses is context parallelism by all-to-all over heads
    own = _optimizer_keys(ds, ns)  # these go to the optimizer's own flags rather than the generic ones
    rows = [r for r in _DS_KEYS if r[0] not in own] + [(k, a, f, float) for k, (a, f) in own.items()]
    for key, attr, flag_name, convert in rows:
        raw = json_get(ds, key)
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
        elif not same_value(given, value):
            raise ConfigError(f"--deepspeed-config {path} has {key}={json.dumps(raw)} but the command line has "
                              f"{flag_name} {given}; make them agree or set it in one place only")


def _optimizer_keys(ds: dict[str, Any], ns: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """The JSON's optimizer.params keys that the named optimizer's own flags take (its component's ``json_flags``)."""
    try:
        kind = component(json_get(ds, "optimizer.type") or ns.optimizer or OptimConfig.type)
    except ZeroConfigError:
        return {}  # resolve_optim names the unknown type
    return {f"optimizer.params.{k}": v for k, v in kind.json_flags.items()}


_DS_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def merge_deepspeed_scheduler(ns: argparse.Namespace, ds: dict[str, Any], path: str, notes: list[str]) -> None:
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
    lr = ns.lr if ns.lr is not None else json_get(ds, "optimizer.params.lr")
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
        elif not same_value(given, value):
            raise ConfigError(f"--deepspeed_config {path} scheduler {kind} gives {flag_name} {value} but the command "
                              f"line has {flag_name} {given}; make them agree or drop the scheduler block")
    notes.append(f"DeepSpeed scheduler {kind} -> " + " ".join(f"{f} {v}" for f, v in values.values()))


def merge_deepspeed(ns: argparse.Namespace, ds: dict[str, Any], notes: list[str]) -> None:
    """Everything the JSON sets on the command line's namespace: flags, scheduler, activation checkpointing."""
    ignored = classify_ds_keys(ds, f"--deepspeed_config {ns.deepspeed_config}")
    if ignored:
        notes.append("DeepSpeed JSON keys ignored (they tune DeepSpeed's own internals): " + ", ".join(ignored))
    merge_deepspeed_json(ns, ds, ns.deepspeed_config)
    merge_deepspeed_scheduler(ns, ds, ns.deepspeed_config, notes)
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
