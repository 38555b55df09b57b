"""The configuration surface: the command line and a DeepSpeed JSON become one typed ``TrainConfig``.

Every Megatron-LM flag is honoured, mapped or refused here (``flags.py`` and its row tables), DeepSpeed
keys are classified in ``ds_keys.py``, and ``resolve/`` turns the parsed namespace into the typed
sections (model, parallel layout, optimizer, precision, schedule, data, logging, resume). Training, the
programs and the planner import this package; it imports the layers below it (model, zero, data,
checkpoint) only to read their configuration types and what a checkpoint says about itself.
"""

from megazero.config.arguments import build_parser, check_vocab, describe, parse_args, parse_args_or_exit
from megazero.config.train_config import (
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

__all__ = [
    "build_parser", "check_vocab", "describe", "parse_args", "parse_args_or_exit",
    "CheckpointConfig", "ConfigError", "DataConfig", "GenerateConfig", "LoggingConfig", "OptimConfig",
    "ParallelConfig", "PrecisionConfig", "ScheduleConfig", "TrainConfig",
]
