"""The loop's metrics logger: the interval's losses, timers and statistics into Megatron's log line
and the metrics records (JSONL, TensorBoard, CSV, Weights & Biases)."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.config.train_config import TrainConfig
from megazero.model import (
    EXPERT_LOAD_SUM,
    LM_LOSS,
    MOE_AUX_LOSS,
    MOE_DROPPED_SUM,
    MOE_LAYERS,
    is_mtp_loss,
    num_parameters,
)
from megazero.training.health.phases import PhaseBoard
from megazero.training.health.stragglers import Stragglers
from megazero.training.loop.state import StepResult, TrainState
from megazero.training.lr_schedule import LRScheduler
from megazero.training.meters import IntervalMeter, IterationStats, MetricsWriter, Throughput, format_log_lines
from megazero.training.norms import count_zeros_in_grads, optimizer_state_stats, params_norm
from megazero.training.run_control import PhaseClock
from megazero.training.step import LossLog, TrainModel
from megazero.utils.memory_tracker import step_peak_memory
from megazero.utils.output import rank_zero_logger

__all__ = ["MetricsLogger", "describe_model"]

log = rank_zero_logger(__name__)

_HOST_STATE = ("host_optimizer", "host_ring", "host_params", "host_param_ring")


def describe_model(config: TrainConfig, run: TrainModel) -> str:
    """The start-up line on the model: its size, the layout, and the model state per rank (on the
    device, and what is offloaded to host memory and NVMe)."""
    p, engine = config.parallel, run.engine
    state = engine.model_state_bytes()
    host = sum(state.get(k, 0) for k in _HOST_STATE)
    files = state.get("nvme", 0) + state.get("nvme_params", 0)
    offloaded = f"; offloaded: host {host / 2**20:.1f} MiB, NVMe {files / 2**20:.1f} MiB" if host or files else ""
    return (f"> model: {num_parameters(config.model):,} parameters (this rank {engine.num_local_parameters():,}); "
            f"tp={p.tp} pp={p.pp} dp={p.dp} ZeRO-{engine.stage} {config.precision.dtype}; model state per rank "
            f"{state['total'] / 2**20:.1f} MiB on the device{offloaded}")


class MetricsLogger:
    """Keeps each iteration's loss on the device; every ``--log-interval`` iterations and at the last
    one brings them to the host (one collective, one synchronisation) and logs the line and its record
    (``metrics.format_log_lines``): loss, learning rate, grad norm, time, throughput, MFU, peak memory;
    on a second line when present the fp16 loss scale, skipped and NaN iterations, a mixture's statistics,
    and as asked ``--log-params-norm``, ``--log-num-zeros-in-grad``, optimizer statistics, per-phase
    timers (``--wall-clock-breakdown``); with ``--log-straggler`` (which needs the loop's ``board``) a
    line on the slowest and fastest ranks per phase (:mod:`..health.stragglers`, one more small
    gather). A logging flag is honoured here alone.

    ``check(state, iteration, loss)`` sees every loss as it reaches the host (the failure protocol's
    divergence check). A context manager: ``--track-memory`` on CPU tracks live tensors while inside,
    and the writer closes on exit.
    """

    def __init__(self, config: TrainConfig, run: TrainModel, scheduler: LRScheduler, start_iteration: int,
                 check: Optional[Callable[[TrainState, int, float], None]] = None,
                 board: Optional[PhaseBoard] = None) -> None:
        opts = config.logging
        self.config, self.run, self.scheduler, self.check = config, run, scheduler, check
        self.writer = MetricsWriter(opts.metrics_file, opts.tensorboard_dir, rank=dist.get_rank(), options=opts)
        self.timers: Optional[dict] = {} if (opts.wall_clock_breakdown or opts.log_timers_to_tensorboard) else None
        self.zeros = count_zeros_in_grads(run.engine, run.groups) if opts.log_num_zeros_in_grad else None
        self.throughput = Throughput.from_config(config, run.device)
        self.capacity_mb = torch.cuda.get_device_properties(run.device).total_memory / 2 ** 20 \
            if run.device.type == "cuda" else None
        self.meter = IntervalMeter()
        self.loss_log = LossLog(run.groups)
        self.skipped_at: dict[int, bool] = {}
        self.losses: dict[int, float] = {}  # iteration -> DP-mean loss, every one brought to the host
        self.last_log = start_iteration
        self.stragglers = self._stragglers(board) if opts.log_straggler else None
        self._tracking = contextlib.ExitStack()
        if opts.track_memory and run.device.type == "cpu":
            from megazero.utils.memory_tracker import LiveMemoryTracker

            # Entered after the engine exists, so its state is part of the baseline and the peak is absolute.
            self._tracking.enter_context(LiveMemoryTracker("cpu"))

    def _stragglers(self, board: Optional[PhaseBoard]) -> Stragglers:
        if board is None:
            raise ValueError("--log-straggler times the loop's phases: the MetricsLogger needs the loop's "
                             "PhaseBoard (board=...)")
        opts = self.config.logging
        stragglers = Stragglers(self.run.device, opts.straggler_factor, opts.straggler_minmax_count,
                                log=log.info, warn=log.warning)
        board.listeners.append(stragglers.timer)
        return stragglers

    def lap(self) -> Optional[Callable[[str], None]]:
        """The step's per-phase clock (a fresh one per step), or None without timers."""
        return PhaseClock(self.timers, self.run.device).lap if self.timers is not None else None

    def record(self, state: TrainState, result: StepResult) -> None:
        """The step of ``state.iteration``: its loss stays on the device until the next flush."""
        self.loss_log.add(state.iteration, result.metrics)
        self.skipped_at[state.iteration] = not result.updated

    def drain(self) -> dict[int, dict[str, float]]:
        """The pending figures on the host (``{iteration: {name: DP mean}}``), not counted in the interval."""
        return self.loss_log.flush()

    def flush(self, state: TrainState) -> None:
        """The pending losses to the host, checked and counted in the interval."""
        for it, figures in self.drain().items():
            values = self._logged(figures)
            loss = values[LM_LOSS]
            self.losses[it] = loss
            if self.check is not None:
                self.check(state, it, loss)
            self.meter.update(values, skipped=self.skipped_at.pop(it, False))

    def _logged(self, figures: dict[str, float]) -> dict[str, float]:
        """The step's reduced figures (:attr:`TrainModel.metric_names`) as the log shows them: the LM loss,
        multi-token prediction's per depth, a mixture's auxiliary loss, its experts' load (the busiest over
        the mean, averaged over the layers) and, with a capacity, the share of token copies dropped."""
        values = {name: v for name, v in figures.items() if name == LM_LOSS or is_mtp_loss(name)}
        if MOE_AUX_LOSS in figures:
            values[MOE_AUX_LOSS] = figures[MOE_AUX_LOSS]
            layers = figures[MOE_LAYERS]
            if layers:
                values["expert load max over mean"] = figures[EXPERT_LOAD_SUM] / layers
                if self.config.model.moe_expert_capacity_factor is not None:
                    values["moe dropped fraction"] = figures[MOE_DROPPED_SUM] / layers
        return values

    def after_step(self, state: TrainState) -> None:
        """Log at every ``--log-interval``-th iteration and at the last one."""
        it = state.iteration
        if it % self.config.logging.log_interval == 0 or it == self.config.schedule.train_iters:
            self.flush(state)
            stats = self._stats(state)
            for line in format_log_lines(stats):
                log.info(line)
            if self.stragglers is not None:  # after _stats' device synchronisation: the events are resolved
                stats.extra.update(self.stragglers.report())
            self.writer.write(state.iteration, stats.to_record())

    def _stats(self, state: TrainState) -> IterationStats:
        s, engine, device = self.config.schedule, self.run.engine, self.run.device
        if device.type == "cuda":
            torch.cuda.synchronize()
        peak_bytes, memory_source = step_peak_memory(device)
        stats = IterationStats.from_summary(
            self.meter.pop(), iteration=state.iteration, train_iters=s.train_iters,
            consumed_samples=state.consumed_samples, lr=self.scheduler.lr, global_batch_size=state.batch_size,
            throughput=self.throughput, loss_scale=engine.get_loss_scale(), grad_norm=engine.get_global_grad_norm(),
            memory=peak_bytes / 2 ** 20)
        stats.peak_memory_source, stats.memory_capacity_mb = memory_source, self.capacity_mb
        stats.loss_scaling = self.config.precision.dtype == "fp16"
        if state.batch_size != s.global_batch_size:  # a ramp-up iteration
            at = self.throughput.at_batch(state.batch_size, s.global_batch_size)
            stats.tokens_per_second = at.tokens_per_second(stats.seconds_per_iteration)
            stats.tflops_per_rank = at.tflops_per_rank(stats.seconds_per_iteration)
            stats.mfu = at.mfu(stats.seconds_per_iteration)
            stats.show_batch = True
        if self.timers is not None:
            n = max(state.iteration - self.last_log, 1)
            stats.timers_ms = {k: v * 1000.0 / n for k, v in self.timers.items()}
            self.timers.clear()
        self.last_log = state.iteration
        opts = self.config.logging
        if opts.log_params_norm:
            stats.extra["params_norm"] = params_norm(engine, self.run.groups)
        if self.config.optim.log_max_attention_logit and self.run.qk_clip is not None:
            stats.extra["max_attention_logit"] = self.run.qk_clip.largest(self.run.groups.mp_group)
        if self.zeros is not None and self.zeros.zeros is not None:
            stats.extra["num_zeros"] = float(self.zeros.zeros)
        if opts.log_optimizer_states_to_tensorboard:
            stats.extra.update(optimizer_state_stats(engine, self.run.groups))
        return stats

    def close(self) -> None:
        self._tracking.close()
        self.writer.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
