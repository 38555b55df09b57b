"""One training loop for every layout, made of components.

``trainer.pretrain`` orders the components of :mod:`megazero.training.loop` (checkpointer, evaluator,
metrics logger, stop policy, failure protocol) around ``step.TrainModel``, this rank's model under one
ZeRO engine; ``health`` watches for hangs and stragglers; ``meters`` measures and writes what the log
shows; ``lr_schedule`` is Megatron's learning-rate schedule. The configuration it runs from is
:mod:`megazero.config`'s; checkpoint formats are :mod:`megazero.checkpoint`'s; the planner and the
rehearsal measure this layer from above (:mod:`megazero.observe`).
"""

from megazero.training.lr_schedule import LRScheduler
from megazero.training.meters import (
    IntervalMeter,
    IntervalSummary,
    IterationStats,
    MetricsWriter,
    Throughput,
    format_log_line,
    memory_mb,
)

__all__ = ["IntervalMeter", "IntervalSummary", "IterationStats", "LRScheduler", "MetricsWriter", "Throughput",
           "format_log_line", "memory_mb"]
