"""The ZeRO engine's configuration, parsed from DeepSpeed's JSON schema.

Megatron-DeepSpeed users already have ``ds_config.json`` files; the engine takes
them as they are. Keys DeepSpeed knows but megazero does not implement are
refused by name (silently ignoring ``offload_optimizer`` would mislead a user
sizing a run), as are unknown keys and contradictions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Union

import torch

from .optimizers import OptimizerConfig, ZeroConfigError, parse_optimizer

__all__ = ["ZeroConfigError", "OptimizerConfig", "FP16Config", "OffloadOptimizerConfig",
           "OffloadParamConfig", "ZeroOptimizationConfig", "ZeroConfig", "load_config", "parse_optimizer",
           "parse_zero_optimization", "parse_fp16", "parse_grad_accum_dtype", "parse_communication_data_type",
           "HONOURED_KEYS", "NO_EFFECT_KEYS"]

# Every DeepSpeed JSON key (dotted path) whose value changes what the engine does. ``load_config``
# accepts a key only if it is here or in NO_EFFECT_KEYS (or is refused/ignored by name below), so a
# new knob must be listed to be read at all; tests check that each path changes the parsed config
# and that megazero.config.ds_keys classifies each as honoured and passes it to the engine.
HONOURED_KEYS: tuple[str, ...] = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer.type",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "optimizer.params.adam_w_mode",
    "optimizer.params.momentum",
    "optimizer.params.muon_lr",
    "optimizer.params.adam_lr",
    "zero_optimization.stage",
    "zero_optimization.overlap_comm",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.max_reduce_in_flight",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_keep_gathered_in_step",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.buffer_size",
    "zero_optimization.offload_optimizer.ratio",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.nvme_path",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
    "fp16.enabled",
    "fp16.loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
    "fp16.consecutive_hysteresis",
    "bf16.enabled",
    "bfloat16.enabled",
    "gradient_clipping",
    "data_types.grad_accum_dtype",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
)
# Parsed so that DeepSpeed files load, without effect on the engine: they tune DeepSpeed's own
# machinery, or (steps_per_print, wall_clock_breakdown) the training layer's logging.
NO_EFFECT_KEYS: tuple[str, ...] = (
    "optimizer.params.torch_adam",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_scatter",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.sub_group_size",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_optimizer.pipeline_read",
    "zero_optimization.offload_optimizer.pipeline_write",
    "fp16.auto_cast",
    "steps_per_print",
    "wall_clock_breakdown",
)


@dataclasses.dataclass(frozen=True)
class FP16Config:
    """DeepSpeed's dynamic loss scaling (``loss_scale: 0`` = dynamic)."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False


@dataclasses.dataclass(frozen=True)
class OffloadOptimizerConfig:
    """DeepSpeed's ``zero_optimization.offload_optimizer`` (ZeRO-Offload / ZeRO-Infinity): where the
    fp32 masters and Adam moments of this rank's partition live between steps.

    ``device``: ``none`` (on the accelerator), ``cpu`` (host memory) or ``nvme`` (files under
    ``nvme_path``). ``ratio``: the fraction of the partition's elements offloaded, by whole flat
    groups in model order (DeepSpeed's partial offload; Megatron's ``--optimizer-offload-fraction``);
    the rest steps on the accelerator. The step streams gradients to the host and updated weights
    back through a ring of ``buffer_count`` host buffers of ``buffer_size`` elements (megazero's
    key; None: sized from what is offloaded, a small share of it, see
    ``megazero.zero.offload.ring_chunk``), pinned when ``pin_memory`` and possible.
    ``fast_init``, ``pipeline_read`` and ``pipeline_write`` tune DeepSpeed's swapper and have no
    effect: the ring always pipelines reads, steps and writes.
    """

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    buffer_count: int = 4
    buffer_size: Optional[int] = None  # None: megazero.zero.offload.ring_chunk's default
    ratio: float = 1.0
    fast_init: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False

    @property
    def enabled(self) -> bool:
        return self.device != "none" and self.ratio > 0


