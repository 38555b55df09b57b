"""Stragglers: which ranks are slowest and fastest in each phase of the step (``--log-straggler``).

:class:`StragglerTimer` listens on the :class:`~.phases.PhaseBoard` and adds up this rank's time in
"data", "forward-backward" and "optimizer step", and the iteration's whole time (from entering "data"
to entering the next one, so an iteration counts in the interval where the next one begins). On the
CPU the spans are the board's clock readings; on a CUDA device the host clock only says when work was
dispatched, so each boundary records a ``torch.cuda.Event`` instead and the spans are resolved at the
log interval, after the metrics logger has synchronised the device (the few resolved earlier are
those already complete, asked without waiting, so the events held stay bounded).

At the log interval :class:`Stragglers` makes one flat all-gather over the default group of four
float32 per rank (the mean seconds per iteration of the three phases and of the whole iteration) into
a :class:`StragglerReport`: the only collective and host synchronisation it adds, and none in the
iterations that do not log; at 1,024 ranks it gathers 4 floats x 1,024 = 16 KiB. Rank 0 logs the slowest and fastest ranks per phase
and :class:`StragglerWarnings` warns of a rank slower than the median rank by ``--straggler-factor``
for :data:`STREAK` intervals in a row, naming its host (the hostnames are gathered once, at start).

What the figures can tell: a rank that computes slowly holds its peers inside the collectives they
share, so where the step's collectives sit inside forward-backward (ZeRO-3's parameter gathers,
tensor-parallel all-reduces) every rank's forward-backward time evens out to the slowest's. The data
read involves no collective and always tells which rank is slow; a slow rank's peers show it as a
longer "optimizer step" when they wait there for its gradients.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import statistics
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from megazero.mpu.utils import all_gather_flat
from megazero.training.health.phases import Whereabouts

__all__ = ["COLUMNS", "STREAK", "FLOOR_S", "StragglerTimer", "StragglerReport", "StragglerWarnings",
           "Stragglers"]

COLUMNS = ("data", "forward-backward", "optimizer step", "iteration")  # the gathered figures, in order
_PHASE_COLUMN = {phase: i for i, phase in enumerate(COLUMNS[:3])}
_ITERATION = 3
STREAK = 3  # log intervals in a row a rank must be slow before it is warned of
FLOOR_S = 1e-3  # below this a phase's times are noise: the median counts as at least this much
_MAX_PENDING = 64  # CUDA spans held before the completed ones are resolved early

Stamp = Union[float, "torch.cuda.Event"]


class StragglerTimer:
    """A board listener: this rank's seconds per phase since the last :meth:`take`.

    ``cuda``: time the device's stream with events (resolved in :meth:`take`, which must follow a
    device synchronisation to cost nothing) instead of the board's host clock.
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self._sums = [0.0] * len(COLUMNS)
        self._counts = [0] * len(COLUMNS)
        self._phase_start: Optional[Stamp] = None
        self._iteration_start: Optional[Stamp] = None
        self._pending: list[tuple[int, Stamp, Stamp]] = []  # CUDA spans not yet resolved: (column, start, end)

    def __call__(self, ended: Whereabouts, began: Whereabouts, now: float) -> None:
        stamp = self._stamp(now)
        column = _PHASE_COLUMN.get(ended.phase)
        if column is not None and self._phase_start is not None:
            self._add(column, self._phase_start, stamp)
        if began.phase == "data":
            if self._iteration_start is not None:
                self._add(_ITERATION, self._iteration_start, stamp)
            self._iteration_start = stamp
        self._phase_start = stamp

    def take(self) -> list[float]:
        """The mean seconds per occurrence of each of :data:`COLUMNS` since the last call (NaN where
        none ended), and start over."""
        self._resolve(wait=True)
        means = [s / n if n else math.nan for s, n in zip(self._sums, self._counts)]
        self._sums = [0.0] * len(COLUMNS)
        self._counts = [0] * len(COLUMNS)
        return means

    def held(self) -> int:
        """CUDA spans waiting to be resolved (bounded by how far the host runs ahead of the device)."""
        return len(self._pending)

    def _stamp(self, now: float) -> Stamp:
        if not self.cuda:
            return now
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, column: int, start: Stamp, end: Stamp) -> None:
        if not self.cuda:
            self._sums[column] += end - start
            self._counts[column] += 1
            return
        self._pending.append((column, start, end))
        if len(self._pending) > _MAX_PENDING:
            self._resolve(wait=False)  # event queries do not wait for the device

    def _resolve(self, wait: bool) -> None:
        done = 0
        for column, start, end in self._pending:
            if wait:
                start.synchronize()  # after the logger's device synchronisation these return at once
                end.synchronize()
            elif not (start.query() and end.query()):
                break
            self._sums[column] += start.elapsed_time(end) / 1000.0
            self._counts[column] += 1
            done += 1
        del self._pending[:done]  # dropped: only the board's current phase and iteration keep events


def _seconds(t: float) -> str:
    return f"{t:.3f} s" if t >= 1e-3 else f"{t * 1e3:.3f} ms"


