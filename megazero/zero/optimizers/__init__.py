"""Optimizer components: each optimizer the engine runs is one file here and one line below.

``base.py`` says what a component declares (names, ``optimizer.params`` keys, flags and settings, state
tensors and their bytes, its update: an elementwise kernel and, for parameters it needs whole, a
per-matrix step) and keeps the registry; the engine, the checkpoints, the flags and the planner ask
the component (:func:`component`) instead of naming optimizers.
"""

from .base import (MatrixStep, Optimizer, OptimizerConfig, ZeroConfigError, cli_names, component, parse_optimizer,
                   register, registered)
# The registrations, in the order --optimizer and the docs list them.
from . import adam, sgd, muon, lion  # noqa: E402,F401
from .muon import MuonConfig  # noqa: E402

__all__ = ["ZeroConfigError", "MuonConfig", "OptimizerConfig", "Optimizer", "MatrixStep", "component", "registered",
           "cli_names", "register", "parse_optimizer"]