@dataclasses.dataclass(frozen=True)
class OffloadParamConfig:
    """DeepSpeed's ``zero_optimization.offload_param`` (ZeRO-Infinity, stage 3): where this rank's
    partition of the parameters (compute dtype) lives between its all-gathers.

    ``device``: ``none``, ``cpu`` (host memory) or ``nvme`` (files under ``nvme_path``; the first
    ``max_in_cpu`` elements of the partition, in model order, stay in host memory). Reads from NVMe
    go through ``buffer_count`` host buffers of ``buffer_size`` elements, pinned when
    ``pin_memory`` and possible (DeepSpeed's defaults: 5 buffers, 1e9 elements in memory; unset,
    ``buffer_size`` is sized from what is on NVMe, see ``megazero.zero.param_offload.ring_bytes``,
    and is never more than DeepSpeed's 1e8 elements).
    """

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: Optional[int] = None  # None: megazero.zero.param_offload.ring_bytes's default
    max_in_cpu: int = 1_000_000_000

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclasses.dataclass(frozen=True)
class ZeroOptimizationConfig:
    """DeepSpeed's ``zero_optimization`` block.

    Honoured (sizes in elements, as in DeepSpeed): ``stage``; ``overlap_comm``
    (asynchronous reduce-scatters); ``reduce_bucket_size`` (gradients of finished
    units are reduce-scattered in buckets of at least this many elements);
    ``max_reduce_in_flight`` (megazero's: buckets being reduced at once before the
    oldest is waited for); ``stage3_prefetch_bucket_size`` (elements all-gathered
    ahead of the unit in use); ``stage3_max_live_parameters`` (elements gathered at
    once, the unit in use excepted); ``stage3_param_persistence_threshold``;
    ``stage3_keep_gathered_in_step`` (megazero's, see the field).
    Accepted so that DeepSpeed files load, with no effect (they tune DeepSpeed's own
    machinery): ``allgather_bucket_size``, ``contiguous_gradients``,
    ``reduce_scatter``, ``stage3_max_reuse_distance``, ``sub_group_size``.

    Defaults are defined by what a step needs, as FSDP2's are, not by element counts
    (DeepSpeed's 5e7 prefetch and 1e9 live elements gather the whole of any model below
    a few billion parameters, and its 5e8-element bucket holds a 1.3B model's full-size
    gradients at once): unset, ``stage3_prefetch_bucket_size`` gathers the next unit
    only, ``stage3_max_live_parameters`` puts no cap beyond that, and
    ``reduce_bucket_size`` makes every unit a bucket of its own, so backward holds the
    unit in use, one unit prefetched, the gradients of the unit being computed and
    ``max_reduce_in_flight`` (default 1) units being reduced. Given, they are honoured
    as DeepSpeed defines them: more in flight, fewer and larger collectives.
    """

    stage: int = 0
    reduce_bucket_size: Optional[int] = None  # None: one unit per bucket
    max_reduce_in_flight: int = 1
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: Optional[int] = None  # None: the next unit
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: Optional[int] = None  # None: no cap beyond the prefetch
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    # megazero's: keep ZeRO-3 units gathered across a step's micro-batches and reduce-scatter the
    # gradients once per step (the pipeline-friendly policy: all-gather Psi + reduce-scatter Psi
    # per step instead of 3 Psi per micro-batch, at the cost of holding the stage's full
    # parameters and gradients during the step).
    stage3_keep_gathered_in_step: bool = False
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    train_micro_batch_size_per_gpu: Optional[int] = None
    gradient_accumulation_steps: int = 1
    train_batch_size: Optional[int] = None
    optimizer: OptimizerConfig = OptimizerConfig()
    zero_optimization: ZeroOptimizationConfig = ZeroOptimizationConfig()
    bf16: bool = False
    fp16: Optional[FP16Config] = None
    gradient_clipping: float = 0.0
    grad_accum_dtype: Optional[str] = None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    # Gradient-reduction numerics (DeepSpeed's keys): the dtype the reduction runs in (None:
    # the gradient dtype), divide by the DP size before reducing, and DeepSpeed's pre-divide factor.
    communication_data_type: Optional[str] = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        if self.fp16 is not None:
            return torch.float16
        return torch.float32

    @property
    def grad_dtype(self) -> torch.dtype:
        """Dtype of accumulated gradients: ``data_types.grad_accum_dtype`` if given, else fp32
        for bf16 (as Megatron's ``main_grad`` and DeepSpeed's bf16 optimizer: summing 32+
        micro-batches in bf16 loses about 0.7% of the gradient), else the compute dtype
        (fp16 keeps DeepSpeed's fp16 gradients under the loss scale)."""
        if self.grad_accum_dtype:
            return _DTYPES[self.grad_accum_dtype]
        return torch.float32 if self.bf16 else self.compute_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Dtype of the gradient collectives: ``communication_data_type`` if given, else the
        accumulation dtype. ``"bf16"`` halves the traffic at bf16's 8-bit mantissa: each
        reduction rounds the sum to ~3 significant digits (relative error ~2^-9 per step)."""
        if self.communication_data_type:
            return _DTYPES[self.communication_data_type]
        return self.grad_dtype

    def check_batch(self, dp_size: int) -> None:
        """DeepSpeed's invariant: train_batch_size = micro x accumulation x dp."""
        micro, accum, total = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps, self.train_batch_size
        if total is not None and micro is not None and total != micro * accum * dp_size:
            raise ZeroConfigError(
                f"train_batch_size ({total}) != train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({accum}) x data-parallel size ({dp_size}) = {micro * accum * dp_size}"
            )


    def validate(self) -> "ZeroConfig":
        """Refuse values out of range and settings that contradict each other (offload at stage 0,
        offload with SGD, bf16 and fp16 together, ...), naming the DeepSpeed key; returns ``self``.
        Every way of building a ZeroConfig (a DeepSpeed file, ``TrainConfig.zero_config()``) ends here."""
        zero, opt = self.zero_optimization, self.optimizer
        offload, offload_param = zero.offload_optimizer, zero.offload_param
        if zero.stage not in (0, 1, 2, 3):
            raise ZeroConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero.stage}")
        for key, block in (("offload_optimizer", offload), ("offload_param", offload_param)):
            where = f"zero_optimization.{key}"
            if block.device not in ("none", "cpu", "nvme"):
                raise ZeroConfigError(f"{where}.device must be none, cpu or nvme, got {block.device!r}")
            if block.device == "nvme" and not block.nvme_path:
                raise ZeroConfigError(f"{where}.device nvme needs {where}.nvme_path: a directory on the NVMe drive")
        if not 0.0 <= offload.ratio <= 1.0:
            raise ZeroConfigError(f"zero_optimization.offload_optimizer.ratio must be in [0, 1] (the fraction "
                                  f"offloaded), got {offload.ratio}")
        if offload.enabled and zero.stage == 0:
            raise ZeroConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3 (it offloads this rank's "
                                  "partition of the optimizer state); set zero_optimization.stage")
        if offload_param.enabled and zero.stage != 3:
            raise ZeroConfigError(f"zero_optimization.offload_param needs stage 3 (it offloads this rank's partition "
                                  f"of the parameters, which stages 0-2 do not partition; got stage {zero.stage}); "
                                  "set zero_optimization.stage to 3, or offload the optimizer state alone "
                                  "(offload_optimizer)")
        opt.component.check(opt)
        if offload.enabled and not opt.component.host_step:
            raise ZeroConfigError(f"zero_optimization.offload_optimizer steps the optimizer on the host; optimizer.type "
                                  f"{opt.type} has no host step (it runs on the accelerator): set "
                                  "offload_optimizer.device none")
        if self.bf16 and self.fp16 is not None:
            raise ZeroConfigError("bf16.enabled and fp16.enabled are both true; choose one precision")
        if self.gradient_accumulation_steps < 1:
            raise ZeroConfigError(f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}")
        if self.gradient_predivide_factor <= 0:
            raise ZeroConfigError(f"gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}")
        if self.gradient_clipping < 0:
            raise ZeroConfigError(f"gradient_clipping must be >= 0, got {self.gradient_clipping}")
        return self


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_UNSUPPORTED = {
    "zero_quantized_weights": "quantized ZeRO++ weights",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning",
}
# Blocks the engine accepts and does not read (the training layer's, or DeepSpeed's own tuning).
_IGNORED_TOP = {"zero_allow_untested_optimizer", "aio", "activation_checkpointing", "flops_profiler", "tensorboard",
                "csv_monitor", "wandb", "scheduler", "zero_force_ds_cpu_optimizer"}
