"""Training metrics: Megatron-style log lines, throughput, and JSONL/TensorBoard output.

The loop keeps an ``IntervalMeter`` per log interval, turns its summary into an
``IterationStats`` and hands that to ``format_log_line`` (logged by rank 0) and to
``MetricsWriter.write`` (JSONL + optional TensorBoard, rank 0 only):

    meter = IntervalMeter()
    ...every iteration:  meter.update({"lm loss": loss}, skipped=skipped)
    ...every log_interval iterations (after torch.cuda.synchronize()):
        summary = meter.pop()
        stats = IterationStats.from_summary(summary, iteration=it, train_iters=cfg.schedule.train_iters,
                                            consumed_samples=..., lr=..., global_batch_size=...,
                                            throughput=Throughput.from_config(cfg), loss_scale=..., grad_norm=...)
        log.info(format_log_line(stats)); writer.write(stats.iteration, stats.to_record())

JSONL record keys (one object per line; non-finite numbers are written as null):
``iteration``, ``consumed_samples``, ``lr``, ``global_batch_size``, ``lm_loss`` (each loss
name with spaces -> '_'), ``loss_scale``, ``grad_norm``, ``skipped_iterations``,
``nan_iterations``, ``elapsed_ms_per_iteration``, ``tokens_per_s``, ``tflops_per_rank``,
``mfu`` (where the device's peak is known), ``memory_mb``, ``timestamp``. Evaluation records use
``eval_`` keys, e.g. ``{"iteration": 1000, "eval_lm_loss": 3.2, "eval_ppl": 24.5}``.

The log line is short (as torchtitan's) and keeps the keys Megatron users grep (``iteration``,
``lm loss``, ``elapsed time per iteration (ms)``, ``tokens/s``, ``TFLOP/s per rank``)::

     iteration       10/     100 | lm loss: 5.1234 | lr: 1.000E-04 | grad norm: 1.234 | elapsed time per iteration (ms): 123.4 | tokens/s: 1062188 | TFLOP/s per rank: 412.5 | MFU: 41.7% | peak memory: 30.12 GiB (21%)
                                 | loss scale: 65536.0 | number of skipped iterations:   1 | moe aux loss: 1.2000E-02 | expert load max over mean: 1.86 |

The second line only when it has something to say: the fp16 loss scale, skipped or NaN iterations,
the batch during a ramp-up, a mixture of experts' statistics, the statistics the logging flags ask for.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from megazero.model import LM_LOSS, MOE_AUX_LOSS, is_mtp_loss
from megazero.utils.memory_tracker import step_peak_memory

if TYPE_CHECKING:
    from megazero.config.train_config import TrainConfig

__all__ = ["Throughput", "IterationStats", "IntervalMeter", "IntervalSummary", "MetricsWriter",
           "format_log_line", "format_log_lines", "memory_mb", "metric_key", "megatron_scalars", "peak_tflops",
           "PEAK_TFLOPS", "TRAIN_LOSS_KEY", "EVAL_LOSS_KEY"]

TRAIN_LOSS_KEY = "lm_loss"  # metric_key(LM_LOSS)
EVAL_LOSS_KEY = "eval_lm_loss"

_log = logging.getLogger(__name__)


def metric_key(name: str) -> str:
    """'lm loss' -> 'lm_loss' (JSON/TensorBoard-friendly)."""
    return name.strip().replace(" ", "_").replace("-", "_")


def memory_mb(device: Optional[torch.device] = None) -> Optional[float]:
    """The peak memory in MiB since the previous call (call it once per log interval):
    ``max_memory_allocated`` on a GPU (whose peak statistics this call resets); on CPU the
    peak live tensor bytes of the active ``megazero.utils.LiveMemoryTracker`` (whose peak
    window restarts), else the current resident set size. ``megazero.utils.peak_memory_source(device)``
    names which one it is, for the log line's label."""
    return step_peak_memory(device)[0] / 2 ** 20


