"""Precision: bf16 / fp16 / fp32, the gradients' accumulation and reduction dtypes, and the fp16 loss scaler
(flags or the DeepSpeed JSON's fp16 block)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable, Optional

from megazero.config.resolve.common import same_value
from megazero.config.train_config import ConfigError, PrecisionConfig

# DeepSpeed's fp16 block: (JSON key, DeepSpeed's default, namespace attribute, flag, JSON -> PrecisionConfig value)
_FP16_KEYS: list[tuple[str, Any, str, str, Callable[[Any], Any]]] = [
    ("loss_scale", 0, "loss_scale", "--loss-scale", lambda v: float(v) if float(v) > 0 else None),
    ("initial_scale_power", 16, "initial_loss_scale", "--initial-loss-scale", lambda v: 2.0 ** int(v)),
    ("loss_scale_window", 1000, "loss_scale_window", "--loss-scale-window", int),
    ("hysteresis", 2, "hysteresis", "--hysteresis", int),
    ("min_loss_scale", 1, "min_loss_scale", "--min-loss-scale", float),
]


def resolve_precision(ns: argparse.Namespace, ds: Optional[dict[str, Any]], ds_path: Optional[str],
                       notes: list[str]) -> PrecisionConfig:
    if ns.bf16 and ns.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive; choose one (bf16 needs no loss scaling)")
    dtype = "bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32"
    prec = PrecisionConfig(dtype=dtype, accumulate_grads_fp32=bool(ns.accumulate_allreduce_grads_in_fp32))
    _gradient_dtypes(ns, prec, ds or {})
    block = (ds or {}).get("fp16")
    if dtype == "fp16" and isinstance(block, dict):
        # As in Megatron-DeepSpeed, the JSON's fp16 block drives DeepSpeed's loss scaler and the
        # --loss-scale family is not read; DeepSpeed's defaults fill what the block leaves out.
        for key, ds_default, attr, flag_name, convert in _FP16_KEYS:
            explicit = key in block and block[key] != "auto"
            value = convert(block[key] if explicit else ds_default)
            setattr(prec, attr, value)
            given = getattr(ns, attr)
            if given is None or same_value(given, value):
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


def _agreed(what: str, given: dict[str, str]) -> Optional[str]:
    """The one value the sources in ``given`` (source -> dtype) name, or None when none does."""
    if len(set(given.values())) > 1:
        raise ConfigError(f"the {what}: " + ", ".join(f"{source} {value}" for source, value in given.items())
                          + " disagree; give it once")
    return next(iter(given.values()), None)


def _gradient_dtypes(ns: argparse.Namespace, prec: PrecisionConfig, ds: dict[str, Any]) -> None:
    """Megatron's gradient dtype flags: --main-grads-dtype, --megatron-fsdp-main-grads-dtype and --grad-reduce-in-bf16
    set the accumulation dtype, --megatron-fsdp-grad-comm-dtype the reduction's ('auto': left as is). They must
    agree with each other, with --accumulate-allreduce-grads-in-fp32 and with the DeepSpeed JSON."""
    from megazero.zero.config import parse_communication_data_type

    accum = {flag: value for flag, value in (("--main-grads-dtype", ns.main_grads_dtype),
                                             ("--megatron-fsdp-main-grads-dtype", ns.megatron_fsdp_main_grads_dtype),
                                             ("--grad-reduce-in-bf16", "bf16" if ns.grad_reduce_in_bf16 else None))
             if value not in (None, "auto")}
    prec.grad_accum_dtype = _agreed("gradient accumulation dtype", dict(
        accum, **({"--accumulate-allreduce-grads-in-fp32": "fp32"} if accum and prec.accumulate_grads_fp32 else {}),
        **({"data_types.grad_accum_dtype (DeepSpeed JSON)": ds["data_types"]["grad_accum_dtype"]}
           if accum and ds.get("data_types", {}).get("grad_accum_dtype") else {})))
    comm = ns.megatron_fsdp_grad_comm_dtype
    if comm not in (None, "auto"):
        json_comm = parse_communication_data_type(ds.get("communication_data_type"))
        prec.grad_comm_dtype = _agreed("gradient reduction dtype", dict(
            {"--megatron-fsdp-grad-comm-dtype": comm},
            **({"communication_data_type (DeepSpeed JSON)": json_comm} if json_comm else {})))
