"""Training product pieces: typed run config from the command line, LR schedule,
metrics/logging and the memory planner. The loop itself builds on these."""

from megazero.training.arguments import build_parser, check_vocab, describe, parse_args, parse_args_or_exit
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
from megazero.training.lr_schedule import LRScheduler
from megazero.training.memory import MemoryEstimate, estimate_memory, estimate_memory_for
from megazero.training.metrics import (
    IntervalMeter,
    IntervalSummary,
    IterationStats,
    MetricsWriter,
    Throughput,
    format_log_line,
    memory_mb,
)

__all__ = [
    # arguments
    "build_parser", "check_vocab", "describe", "parse_args", "parse_args_or_exit",
    # config
    "CheckpointConfig", "ConfigError", "DataConfig", "GenerateConfig", "LoggingConfig", "OptimConfig",
    "ParallelConfig", "PrecisionConfig", "ScheduleConfig", "TrainConfig",
    # lr_schedule
    "LRScheduler",
    # memory
    "MemoryEstimate", "estimate_memory", "estimate_memory_for",
    # metrics
    "IntervalMeter", "IntervalSummary", "IterationStats", "MetricsWriter", "Throughput", "format_log_line",
    "memory_mb",
]
