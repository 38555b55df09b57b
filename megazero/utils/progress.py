"""Progress of a long loop: a tqdm bar on a terminal, periodic ``logging`` lines otherwise.

    with Progress("converted", total=len(layers), unit="layers", logger=log) as progress:
        for layer in layers:
            convert(layer)
            progress.update()

On a terminal (stderr is a TTY) the bar is tqdm's. Elsewhere (a log file, a batch job, a
test) one INFO line goes to ``logger`` every ``interval`` seconds, e.g. ``converted 12/40
layers (30%), 41 s elapsed, ~95 s left``, and a last one when the loop ends, if any line
was written before: a loop that finishes within the interval prints nothing.

``interval`` defaults to ``$MEGAZERO_PROGRESS_INTERVAL`` seconds (10 unless set; 0 writes
a line at every update).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

__all__ = ["Progress", "default_interval"]

DEFAULT_INTERVAL_S = 10.0


def default_interval() -> float:
    try:
        return float(os.environ.get("MEGAZERO_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _count(n: float) -> str:
    return f"{n:,}" if isinstance(n, int) else f"{n:,.1f}"


class Progress:
    """Counts work done (``update``) and reports it; see the module docstring.

    ``what`` is the past participle of the work ("converted"), ``unit`` what is counted
    ("layers"); ``total`` None means the amount is not known in advance (no percentage, no
    time left). ``enabled=False`` counts silently (e.g. on every rank but the first).
    ``tty`` overrides the terminal test (None: ``sys.stderr.isatty()``).
    """

    def __init__(self, what: str, total: Optional[int] = None, *, unit: str = "", logger: Optional[logging.Logger] = None,
                 interval: Optional[float] = None, enabled: bool = True, tty: Optional[bool] = None) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.postfix = ""
        self.enabled = enabled
        self.interval = default_interval() if interval is None else interval
        self._log = logger or logging.getLogger("megazero.progress")
        self._start = self._last = time.monotonic()
        self._lines = 0
        self._shown = -1  # the count the last line showed
        self._closed = False
        self._bar = None
        if enabled and (_stderr_is_tty() if tty is None else tty):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=f" {unit}" if unit else "it", mininterval=0.5,
                             file=sys.stderr)

    def update(self, n: int = 1, postfix: Optional[str] = None) -> None:
        """``n`` more units done; ``postfix`` (e.g. a rate) replaces the text shown after the counts."""
        self.done += n
        if postfix is not None:
            self.postfix = postfix
        if not self.enabled or self._closed:
            return
        if self._bar is not None:
            self._bar.update(n)
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._emit(now)

    def line(self, now: Optional[float] = None) -> str:
        """The progress line at ``now`` (default: the current time)."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            text = f"{self.what} {_count(self.done)}/{_count(self.total)}{unit} ({100 * self.done / self.total:.0f}%)"
        else:
            text = f"{self.what} {_count(self.done)}{unit}"
        text += f", {elapsed:.0f} s elapsed"
        if self.total and 0 < self.done < self.total:
            text += f", ~{elapsed * (self.total - self.done) / self.done:.0f} s left"
        return text + (f", {self.postfix}" if self.postfix else "")

    def close(self, completed: bool = True) -> None:
        """End the report: the bar closes; the last line is written if the loop completed, any line
        was written before and the last one did not already show the final count."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and completed and self._lines and self._shown != self.done:
            self._emit(time.monotonic())

    def _emit(self, now: float) -> None:
        self._last = now
        self._lines += 1
        self._shown = self.done
        self._log.info(self.line(now))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(completed=exc_type is None)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False