_ACCEPTED = HONOURED_KEYS + NO_EFFECT_KEYS


def _known(where: str) -> set[str]:
    """The keys of block ``where`` (a dotted path) that HONOURED_KEYS and NO_EFFECT_KEYS list."""
    prefix = where + "."
    return {p[len(prefix):] for p in _ACCEPTED if p.startswith(prefix) and "." not in p[len(prefix):]}


def _pick(section: dict, where: str, handled: tuple[str, ...] = ()) -> dict:
    """``section``'s keys as dataclass keywords; refuses keys not listed for ``where``. ``handled``:
    listed keys the caller reads itself (left out of the result)."""
    known = _known(where)
    out = {}
    for key, value in section.items():
        if key not in known:
            raise ZeroConfigError(f"unknown key {where}.{key}; known keys: {', '.join(sorted(known))}")
        if key not in handled:
            out[key] = value
    return out


def _int(value: Any, key: str) -> int:
    try:
        return int(float(value))  # DeepSpeed files write sizes like 5e7
    except (TypeError, ValueError):
        raise ZeroConfigError(f"{key} must be a number, got {value!r}") from None


def _offload(section: Any, key: str, cls: type) -> Any:
    """``zero_optimization.<key>`` (absent, null or ``{}``: none) as ``cls``, DeepSpeed's keys checked."""
    if not section:
        return cls()
    where = f"zero_optimization.{key}"
    if not isinstance(section, dict):
        raise ZeroConfigError(f"{where} must be an object, got {section!r}")
    fields = _pick(section, where)
    device = str(fields.get("device", "none")).lower()
    if device not in ("none", "cpu", "nvme"):
        raise ZeroConfigError(f"{where}.device must be none, cpu or nvme, got {fields['device']!r}")
    fields["device"] = device
    if device == "nvme" and not fields.get("nvme_path"):
        raise ZeroConfigError(f"{where}.device nvme needs {where}.nvme_path: a directory on the NVMe drive")
    for name in ("buffer_count", "buffer_size", "max_in_cpu"):
        if name in fields:
            fields[name] = _int(fields[name], f"{where}.{name}")
            if fields[name] < (0 if name == "max_in_cpu" else 1):
                raise ZeroConfigError(f"{where}.{name} must be >= {0 if name == 'max_in_cpu' else 1}, "
                                      f"got {fields[name]}")
    if "ratio" in fields:
        fields["ratio"] = float(fields["ratio"])
        if not 0.0 <= fields["ratio"] <= 1.0:
            raise ZeroConfigError(f"{where}.ratio must be in [0, 1] (the fraction offloaded), got {fields['ratio']}")
    for name in ("pin_memory", "fast_init", "pipeline_read", "pipeline_write"):
        if name in fields:
            fields[name] = bool(fields[name])
    return cls(**fields)