# Dense bf16/fp16 peak TFLOP/s of one device by a fragment of its CUDA name (NVIDIA's datasheets, SXM parts
# unless named); the first fragment found in the name counts, so the more specific ones come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.0), ("H800", 989.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("A10G", 70.0))


def peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a CUDA device named ``device_name`` (:data:`PEAK_TFLOPS`), None if unknown."""
    return next((v for k, v in PEAK_TFLOPS if k in device_name), None)


def _device_peak(config: "TrainConfig", device: Optional[torch.device]) -> Optional[float]:
    """--device-peak-tflops, else the table's peak for a bf16/fp16 run on a known CUDA device (fp32 runs and
    CPUs have no MFU unless the flag says the peak)."""
    given = getattr(config.logging, "device_peak_tflops", None)
    if given is not None:
        return given
    if device is None or device.type != "cuda" or config.precision.dtype not in ("bf16", "fp16"):
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


@dataclass
class Throughput:
    """Tokens/s, TFLOP/s per rank and model FLOPs utilisation from the time of one iteration."""

    flops_per_iteration: float  # training FLOPs of one global batch (all ranks together), recompute included
    tokens_per_iteration: int  # global batch x sequence length
    world_size: int
    model_flops_per_iteration: float = 0.0  # the same without recompute (MFU's numerator, as PaLM's)
    peak_tflops: Optional[float] = None  # one device's dense peak (MFU's denominator); None: no MFU

    @classmethod
    def from_config(cls, config: "TrainConfig", device: Optional[torch.device] = None) -> "Throughput":
        """Counts FLOPs with Narayanan et al. 2021 Eq. 3 (factor 4 with full recompute); the peak for MFU
        from --device-peak-tflops or ``device``'s name (:func:`peak_tflops`)."""
        from megazero.model.flops import flops_per_iteration

        m, s = config.model, config.schedule
        return cls(flops_per_iteration=flops_per_iteration(m, s.global_batch_size, m.seq_length,
                                                           recompute_full=m.recompute_granularity == "full"),
                   tokens_per_iteration=s.global_batch_size * m.seq_length,
                   world_size=config.parallel.world_size,
                   model_flops_per_iteration=flops_per_iteration(m, s.global_batch_size, m.seq_length),
                   peak_tflops=_device_peak(config, device))

    def at_batch(self, global_batch_size: int, full_batch_size: int) -> "Throughput":
        """The same model at another global batch (a ramp-up iteration): FLOPs and tokens scale with it."""
        f = global_batch_size / full_batch_size
        return Throughput(self.flops_per_iteration * f, int(round(self.tokens_per_iteration * f)), self.world_size,
                          self.model_flops_per_iteration * f, self.peak_tflops)

    def tokens_per_second(self, seconds_per_iteration: float) -> float:
        return self.tokens_per_iteration / seconds_per_iteration

    def tflops_per_rank(self, seconds_per_iteration: float) -> float:
        """flops_per_iteration / (time x world_size) / 1e12."""
        return self.flops_per_iteration / (seconds_per_iteration * self.world_size) / 1e12

    def mfu(self, seconds_per_iteration: float) -> Optional[float]:
        """Model FLOPs (no recompute) per second and rank over the device's peak; None without a peak."""
        if not self.peak_tflops or not self.model_flops_per_iteration:
            return None
        achieved = self.model_flops_per_iteration / (seconds_per_iteration * self.world_size) / 1e12
        return achieved / self.peak_tflops


@dataclass
class IntervalSummary:
    """What happened since the last log line."""

    losses: dict[str, float]  # mean of each loss over the iterations that were neither skipped nor NaN
    iterations: int
    skipped_iterations: int
    nan_iterations: int
    seconds_per_iteration: float


