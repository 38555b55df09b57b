"""Planning a launch (tools/estimate_memory.py, tools/rehearse.py) from pretrain_gpt.py's own flags.

A plan needs the shape, the layout, the batch and the precision, not what only a training run
needs: the learning rate, the run's length, the data and the tokenizer. :func:`fill_for_planning`
gives those, when absent, values that change no planned figure, so that the rest of the command
line is validated exactly as ``pretrain_gpt.py`` validates it (``parse_args(..., planning=True)``).
"""

from __future__ import annotations

import argparse

__all__ = ["fill_for_planning", "PLANNING_NOTE"]

# The first words of the note parse_args keeps when it filled something (describe() reads it).
PLANNING_NOTE = "planning without"
_PLACEHOLDER_LR = 1e-4  # any positive value: the learning rate changes no byte of a plan
_ITERATION_FLAGS = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")
_SAMPLE_FLAGS = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")


def fill_for_planning(ns: argparse.Namespace) -> list[str]:
    """Fill the training-only flags ``ns`` lacks (after the DeepSpeed JSON was merged); returns one
    note saying what was filled (none when nothing was). The run's length follows the unit of the LR
    flags given (iterations unless samples), long enough for every LR phase given; no data flag at
    all means synthetic tokens (--mock-data); no --micro-batch-size means 1, which the note says."""
    filled = []
    if ns.lr is None:
        ns.lr = _PLACEHOLDER_LR
        filled.append("--lr")
    if ns.train_iters is None and ns.train_samples is None:
        if any(getattr(ns, f, None) is not None for f in _SAMPLE_FLAGS):
            ns.train_samples = 2 ** 40 + sum(getattr(ns, f) or 0 for f in _SAMPLE_FLAGS)  # beyond any global batch
            filled.append("--train-samples")
        else:
            ns.train_iters = 1 + sum(getattr(ns, f) or 0 for f in _ITERATION_FLAGS)
            filled.append("--train-iters")
    data_given = ns.data_path or ns.train_data_path or ns.valid_data_path or ns.test_data_path
    if not data_given and not ns.mock_data:
        # synthetic tokens; a split or cache directory of no data set says nothing to a plan
        ns.mock_data, ns.split, ns.data_cache_path = True, None, None
        filled.append("--data-path (synthetic tokens)")
    notes = [f"{PLANNING_NOTE} {', '.join(filled)}: placeholders (no planned figure depends on them)"] \
        if filled else []
    if ns.micro_batch_size is None:
        ns.micro_batch_size = 1
        notes.append("--micro-batch-size not given: planned at 1")
    return notes