def _key(column: str) -> str:
    return column.replace("-", "_").replace(" ", "_")


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """Every rank's mean seconds per column (``times[rank][column]``, NaN where the rank timed none)."""

    times: list[list[float]]

    def ranked(self, column: int) -> list[tuple[float, int]]:
        """``(seconds, rank)`` of the ranks that timed ``column``, fastest first (ties by rank)."""
        return sorted((row[column], rank) for rank, row in enumerate(self.times) if not math.isnan(row[column]))

    def median(self, column: int) -> float:
        """The median rank's time (the lower middle one, so it is a rank's): NaN if none timed it."""
        values = [t for t, _ in self.ranked(column)]
        return statistics.median_low(values) if values else math.nan

    def line(self, count: int = 1) -> str:
        """``straggler: data min 0.012 s (rank 3) max 0.512 s (rank 2) | forward-backward ...``: the
        ``count`` fastest and slowest ranks of each column some rank timed."""
        parts = []
        for c, name in enumerate(COLUMNS):
            ranked = self.ranked(c)
            if not ranked:
                continue
            fastest = ", ".join(f"{_seconds(t)} (rank {r})" for t, r in ranked[:count])
            slowest = ", ".join(f"{_seconds(t)} (rank {r})" for t, r in reversed(ranked[-count:]))
            parts.append(f"{name} min {fastest} max {slowest}")
        return "straggler: " + (" | ".join(parts) if parts else "no phase timed in this interval")

    def record(self) -> dict[str, float]:
        """``straggler_{min,max}_{column}_{s,rank}`` and ``straggler_median_{column}_s`` for the metrics record."""
        rec: dict[str, float] = {}
        for c, name in enumerate(COLUMNS):
            ranked = self.ranked(c)
            if not ranked:
                continue
            key = _key(name)
            (t_min, r_min), (t_max, r_max) = ranked[0], ranked[-1]
            rec.update({f"straggler_min_{key}_s": t_min, f"straggler_min_{key}_rank": r_min,
                        f"straggler_max_{key}_s": t_max, f"straggler_max_{key}_rank": r_max,
                        f"straggler_median_{key}_s": self.median(c)})
        return rec


class StragglerWarnings:
    """Counts, per rank and phase, the log intervals in a row the rank took more than ``factor``
    times the median rank's time, the median taken as at least ``floor_s`` (so 0.3 ms against 0.1 ms
    is noise, 300 ms against 0.5 ms is not); warns at :data:`STREAK` in a row and every
    :data:`STREAK` more."""

    def __init__(self, factor: float, hosts: Optional[list[str]] = None, floor_s: float = FLOOR_S) -> None:
        if not factor > 1:
            raise ValueError(f"the straggler factor must be > 1 (a slowdown against the median rank), got {factor}")
        self.factor, self.hosts, self.floor_s = factor, hosts, floor_s
        self.streaks: dict[tuple[int, int], int] = {}  # (rank, column) -> slow intervals in a row

    def update(self, report: StragglerReport) -> list[str]:
        """Count ``report``'s slow ranks; the warnings due now."""
        warnings, streaks = [], {}
        for c, name in enumerate(COLUMNS[:3]):  # the iteration's total evens out over the step's collectives
            median = report.median(c)
            if math.isnan(median):
                continue
            for t, rank in report.ranked(c):
                if t <= self.factor * max(median, self.floor_s):
                    continue
                n = streaks[rank, c] = self.streaks.get((rank, c), 0) + 1
                if n % STREAK == 0:
                    warnings.append(self._warning(rank, name, t, median, n))
        self.streaks = streaks  # a rank back under the factor starts again from zero
        return warnings

    def _warning(self, rank: int, phase: str, t: float, median: float, n: int) -> str:
        host = f" ({self.hosts[rank]})" if self.hosts and rank < len(self.hosts) else ""
        return (f"straggler: rank {rank} is {t / median:.1f}x slower than the median rank in {phase} "
                f"({_seconds(t)} against {_seconds(median)}) for {n} log intervals in a row; check its "
                f"host{host}")


class Stragglers:
    """``--log-straggler`` for one run: the timer on the board, and at each log interval the gather,
    the line and the warnings. Collective: every rank constructs it, and calls :meth:`report` at the
    same iterations."""

    def __init__(self, device: torch.device, factor: float, count: int = 1,
                 log: Optional[Callable[[str], None]] = None, warn: Optional[Callable[[str], None]] = None) -> None:
        self.count, self.log, self.warn = count, log, warn
        self.timer = StragglerTimer(cuda=device.type == "cuda")
        # NCCL gathers device tensors; gloo (and the CPU) host ones.
        self.device = device if device.type == "cuda" and dist.get_backend() != "gloo" else torch.device("cpu")
        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())  # once: the warnings name the slow rank's host
        self.warnings = StragglerWarnings(factor, hosts)

    def gather(self) -> StragglerReport:
        """Every rank's means since the last call (one all-gather of 4 floats per rank)."""
        mine = torch.tensor(self.timer.take(), dtype=torch.float32, device=self.device)
        out = torch.empty(dist.get_world_size() * len(COLUMNS), dtype=torch.float32, device=self.device)
        all_gather_flat(out, mine)
        return StragglerReport(out.view(-1, len(COLUMNS)).tolist())

    def report(self) -> dict[str, float]:
        """Gather, log the line and any warnings; the figures for the metrics record."""
        report = self.gather()
        if self.log is not None:
            self.log(report.line(self.count))
        for warning in self.warnings.update(report):
            if self.warn is not None:
                self.warn(warning)
        return report.record()