class IntervalMeter:
    """Averages losses and counts skipped / NaN iterations between two log lines.

    Skipped iterations (fp16 overflow) and non-finite losses are counted but not
    averaged in, as Megatron does. Times with ``time.perf_counter``: synchronize the
    GPU before ``pop`` so the interval includes the queued kernels.
    """

    def __init__(self) -> None:
        self._reset(time.perf_counter())

    def _reset(self, start: float) -> None:
        self._start = start
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._iterations = self._skipped = self._nan = 0

    def update(self, losses: Mapping[str, float], *, skipped: bool = False) -> None:
        """Record one iteration's (already reduced) losses."""
        self._iterations += 1
        if skipped:
            self._skipped += 1
            return
        values = {k: float(v) for k, v in losses.items()}
        if any(not math.isfinite(v) for v in values.values()):
            self._nan += 1
            return
        for k, v in values.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
            self._counts[k] = self._counts.get(k, 0) + 1

    def pop(self, now: Optional[float] = None) -> IntervalSummary:
        """Summary of the interval; starts the next one."""
        now = time.perf_counter() if now is None else now
        summary = IntervalSummary(
            losses={k: self._sums[k] / self._counts[k] for k in self._sums},
            iterations=self._iterations, skipped_iterations=self._skipped, nan_iterations=self._nan,
            seconds_per_iteration=(now - self._start) / max(self._iterations, 1))
        self._reset(now)
        return summary


@dataclass
class IterationStats:
    """One log line's numbers."""

    iteration: int
    train_iters: int
    consumed_samples: int
    seconds_per_iteration: float
    lr: float
    global_batch_size: int
    losses: dict[str, float] = field(default_factory=dict)  # e.g. {"lm loss": 5.12}
    loss_scale: Optional[float] = None
    grad_norm: Optional[float] = None
    skipped_iterations: int = 0
    nan_iterations: int = 0
    tokens_per_second: Optional[float] = None
    tflops_per_rank: Optional[float] = None
    mfu: Optional[float] = None  # model FLOPs utilisation, a fraction of the device's peak
    memory_mb: Optional[float] = None
    memory_capacity_mb: Optional[float] = None  # the device's memory (CUDA): the log line gives the share
    loss_scaling: bool = True  # False: no loss scaler (bf16/fp32), the line leaves the scale out
    show_batch: bool = False  # a ramp-up iteration: the line gives the batch and consumed samples
    # where memory_mb comes from (megazero.utils.peak_memory_source): the log line names it
    peak_memory_source: Optional[str] = None
    # ms per iteration of each phase (--wall-clock breakdown / --log-timers-to-tensorboard): fwd, bwd, step
    timers_ms: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)  # params_norm, num_zeros, optimizer/... when asked

    @classmethod
    def from_summary(cls, summary: IntervalSummary, *, iteration: int, train_iters: int, consumed_samples: int,
                     lr: float, global_batch_size: int, throughput: Optional[Throughput] = None,
                     loss_scale: Optional[float] = None, grad_norm: Optional[float] = None,
                     memory: Optional[float] = None) -> "IterationStats":
        t = summary.seconds_per_iteration
        return cls(iteration=iteration, train_iters=train_iters, consumed_samples=consumed_samples,
                   seconds_per_iteration=t, lr=lr, global_batch_size=global_batch_size, losses=dict(summary.losses),
                   loss_scale=loss_scale, grad_norm=grad_norm, skipped_iterations=summary.skipped_iterations,
                   nan_iterations=summary.nan_iterations,
                   tokens_per_second=throughput.tokens_per_second(t) if throughput and t > 0 else None,
                   tflops_per_rank=throughput.tflops_per_rank(t) if throughput and t > 0 else None,
                   mfu=throughput.mfu(t) if throughput and t > 0 else None, memory_mb=memory)

    def to_record(self) -> dict[str, Any]:
        """The JSONL/TensorBoard record (keys in the module docstring)."""
        rec: dict[str, Any] = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                               "lr": self.lr, "global_batch_size": self.global_batch_size}
        rec.update({metric_key(k): v for k, v in self.losses.items()})
        rec.update(loss_scale=self.loss_scale, grad_norm=self.grad_norm,
                   skipped_iterations=self.skipped_iterations, nan_iterations=self.nan_iterations,
                   elapsed_ms_per_iteration=self.seconds_per_iteration * 1000.0,
                   tokens_per_s=self.tokens_per_second, tflops_per_rank=self.tflops_per_rank,
                   memory_mb=self.memory_mb)
        if self.mfu is not None:
            rec["mfu"] = self.mfu
        if self.peak_memory_source is not None:
            rec["peak_memory_source"] = self.peak_memory_source
        rec.update({f"{k}_ms": v for k, v in self.timers_ms.items()})
        rec.update(self.extra)
        return rec


