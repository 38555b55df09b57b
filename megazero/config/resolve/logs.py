"""Logging: log interval, metrics file, TensorBoard, CSV monitor, Weights & Biases."""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional

from megazero.config.resolve.common import default, json_get
from megazero.config.train_config import ConfigError, LoggingConfig


def resolve_logging(ns: argparse.Namespace, ds: Optional[dict[str, Any]], notes: list[str],
                     check_files: bool) -> LoggingConfig:
    ds = ds or {}
    log_interval = default(ns.log_interval, json_get(ds, "steps_per_print") or 100)
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
    # Megatron's default: {save}/wandb (without --save, wandb's own ./wandb)
    wandb_save_dir = ns.wandb_save_dir or (os.path.join(ns.save, "wandb") if wandb_project and ns.save else None)
    cfg = LoggingConfig(
        log_interval=log_interval, tensorboard_dir=tb_dir, metrics_file=metrics_file,
        wall_clock_breakdown=bool(json_get(ds, "wall_clock_breakdown") or False),
        tensorboard_log_interval=default(ns.tensorboard_log_interval, 1),
        tensorboard_queue_size=default(ns.tensorboard_queue_size, 1000), csv_dir=csv_dir,
        wandb_project=wandb_project, wandb_exp_name=ns.wandb_exp_name, wandb_save_dir=wandb_save_dir,
        track_memory=bool(ns.track_memory), device_peak_tflops=ns.device_peak_tflops)
    cfg.log_straggler = bool(ns.log_straggler)
    cfg.straggler_minmax_count = default(ns.straggler_minmax_count, 1)
    cfg.straggler_factor = default(ns.straggler_factor, 1.5)
    if cfg.straggler_minmax_count < 1:
        raise ConfigError(f"--straggler-minmax-count must be >= 1, got {cfg.straggler_minmax_count}")
    if not cfg.straggler_factor > 1:
        raise ConfigError(f"--straggler-factor must be > 1 (a slowdown against the median rank), got "
                          f"{cfg.straggler_factor:g}")
    if cfg.device_peak_tflops is not None and not cfg.device_peak_tflops > 0:
        raise ConfigError(f"--device-peak-tflops must be > 0, got {cfg.device_peak_tflops}")
    for name in ("log_timers_to_tensorboard", "log_batch_size_to_tensorboard", "log_validation_ppl_to_tensorboard",
                 "log_memory_to_tensorboard", "log_optimizer_states_to_tensorboard", "log_params_norm",
                 "log_num_zeros_in_grad", "log_throughput"):
        setattr(cfg, name, bool(getattr(ns, name)))
    if cfg.tensorboard_log_interval < 1 or cfg.tensorboard_queue_size < 1:
        raise ConfigError(f"--tensorboard-log-interval and --tensorboard-queue-size must be >= 1, got "
                          f"{cfg.tensorboard_log_interval}, {cfg.tensorboard_queue_size}")
    return cfg
