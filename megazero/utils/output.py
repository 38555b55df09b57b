"""Where a training run's log records go: rank 0's lines, and the console of ``pretrain_gpt.py``.

Modules log through ``logging.getLogger(__name__)``; what a run reports once
for the job (the log line, saves, evaluations) comes from rank 0 only (:func:`rank_zero_logger`).
A program shows the records with :func:`console`: INFO on stdout and WARNING and up on stderr, one
plain line each, as the lines were printed. A library caller configures logging as it likes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Iterator

import torch.distributed as dist

__all__ = ["RUN_LOGGERS", "RankZero", "rank_zero_logger", "ConsoleHandler", "console", "write_error_file"]

# The packages whose records a training run shows: the loop, the configuration, the checkpoint formats,
# and the failure agreement's one-line reports.
RUN_LOGGERS = ("megazero.training", "megazero.config", "megazero.checkpoint", "megazero.utils.phase_agreement")


class RankZero(logging.Filter):
    """Passes records on global rank 0 only (on every process while torch.distributed is not started)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0


def rank_zero_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` whose records only rank 0 emits."""
    log = logging.getLogger(name)
    if not any(isinstance(f, RankZero) for f in log.filters):
        log.addFilter(RankZero())
    return log


class ConsoleHandler(logging.StreamHandler):
    """``%(message)s`` to whatever ``sys.stdout`` (below WARNING) or ``sys.stderr`` (WARNING and up)
    is when the record is emitted, so redirections and captures see it; flushed per record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self._to_stderr = False

    @property
    def stream(self):
        return sys.stderr if self._to_stderr else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass

    def emit(self, record: logging.LogRecord) -> None:
        self._to_stderr = record.levelno >= logging.WARNING  # under the handler's lock (Handler.handle)
        super().emit(record)


@contextlib.contextmanager
def console(*names: str, level: int = logging.INFO) -> Iterator[None]:
    """While inside, the named loggers' records at ``level`` and up go to the console through one
    :class:`ConsoleHandler` each (added once: a logger that has one keeps it), and only there: they
    do not propagate, so a handler of an ancestor (``megazero``'s, the root's) does not repeat them.
    On exit every logger is as it was."""
    saved = []
    for name in names:
        log = logging.getLogger(name)
        if any(isinstance(h, ConsoleHandler) for h in log.handlers):
            continue
        handler = ConsoleHandler()
        saved.append((log, handler, log.level, log.propagate))
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False
    try:
        yield
    finally:
        for log, handler, old_level, old_propagate in saved:
            log.removeHandler(handler)
            log.setLevel(old_level)
            log.propagate = old_propagate


def write_error_file(line: str) -> None:
    """Leave ``line`` where the launcher reports a failed worker from: torchrun's error-file protocol
    (``torch.distributed.elastic.multiprocessing.errors``), the JSON file named by
    ``$TORCHELASTIC_ERROR_FILE``. torchrun's closing summary then shows ``line`` as its root cause's
    ``traceback`` (instead of a pointer to ``@record``), the last text on the screen. No-op outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # the launcher never reads half a file
    except OSError:
        pass  # the message was logged; the summary then points at @record, as without this file