# The log line says what its memory figure measures: a CPU allocator keeps no peak, so without
# --track-memory the figure there is the resident set size, not a peak.
MEMORY_LABELS = {"cuda_peak_allocated": "peak memory", "tracked_peak_live": "peak memory (tracked live tensors)",
                 "rss": "memory (RSS)"}


def _size(mb: float) -> str:
    return f"{mb:.0f} MiB" if mb < 1024 else f"{mb / 1024:.2f} GiB"


def _tflops(value: float) -> str:
    # CPU runs reach hundredths of a TFLOP/s: keep three significant digits there.
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_log_lines(stats: IterationStats) -> list[str]:
    """The training log: one short line (step, loss, lr, grad norm, time, throughput, MFU, memory) and, when
    there is any, a second with the rest (see the module docstring). Fields that are None are left out."""
    head = f" iteration {stats.iteration:8d}/{stats.train_iters:8d}"  # Megatron's, which scripts parse
    main = [head]
    if LM_LOSS in stats.losses:
        main.append(f"{LM_LOSS}: {stats.losses[LM_LOSS]:.4f}")
    main += [f"{name}: {value:.4f}" for name, value in stats.losses.items() if is_mtp_loss(name)]  # Megatron's place
    main.append(f"lr: {stats.lr:.3E}")
    if stats.grad_norm is not None:
        main.append(f"grad norm: {stats.grad_norm:.3f}")
    main.append(f"elapsed time per iteration (ms): {stats.seconds_per_iteration * 1000.0:.1f}")
    if stats.tokens_per_second is not None:
        main.append(f"tokens/s: {stats.tokens_per_second:.0f}")
    if stats.tflops_per_rank is not None:
        main.append(f"TFLOP/s per rank: {_tflops(stats.tflops_per_rank)}")
    if stats.mfu is not None:
        main.append(f"MFU: {100 * stats.mfu:.1f}%" if stats.mfu >= 0.01 else f"MFU: {100 * stats.mfu:.2g}%")
    if stats.memory_mb is not None:
        share = f" ({100 * stats.memory_mb / stats.memory_capacity_mb:.0f}%)" if stats.memory_capacity_mb else ""
        main.append(f"{MEMORY_LABELS.get(stats.peak_memory_source, 'memory')}: {_size(stats.memory_mb)}{share}")
    rest = []
    if stats.show_batch:
        rest += [f"consumed samples: {stats.consumed_samples}", f"global batch size: {stats.global_batch_size}"]
    if stats.loss_scaling and stats.loss_scale is not None:
        rest.append(f"loss scale: {stats.loss_scale:.1f}")
    for count, what in ((stats.skipped_iterations, "skipped"), (stats.nan_iterations, "nan")):
        if count:
            rest.append(f"number of {what} iterations: {count:3d}")
    for name, value in stats.losses.items():
        if name != LM_LOSS and not is_mtp_loss(name):
            rest.append(f"{name}: {value:.2f}" if name == "expert load max over mean" else f"{name}: {value:.4E}")
    if "params_norm" in stats.extra:
        rest.append(f"params norm: {stats.extra['params_norm']:.3f}")
    if "num_zeros" in stats.extra:
        rest.append(f"num zeros: {stats.extra['num_zeros']:.1f}")
    if stats.timers_ms:
        # DeepSpeed's wall_clock_breakdown: where the iteration's time went
        rest.append("time (ms) " + " ".join(f"{k}: {v:.1f}" for k, v in stats.timers_ms.items()))
    lines = [" | ".join(main)]
    if rest:
        lines.append(" " * len(head) + " | " + " | ".join(rest) + " |")
    return lines


