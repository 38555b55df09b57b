"""Where this rank is in the run: the iteration and the phase, as the loop enters them.

The loop marks each phase boundary (:meth:`PhaseBoard.enter`) and the step's schedule each finished
forward and backward (:meth:`PhaseBoard.lap`, the pipeline's ``lap`` callback). A mark is a clock read
and one attribute write: no torch call, no communication, no host synchronisation. Its readers are
the watchdog's heartbeat thread (which phase a hung rank is in, and since when it made no progress)
and the straggler timer (how long each phase took), through ``listeners``.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

__all__ = ["PHASES", "Whereabouts", "PhaseBoard"]

# In the order an iteration passes them (the watchdog ranks progress by it; "start-up" before the first).
PHASES = ("start-up", "checkpoint load", "data", "forward-backward", "optimizer step", "logging", "evaluation",
          "checkpoint save", "end")


class Whereabouts(NamedTuple):
    """One consistent record of where the rank is (replaced whole, so a reading thread never sees half;
    a tuple, as it is made twice per micro-batch)."""

    iteration: int  # the iteration being run (0 before the first)
    phase: str
    forwards: int = 0  # forward and backward passes of this iteration's micro-batches done
    backwards: int = 0
    passes: int = 0  # forward (and backward) passes the iteration runs on this rank: micro-batches x chunks
    steps: int = 0  # steps done inside the phase (:meth:`PhaseBoard.advance`), the last one named by ``detail``
    detail: str = ""
    started: float = 0.0  # time.monotonic() when the phase began
    progressed: float = 0.0  # ... when the rank last made progress (a phase or a pass)

    def describe(self) -> str:
        """``iteration 5, forward-backward (2 of 4 forwards, 1 of 4 backwards done)``."""
        where = f"iteration {self.iteration}, {self.phase}" if self.iteration else self.phase
        if self.phase == "forward-backward" and self.passes:
            where += f" ({self.forwards} of {self.passes} forwards, {self.backwards} of {self.passes} backwards done)"
        if self.detail:
            where += f" ({self.detail})"
        return where

    def rank_key(self) -> tuple[int, int, int]:
        """Orders ranks by how far they got: the one furthest behind is the least."""
        order = PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)
        return self.iteration, order, self.forwards + self.backwards + self.steps


# listener(ended, began, now): ``ended`` is the phase that just ended, ``began`` the one that begins.
Listener = Callable[[Whereabouts, Whereabouts, float], None]


class PhaseBoard:
    """This rank's :class:`Whereabouts`, updated by the loop; ``listeners`` hear every phase change."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self.now: Whereabouts = Whereabouts(0, "start-up", started=now, progressed=now)
        self.listeners: list[Listener] = []

    def enter(self, phase: str, iteration: Optional[int] = None, passes: int = 0) -> None:
        """Begin ``phase`` (of ``iteration``, default the current one); ``passes`` for forward-backward."""
        old, t = self.now, self._clock()
        self.now = Whereabouts(old.iteration if iteration is None else iteration, phase, passes=passes,
                               started=t, progressed=t)
        for listener in self.listeners:
            listener(old, self.now, t)

    def advance(self, detail: str) -> None:
        """A step inside the current phase is done (``detail`` names it: "files written")."""
        w = self.now
        self.now = Whereabouts(w.iteration, w.phase, w.forwards, w.backwards, w.passes, w.steps + 1, detail,
                               w.started, self._clock())

    def lap(self, event: str) -> None:
        """The schedule finished a forward ("fwd") or backward ("bwd") pass, or the optimizer step ("step");
        after the iteration's last backward the optimizer step begins."""
        w = self.now
        if event == "fwd":
            self.now = Whereabouts(w.iteration, w.phase, w.forwards + 1, w.backwards, w.passes, w.steps, w.detail,
                                   w.started, self._clock())
        elif event == "bwd":
            self.now = Whereabouts(w.iteration, w.phase, w.forwards, w.backwards + 1, w.passes, w.steps, w.detail,
                                   w.started, self._clock())
            if w.passes and w.backwards + 1 >= w.passes:
                self.enter("optimizer step")
        elif event == "step":
            self.enter("logging")

    def lap_with(self, other: Optional[Callable[[str], None]]) -> Callable[[str], None]:
        """The schedule's ``lap`` callback: this board's, then ``other``'s (the wall-clock timers) if any."""
        if other is None:
            return self.lap

        def both(event: str) -> None:
            self.lap(event)
            other(event)
        return both
