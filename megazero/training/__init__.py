"""Training product pieces: typed run config from the command line, LR schedule and
metrics/logging. The loop itself builds on these. The memory planner and the rehearsal measure
this layer from above: :mod:`megazero.observe`."""

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
    # metrics
    "IntervalMeter", "IntervalSummary", "IterationStats", "MetricsWriter", "Throughput", "format_log_line",
    "memory_mb",
]