def format_log_line(stats: IterationStats) -> str:
    """:func:`format_log_lines` as one string (its lines joined by newlines)."""
    return "\n".join(format_log_lines(stats))


# JSONL key -> Megatron's TensorBoard tag, and the logging option that enables it (None: always, as
# Megatron's --log-learning-rate-to-tensorboard / --log-loss-scale-to-tensorboard default on). A mixture's
# statistics are the log line's (Megatron writes its per-kind router losses whenever experts train; megazero's
# 'moe aux loss' is their sum); --log-throughput adds tokens/s and MFU beside Megatron's 'throughput'.
_TB_TAGS: dict[str, tuple[str, Optional[str]]] = {
    "lr": ("learning-rate", None),
    "lm_loss": (LM_LOSS, None),
    "loss_scale": ("loss-scale", None),
    "grad_norm": ("grad-norm", None),
    "global_batch_size": ("batch-size", "log_batch_size_to_tensorboard"),
    "params_norm": ("params-norm", "log_params_norm"),
    "num_zeros": ("num-zeros", "log_num_zeros_in_grad"),
    "eval_lm_loss": ("lm loss validation", None),
    "eval_ppl": ("lm loss validation ppl", "log_validation_ppl_to_tensorboard"),
    "tflops_per_rank": ("throughput", "log_throughput"),
    "tokens_per_s": ("tokens-per-second", "log_throughput"),
    "mfu": ("mfu", "log_throughput"),
    "moe_aux_loss": (MOE_AUX_LOSS, None),
    "expert_load_max_over_mean": ("expert load max over mean", None),
    "moe_dropped_fraction": ("moe dropped fraction", None),
    "max_attention_logit": ("max_attention_logit", None),  # in the record with --log-max-attention-logit only
    "fwd_ms": ("forward-compute-time", "log_timers_to_tensorboard"),
    "bwd_ms": ("backward-compute-time", "log_timers_to_tensorboard"),
    "step_ms": ("optimizer-time", "log_timers_to_tensorboard"),
    "elapsed_ms_per_iteration": ("iteration-time", "log_timers_to_tensorboard"),
}
_VS_SAMPLES = {"learning-rate", "lm loss", "loss-scale", "grad-norm", "batch-size", "params-norm", "num-zeros",
               "lm loss validation", "lm loss validation ppl"}


def megatron_scalars(record: Mapping[str, Any], options: Any) -> list[tuple[str, float, str]]:
    """``(tag, value, axis)`` with Megatron's TensorBoard tag names; axis 'iteration' or 'samples'
    (Megatron writes most scalars twice: by iteration and '<tag> vs samples'). ``options`` is a
    LoggingConfig (its log_* switches gate the optional tags)."""
    out = []
    for key, value in record.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value is None:
            continue
        if key.startswith("optimizer/"):
            if getattr(options, "log_optimizer_states_to_tensorboard", False):
                out.append((key, float(value), "iteration"))
            continue
        if key == "memory_mb":
            if getattr(options, "log_memory_to_tensorboard", False):
                out.append(("mem-max-allocated-bytes", float(value) * 2 ** 20, "iteration"))
            continue
        if re.fullmatch(r"mtp_\d+_loss", key):  # Megatron's 'mtp_k loss' tags
            out.append((key[:-len("_loss")] + " loss", float(value), "iteration"))
            continue
        if key not in _TB_TAGS:
            continue
        tag, switch = _TB_TAGS[key]
        if switch is not None and not getattr(options, switch, False):
            continue
        value = float(value) / 1000.0 if key == "elapsed_ms_per_iteration" else float(value)
        out.append((tag, value, "iteration"))
        if tag in _VS_SAMPLES and "consumed_samples" in record:
            out.append((f"{tag} vs samples", value, "samples"))
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/inf; nan_iterations carries that information
    return value


