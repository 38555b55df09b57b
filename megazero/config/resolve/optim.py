"""Optimizer: type (a registered component) and its own settings, lr, betas, eps, weight decay and its schedule,
gradient clipping."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megazero.config.resolve.common import default, json_get
from megazero.config.train_config import ConfigError, OptimConfig
from megazero.zero.optimizers import ZeroConfigError, component, registered


def resolve_optim(ns: argparse.Namespace, ds: Optional[dict[str, Any]]) -> OptimConfig:
    o = OptimConfig(lr=ns.lr)  # present: parse_args checked the required flags
    ds_type = json_get(ds or {}, "optimizer.type")
    if ds_type is not None:
        try:
            kind = component(ds_type)
        except ZeroConfigError as e:
            raise ConfigError(f"--deepspeed-config {e}") from None
        if ns.optimizer is not None and component(ns.optimizer) is not kind:
            raise ConfigError(f"--deepspeed-config optimizer.type {ds_type!r} disagrees with --optimizer "
                              f"{ns.optimizer}; set it in one place")
        o.type = kind.type_name(ds_type)
    elif ns.optimizer is not None:
        o.type = component(ns.optimizer).name
    _resolve_settings(ns, o)
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
    _resolve_qk_clip(ns, o)
    _resolve_offload(ns, ds, o)
    style = default(ns.weight_decay_incr_style, "constant")
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


def _resolve_offload(ns: argparse.Namespace, ds: Optional[dict[str, Any]], o: OptimConfig) -> None:
    """--optimizer-cpu-offload (Megatron-core; Megatron-DeepSpeed's --cpu-optimizer) and
    --optimizer-offload-fraction, checked against the JSON's zero_optimization.offload_optimizer."""
    flag = bool(getattr(ns, "optimizer_cpu_offload", False) or getattr(ns, "cpu_optimizer", False))
    fraction = getattr(ns, "optimizer_offload_fraction", None)
    block = json_get(ds or {}, "zero_optimization.offload_optimizer") or {}
    json_device = str(block.get("device", "none")).lower() if isinstance(block, dict) else "none"
    if fraction is not None:
        if not flag and json_device == "none":
            raise ConfigError("--optimizer-offload-fraction needs --optimizer-cpu-offload (or an offload_optimizer "
                              "block with a device in --deepspeed-config)")
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")
        if isinstance(block, dict) and "ratio" in block and float(block["ratio"]) != fraction:
            raise ConfigError(f"--optimizer-offload-fraction {fraction} disagrees with the DeepSpeed JSON's "
                              f"zero_optimization.offload_optimizer.ratio {block['ratio']}; set it in one place")
    if flag:
        # The JSON may say where (nvme, with its path); the flag alone means the host.
        o.offload_device = json_device if json_device != "none" else "cpu"
    elif fraction is not None:
        o.offload_device = json_device
    o.offload_fraction = fraction
    if o.offload_device is not None and not component(o.type).host_step:
        raise ConfigError(f"optimizer offload steps the optimizer on the host; --optimizer {o.type.lower()} has no "
                          "host step (it runs on the accelerator): drop --optimizer-cpu-offload")


def _resolve_settings(ns: argparse.Namespace, o: OptimConfig) -> None:
    """The optimizer's own flags as its settings (its component parses them); another optimizer's flags are
    refused."""
    kind = component(o.type)
    for other in registered():
        if other is kind:
            continue
        given = [f"--{k.replace('_', '-')}" for k in other.flag_dests() if getattr(ns, k, None) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --optimizer "
                              f"{other.cli_names[0]}")
    try:
        o.settings = kind.settings(ns)
    except ZeroConfigError as e:
        raise ConfigError(str(e)) from None


def _resolve_qk_clip(ns: argparse.Namespace, o: OptimConfig) -> None:
    """--qk-clip and its threshold and alpha, --log-max-attention-logit."""
    o.qk_clip, o.log_max_attention_logit = bool(ns.qk_clip), bool(ns.log_max_attention_logit)
    for attr in ("qk_clip_threshold", "qk_clip_alpha"):
        if getattr(ns, attr) is not None:
            if not o.qk_clip:
                raise ConfigError(f"--{attr.replace('_', '-')} needs --qk-clip")
            setattr(o, attr, getattr(ns, attr))
    if o.qk_clip_threshold <= 0 or not 0.0 <= o.qk_clip_alpha <= 1.0:
        raise ConfigError(f"--qk-clip-threshold must be > 0 and --qk-clip-alpha in [0, 1], got "
                          f"{o.qk_clip_threshold} and {o.qk_clip_alpha}")