def parse_zero_optimization(section: dict) -> ZeroOptimizationConfig:
    """DeepSpeed's ``zero_optimization`` block as a :class:`ZeroOptimizationConfig`; refuses
    unknown and unsupported keys. Contradictions with other blocks (offload at stage 0, ...) are
    refused by :meth:`ZeroConfig.validate`."""
    zsec = dict(section)
    for key, what in _UNSUPPORTED.items():
        if key in zsec and zsec[key] not in (None, {}, False) and (
            not isinstance(zsec[key], dict) or zsec[key].get("device", "none") != "none"
        ):
            raise ZeroConfigError(f"zero_optimization.{key} ({what}) is not supported by megazero.zero; remove it")
        zsec.pop(key, None)
    offload = _offload(zsec.pop("offload_optimizer", None), "offload_optimizer", OffloadOptimizerConfig)
    offload_param = _offload(zsec.pop("offload_param", None), "offload_param", OffloadParamConfig)
    zfields = _pick(zsec, "zero_optimization", handled=("round_robin_gradients",))
    for key in ("reduce_bucket_size", "max_reduce_in_flight", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"):
        if key in zfields:
            zfields[key] = _int(zfields[key], f"zero_optimization.{key}")
    return ZeroOptimizationConfig(**zfields, offload_optimizer=offload, offload_param=offload_param)


def parse_fp16(section: dict) -> FP16Config:
    """DeepSpeed's ``fp16`` block (its loss-scaler keys) as an :class:`FP16Config`, whether or not
    it is enabled; refuses unknown keys."""
    return FP16Config(**_pick(section, "fp16", handled=("enabled", "auto_cast")))


def parse_grad_accum_dtype(value: Any) -> Optional[str]:
    """``data_types.grad_accum_dtype``: ``fp32``, ``fp16``, ``bf16`` or absent (None)."""
    if value not in (None, "fp32", "fp16", "bf16"):
        raise ZeroConfigError(f"data_types.grad_accum_dtype must be fp32, fp16 or bf16, got {value!r}")
    return value


def parse_communication_data_type(value: Any) -> Optional[str]:
    """``communication_data_type`` in DeepSpeed's spellings (``fp32``/``float32``, ...) as
    ``fp32``, ``fp16`` or ``bf16``; None when absent."""
    if value is None:
        return None
    comm = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
            "bfloat16": "bf16"}.get(str(value).lower())
    if comm is None:
        raise ZeroConfigError(f"communication_data_type must be fp32, fp16 or bf16, got {value!r}")
    return comm


