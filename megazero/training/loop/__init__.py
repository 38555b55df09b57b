"""The training loop's components; each decides when it acts, and :func:`megazero.training.trainer.pretrain`
runs them in order every iteration:

- :class:`Checkpointer`: where the run starts, and the saves (interval, exit, end, debug);
- :class:`Evaluator`: periodic and final evaluations;
- :class:`MetricsLogger`: the log line and the metrics records;
- :class:`StopPolicy`: when the run stops, and why;
- :class:`FailureProtocol`: failures inside an iteration, divergence.

They share a :class:`TrainState`; a caller hooks in with :class:`Callback`.
"""

from megazero.training.loop.checkpointer import Checkpointer
from megazero.training.loop.data import MockGPTDataset, build_datasets, loader
from megazero.training.loop.evaluator import Evaluator, evaluate
from megazero.training.loop.failure_protocol import FailureProtocol, TrainingDiverged
from megazero.training.loop.metrics_logger import MetricsLogger, describe_model
from megazero.training.loop.state import Callback, Callbacks, StepResult, TrainState
from megazero.training.loop.stop_policy import StopPolicy

__all__ = ["Checkpointer", "Evaluator", "MetricsLogger", "StopPolicy", "FailureProtocol", "TrainingDiverged",
           "TrainState", "StepResult", "Callback", "Callbacks", "MockGPTDataset", "build_datasets",
           "loader", "evaluate", "describe_model"]