class MetricsWriter:
    """Rank 0 writes one JSON object per ``write`` to a JSONL file (appending, so a
    resumed run continues the same file) and, when ``tensorboard_dir`` is given and
    TensorBoard is installed, the numeric values as scalars. Other ranks do nothing."""

    def __init__(self, jsonl_path: Optional[str] = None, tensorboard_dir: Optional[str] = None, rank: int = 0,
                 options: Any = None) -> None:
        """``options`` (a LoggingConfig) switches TensorBoard to Megatron's tag names and enables the
        DeepSpeed csv_monitor files and Weights & Biases; without it, scalars use the JSONL keys."""
        self.rank = rank
        self._file = None
        self._tb = None
        self._wandb = None
        self.options = options
        self._csv_dir = getattr(options, "csv_dir", None)
        self._consumed = 0
        if rank != 0:
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._file = open(jsonl_path, "a", encoding="utf-8")
        if tensorboard_dir:
            try:
                # Lazy: tensorboard is an optional dependency.
                from torch.utils.tensorboard import SummaryWriter
            except Exception as e:  # ImportError, or a tensorboard/protobuf version clash
                _log.warning("TensorBoard logging disabled (%s); pip install tensorboard to enable it", e)
            else:
                self._tb = SummaryWriter(log_dir=tensorboard_dir,
                                         max_queue=getattr(options, "tensorboard_queue_size", 10))
        if self._csv_dir:
            os.makedirs(self._csv_dir, exist_ok=True)
        if getattr(options, "wandb_project", None):
            import wandb  # presence checked when the command line was parsed

            save_dir = options.wandb_save_dir  # --wandb-save-dir, else {save}/wandb; None: wandb's ./wandb
            if save_dir:
                os.makedirs(save_dir, exist_ok=True)
            self._wandb = wandb.init(project=options.wandb_project, name=options.wandb_exp_name, dir=save_dir)

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def write(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` at ``iteration`` (adds ``iteration`` and ``timestamp`` keys)."""
        if self.rank != 0:
            return
        record = {"iteration": int(iteration), **{k: _clean(v) for k, v in metrics.items() if k != "iteration"},
                  "timestamp": time.time()}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # a crash keeps everything up to the last log line
        if isinstance(record.get("consumed_samples"), int):
            self._consumed = record["consumed_samples"]
        every = getattr(self.options, "tensorboard_log_interval", 1)
        if self._tb is not None and self.options is not None and int(iteration) % every == 0:
            for tag, value, axis in megatron_scalars({**record, "consumed_samples": self._consumed}, self.options):
                self._tb.add_scalar(tag, value, int(iteration) if axis == "iteration" else self._consumed)
        elif self._tb is not None and self.options is None:
            for key, value in record.items():
                if key not in ("iteration", "timestamp") and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, int(iteration))
        if self._csv_dir:
            # DeepSpeed's csv_monitor: one file per metric, 'step,value' rows
            for key, value in record.items():
                if key not in ("iteration", "timestamp") and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    path = os.path.join(self._csv_dir, key.replace("/", "_") + ".csv")
                    new = not os.path.exists(path)
                    with open(path, "a", encoding="utf-8") as f:
                        if new:
                            f.write("step,value\n")
                        f.write(f"{int(iteration)},{value}\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k not in ("iteration", "timestamp") and v is not None},
                            step=int(iteration))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