def load_config(config: Union[dict, str, os.PathLike, ZeroConfig]) -> ZeroConfig:
    """Parse a DeepSpeed-schema dict or JSON file into a validated :class:`ZeroConfig` (a
    ``ZeroConfig`` is returned as it is). Raises :class:`ZeroConfigError` naming the key of an
    unknown, unsupported or contradictory setting."""
    if isinstance(config, ZeroConfig):
        return config
    if not isinstance(config, dict):
        with open(config) as f:
            config = json.load(f)
    cfg = dict(config)
    known_top = {p.split(".")[0] for p in _ACCEPTED} | _IGNORED_TOP
    for key in cfg:
        if key not in known_top:
            raise ZeroConfigError(f"unknown top-level key {key!r} in the ZeRO/DeepSpeed config")

    opt = cfg.get("optimizer", {})
    if set(opt) - _known("optimizer") - {"params"}:
        raise ZeroConfigError(f"unknown keys in optimizer: {sorted(set(opt) - _known('optimizer') - {'params'})}")
    optimizer = parse_optimizer(opt.get("type", "AdamW"), opt.get("params", {}))
    zero = parse_zero_optimization(cfg.get("zero_optimization", {}))

    bf16_sec = cfg.get("bf16", cfg.get("bfloat16", {}))
    fp16_sec = cfg.get("fp16", {})
    micro = cfg.get("train_micro_batch_size_per_gpu")
    return ZeroConfig(
        train_micro_batch_size_per_gpu=None if micro is None else int(micro),
        gradient_accumulation_steps=int(cfg.get("gradient_accumulation_steps", 1)),
        train_batch_size=None if cfg.get("train_batch_size") is None else int(cfg["train_batch_size"]),
        optimizer=optimizer,
        zero_optimization=zero,
        bf16=bool(bf16_sec.get("enabled", False)),
        fp16=parse_fp16(fp16_sec) if fp16_sec.get("enabled", False) else None,
        gradient_clipping=float(cfg.get("gradient_clipping", 0.0)),
        grad_accum_dtype=parse_grad_accum_dtype(cfg.get("data_types", {}).get("grad_accum_dtype")),
        steps_per_print=int(cfg.get("steps_per_print", 10)),
        wall_clock_breakdown=bool(cfg.get("wall_clock_breakdown", False)),
        communication_data_type=parse_communication_data_type(cfg.get("communication_data_type")),
        prescale_gradients=bool(cfg.get("prescale_gradients", False)),
        gradient_predivide_factor=float(cfg.get("gradient_predivide_factor", 1.0)),
    ).validate()
