"""A rank that hangs ends the run in minutes, with the ranks that did not arrive named.

A rank that dies is seen by the launcher; one that hangs (a deadlock, a stuck filesystem read, a
stopped process or device) is alive, and its peers wait inside a collective. So every rank runs a
:class:`Watchdog` thread beside the loop:

* **Heartbeat.** Every ``beat_s`` seconds, and within 2 s of a change, it writes this rank's
  :class:`~.phases.Whereabouts` (its iteration and phase, and how long since it last made progress),
  its host and pid, to one key of the job's rendezvous store. Nothing touches the training path: no collective, no host
  synchronisation, no device work; the loop's phase marks are attribute writes.
* **Deadline.** When this rank has made no progress for ``timeout_s`` (``--distributed-timeout-minutes``,
  also every process group's collective timeout) inside the loop (from the first data read to the last
  evaluation), or a collective raised its timeout anywhere in the run, the first rank
  to notice (an atomic ``add`` on the store elects it) reads every rank's heartbeat once and names
  the ranks that did not arrive: those whose heartbeat stopped (a stopped or frozen process), else
  those furthest behind (:func:`diagnose`). A named rank that is still alive sends its main thread's
  stack. The elected rank logs the stacks, then the verdict; every rank leaves the verdict in
  torchrun's error file and exits with status 1, without waiting for the collective it is stuck in.
  A checkpoint being written is left without ``latest`` (that marker moves only after every rank
  agreed the write succeeded). torchrun kills a stopped process 30 s after the first exit.

Cost at 1,024 ranks: per iteration nothing on the training path (the thread sends); the store
receives one ``set`` of about 250 bytes per rank every 2 s while ranks progress (every 10 s when
idle): about 500 small writes a second and 130 KB/s on the store's host; when a hang is declared,
one ``multi_get`` of every heartbeat (about 250 KB) by one rank.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Optional

import torch.distributed as dist

from megazero.training.health.phases import PhaseBoard, Whereabouts
from megazero.utils.output import write_error_file

__all__ = ["Watchdog", "Verdict", "diagnose", "is_collective_timeout", "check_timeout_covers_save",
           "warn_if_save_near_timeout", "rank_list"]

log = logging.getLogger(__name__)

PREFIX = "megazero/health/"
# Phases outside the loop, where the deadline is not armed: a slow start-up on every rank is not a hang,
# and a rank that does hang there leaves its peers in a collective that times out (the same verdict follows).
UNARMED = ("start-up", "checkpoint load", "end")
REPORT_WAIT_S = 20.0  # how long a rank that was not elected waits for the verdict before its own line
STACK_WAIT_S = 3.0  # how long the elected rank waits for the named ranks' stacks
STORE_TIMEOUT_S = 10.0  # how long one of the watchdog's store operations may take
PEER_ERROR_WAIT_S = 10.0  # how long a peer's closed connection waits for a verdict before it is an error
# A conservative write rate for the start-up check (a parallel filesystem gives a node more, a laptop less).
ASSUMED_SAVE_GB_PER_S_PER_NODE = 2.0


def rank_list(ranks: list[int], limit: int = 16) -> str:
    """``rank 2`` / ``ranks [2, 5]`` / ``ranks [0-511, 513-1023]`` (runs folded, long lists cut)."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if j - i < 2 else f"{ranks[i]}-{ranks[j]}")
        if j - i == 1:
            runs.append(str(ranks[j]))
        i = j + 1
    shown = runs if len(runs) <= limit else runs[:limit] + [f"... ({len(ranks)} ranks)"]
    return f"ranks [{', '.join(shown)}]"


class Verdict:
    """Who did not arrive, and where everybody is: ``lines`` to log, ``line`` for the error file."""

    def __init__(self, missing: list[int], lines: list[str], line: str) -> None:
        self.missing, self.lines, self.line = missing, lines, line

    def to_json(self) -> str:
        return json.dumps({"missing": self.missing, "lines": self.lines, "line": self.line})

    @classmethod
    def from_json(cls, text: str) -> "Verdict":
        d = json.loads(text)
        return cls(d["missing"], d["lines"], d["line"])


_BEAT_FIELDS = ("iteration", "phase", "forwards", "backwards", "passes", "steps", "detail")


def _where(beat: dict) -> Whereabouts:
    return Whereabouts(**{k: beat[k] for k in _BEAT_FIELDS if k in beat})


def diagnose(beats: dict[int, Optional[dict]], now: float, stale_s: float, timeout_s: float) -> Verdict:
    """The ranks that did not arrive, from every rank's last heartbeat (None: it never wrote one).

    A rank whose heartbeat is older than ``stale_s`` (``now`` and the beats' ``time`` are wall-clock
    seconds) is stopped or frozen; so is one that never beat. Without such a rank, the ranks furthest
    behind (iteration, then phase, then passes: :meth:`Whereabouts.rank_key`) did not arrive; when every
    rank is as far as the others, none is named and the verdict says the hang is inside that phase.
    """
    silent = sorted(r for r, b in beats.items() if b is None or now - b["time"] > stale_s)
    live = {r: b for r, b in beats.items() if r not in silent}
    keys = {r: _where(b).rank_key() for r, b in live.items()}
    behind: list[int] = []
    if not silent and keys and min(keys.values()) < max(keys.values()):
        low = min(keys.values())
        behind = sorted(r for r, k in keys.items() if k == low)
    missing = silent or behind
    lines = []
    for r in missing:
        b = beats[r]
        if b is None:
            lines.append(f"rank {r} did not arrive: it never sent a heartbeat (it hung before the loop's watchdog "
                         f"started)")
            continue
        why = (f"no heartbeat for {now - b['time']:.0f} s (a stopped or frozen process)" if r in silent
               else f"no progress for {b['idle'] + max(0.0, now - b['time']):.0f} s")
        last = "last heard of in" if r in silent else "in"
        lines.append(f"rank {r} (host {b['host']}, pid {b['pid']}) did not arrive: {why}; {last} "
                     f"{_where(b).describe()}")
    groups: dict[str, list[int]] = {}
    for r, b in sorted(live.items()):
        if r not in missing:
            groups.setdefault(_where(b).describe(), []).append(r)
    by_size = sorted(groups.items(), key=lambda item: -len(item[1]))
    waited = [f"{rank_list(rs)} waited in {where}" for where, rs in by_size]
    lines += waited
    if not missing:
        where = next(iter(groups), "an unknown phase")
        lines.append(f"no rank is behind the others: every rank waits in {where}; the hang is inside that "
                     f"phase (a collective the ranks entered in different orders, or a device that stopped)")
    minutes = timeout_s / 60
    head = f"hang: no progress for {timeout_s:.0f} s (--distributed-timeout-minutes {minutes:g})"
    if missing:
        first = beats[missing[0]]
        if first is None:
            where = " (no heartbeat ever)"
        elif missing[0] in silent:
            where = (f" (no heartbeat for {now - first['time']:.0f} s: stopped or frozen); last heard of in "
                     f"{_where(first).describe()}")
        else:
            where = f"; in {_where(first).describe()}"
        host = f" (host {first['host']})" if first is not None and len(missing) == 1 else ""
        summary = f"{head}: {rank_list(missing)}{host} did not arrive{where}"
    else:
        summary = f"{head}: no rank is behind; every rank waits in {next(iter(groups), 'an unknown phase')}"
    if waited:
        summary += "".join(f"; {w}" for w in waited[:3]) + (f"; {len(waited) - 3} more groups waited elsewhere"
                                                             if len(waited) > 3 else "")
    return Verdict(missing, lines, summary)


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective (or store) giving up after its timeout: gloo's "Timed out
    waiting ...", NCCL's and the store's timeout errors."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("Timed out" in text or "timed out" in text or "Timeout" in text)


class Watchdog:
    """This rank's heartbeat and hang deadline (module docstring); a context manager around the run.

    ``store``: the job's rendezvous store (None: the default group's). ``exit``: how the process
    ends once the verdict is out (``os._exit``: the main thread may be stuck in a collective).
    """

    def __init__(self, board: PhaseBoard, timeout_s: float, *, rank: int, world: int, store=None,
                 beat_s: Optional[float] = None, poll_s: float = 1.0, prog: str = "pretrain_gpt.py",
                 exit: Callable[[int], None] = os._exit) -> None:
        self.board, self.timeout_s, self.rank, self.world = board, timeout_s, rank, world
        self.store = dist.PrefixStore(PREFIX, _own_connection(store)) if store is not None else None
        self.beat_s = beat_s if beat_s is not None else min(10.0, max(1.0, timeout_s / 6))
        self.change_beat_s = min(2.0, self.beat_s)  # a changed whereabouts is sent this soon (at most)
        self.stale_s = 3 * self.beat_s
        self.poll_s, self.prog, self._exit = min(poll_s, self.beat_s), prog, exit
        self.peer_error_wait_s = PEER_ERROR_WAIT_S
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._declared = threading.Lock()
        self._last_beat = -math.inf
        self._beaten: Optional[Whereabouts] = None  # the whereabouts the last heartbeat sent
        self._thread = threading.Thread(target=self._run, name="megazero-watchdog", daemon=True)

    @classmethod
    def for_run(cls, config, board: PhaseBoard) -> "Watchdog | _Off":
        """The run's watchdog over the default group (off for one process or a rehearsal's fake group)."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or "fake" in str(dist.get_backend()):
            return _Off()
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError):  # a group started on a custom store: deadline without the table
            store = None
        return cls(board, config.parallel.distributed_timeout_minutes * 60, rank=dist.get_rank(),
                   world=dist.get_world_size(), store=store)

    # -- the thread

    def __enter__(self) -> "Watchdog":
        self._beat(time.monotonic())
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if exc is not None and isinstance(exc, Exception) and self._is_the_hang(exc):
            message = str(exc).splitlines()[0]
            message = message.split("] ", 1)[-1] if message.startswith("[") else message  # gloo's source path
            what = "timed out" if is_collective_timeout(exc) else "failed"
            self.declare(f"a collective {what} on rank {self.rank}: {message[:200]}")
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            idle = now - self.board.now.progressed
            since = now - self._last_beat
            if since >= self.beat_s or (since >= self.change_beat_s and self.board.now is not self._beaten):
                self._beat(now)
                if idle > self.timeout_s / 2 and self._verdict_out():  # another rank declared the hang
                    self.declare("")
            if idle >= self.timeout_s and self.board.now.phase not in UNARMED and not self._stop.is_set():
                self.declare(f"rank {self.rank} made no progress for {idle:.0f} s")

    def _beat(self, now: float) -> None:
        self._last_beat, self._beaten = now, self.board.now
        if self.store is None:
            return
        try:
            self.store.set(f"beat/{self.rank}", json.dumps(self._own_beat(now)))
        except Exception:  # noqa: BLE001 - a store that went away: the deadline still holds
            pass

    def _is_the_hang(self, error: Exception) -> bool:
        """Whether ``error`` from the main thread is the hang: a collective that timed out, or any error
        once a verdict is out. A peer's timed-out collective closes its connections before its verdict is
        written, so after "Connection closed by peer" the verdict is awaited for a few seconds."""
        if is_collective_timeout(error):
            return True
        text = str(error)
        wait = self.peer_error_wait_s if "Connection closed" in text or "Connection reset" in text else 0.0
        deadline = time.monotonic() + wait
        while not self._verdict_out():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        return True

    def _verdict_out(self) -> bool:
        if self.store is None:
            return False
        try:
            return bool(self.store.check(["verdict"]))
        except Exception:  # noqa: BLE001
            return False

    # -- declaring the hang

    def declare(self, cause: str) -> None:
        """End the run for a hang (once per process, from either thread): elect the rank that speaks,
        agree on the verdict through the store, leave it in the error file and exit with status 1."""
        if not self._declared.acquire(blocking=False):
            if threading.get_ident() != self._thread.ident:
                time.sleep(REPORT_WAIT_S + STACK_WAIT_S + 5)  # the watchdog thread is ending the process
            return
        try:
            verdict = self._agree_verdict(cause)
            write_error_file(f"{self.prog}: {verdict.line}")
        finally:
            for handler in logging.getLogger().handlers + log.handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            self._exit(1)

    def _agree_verdict(self, cause: str) -> Verdict:
        if self.store is None:
            return self._alone(cause, "without the rendezvous store the ranks that did not arrive are not known")
        try:
            if self.store.add("speaker", 1) == 1:
                return self._speak(cause)
            return self._listen(cause)
        except Exception as e:  # noqa: BLE001 - the store is gone or frozen: this rank's own view
            return self._alone(cause, f"the rendezvous store did not answer ({type(e).__name__}), so the ranks "
                                      f"that did not arrive are not known")

    def _alone(self, cause: str, why: str) -> Verdict:
        """The verdict of this rank alone (no table of heartbeats to read)."""
        line = (f"hang: {cause or 'no progress'} (--distributed-timeout-minutes {self.timeout_s / 60:g}); this rank is "
                f"in {self.board.now.describe()}; {why}")
        log.error(f"{self.prog}: {line}")
        return Verdict([], [line], line)

    def _speak(self, cause: str) -> Verdict:
        keys = [f"beat/{r}" for r in range(self.world)]
        present = [r for r in range(self.world) if self.store.check([keys[r]])] \
            if not self.store.check(keys) else list(range(self.world))
        values = self.store.multi_get([keys[r] for r in present]) if present else []
        beats: dict[int, Optional[dict]] = {r: None for r in range(self.world)}
        beats.update({r: json.loads(v) for r, v in zip(present, values)})
        beats[self.rank] = {**(beats[self.rank] or {}), **self._own_beat()}
        verdict = diagnose(beats, time.time(), self.stale_s, self.timeout_s)
        self.store.set("verdict", verdict.to_json())
        stacks = {}
        if self.rank in verdict.missing:
            stacks[self.rank] = self._main_stack()
        others = [r for r in verdict.missing if r != self.rank and beats[r] is not None
                  and time.time() - beats[r]["time"] <= self.stale_s]
        if others:
            try:
                self.store.wait([f"stack/{r}" for r in others], datetime.timedelta(seconds=STACK_WAIT_S))
            except Exception:  # noqa: BLE001 - a rank that did not answer: its stack is not shown
                pass
            for r in others:
                if self.store.check([f"stack/{r}"]):
                    stacks[r] = self.store.get(f"stack/{r}").decode()
        for r, stack in sorted(stacks.items()):
            log.error(f"{self.prog}: rank {r}'s main thread, where it stopped making progress:\n{stack.rstrip()}")
        if cause:
            log.error(f"{self.prog}: {cause}")
        for line in verdict.lines:
            log.error(f"{self.prog}: {line}")
        log.error(f"{self.prog}: {verdict.line}")
        self.store.set("spoken", "1")
        return verdict

    def _listen(self, cause: str) -> Verdict:
        try:
            self.store.wait(["verdict"], datetime.timedelta(seconds=REPORT_WAIT_S))
            verdict = Verdict.from_json(self.store.get("verdict").decode())
        except Exception:  # noqa: BLE001 - the elected rank is gone: this rank's own view
            return self._alone(cause, "the rank elected to name them did not answer")
        if self.rank in verdict.missing:
            self.store.set(f"stack/{self.rank}", self._main_stack())
        try:  # the elected rank prints before anyone exits (torchrun stops the rest at the first exit)
            self.store.wait(["spoken"], datetime.timedelta(seconds=REPORT_WAIT_S))
        except Exception:  # noqa: BLE001
            pass
        return verdict

    def _own_beat(self, now: Optional[float] = None) -> dict:
        """This rank's heartbeat: where it is, since when idle, and who it is."""
        w = self.board.now
        idle = (time.monotonic() if now is None else now) - w.progressed
        return {"host": self.host, "pid": self.pid, "time": time.time(), "idle": idle,
                **{k: getattr(w, k) for k in _BEAT_FIELDS}}

    def _main_stack(self) -> str:
        frame = sys._current_frames().get(self._main)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)"


def _own_connection(store):
    """``store`` on a connection of the watchdog's own, whose operations give up after
    :data:`STORE_TIMEOUT_S`: the heartbeats never queue behind the main thread's store calls, and a
    store whose host is frozen (under srun rank 0 serves it) cannot hold the verdict for the
    collective timeout. A store that cannot be cloned (an in-process one) is used as it is."""
    try:
        own = store.clone()
        own.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return own
    except (RuntimeError, NotImplementedError, AttributeError):
        return store


class _Off:
    """No watchdog (one process, or a fake group): the context manager does nothing."""

    def __enter__(self) -> "_Off":
        return self

    def __exit__(self, *exc) -> None:
        return None


def _checkpoint_bytes(engine) -> int:
    state = engine.model_state_bytes()
    return max(0, state.get("total", 0) - state.get("grads", 0))


def check_timeout_covers_save(config, run) -> None:
    """Refuse, on every rank, a ``--distributed-timeout-minutes`` below the time this layout's checkpoint
    save needs: a node writes its ranks' shards at :data:`ASSUMED_SAVE_GB_PER_S_PER_NODE`, and the ranks
    that finish first wait for the slowest inside the save's agreement, under the collective timeout."""
    from megazero.config.train_config import ConfigError
    from megazero.utils.phase_agreement import agree

    if not config.checkpoint.save:
        return
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    timeout_s = config.parallel.distributed_timeout_minutes * 60

    def check() -> None:
        seconds = _checkpoint_bytes(run.engine) * ranks_per_node / (ASSUMED_SAVE_GB_PER_S_PER_NODE * 1e9)
        if seconds > timeout_s:
            raise ConfigError(
                f"--distributed-timeout-minutes {timeout_s / 60:g} is shorter than a checkpoint save of this layout "
                f"needs (about {seconds / 60:.1f} min: {ranks_per_node} ranks per node write "
                f"{_checkpoint_bytes(run.engine) / 2**30:.1f} GiB each at {ASSUMED_SAVE_GB_PER_S_PER_NODE:g} GB/s "
                f"per node); give --distributed-timeout-minutes {math.ceil(2 * seconds / 60)}")

    agree("start-up check", check)


def warn_if_save_near_timeout(config, seconds: float) -> None:
    """A save that took more than half the collective timeout: say so before a slower one ends the run."""
    timeout_s = config.parallel.distributed_timeout_minutes * 60
    if seconds > timeout_s / 2 and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning(f"the checkpoint save took {seconds / 60:.1f} min, over half of --distributed-timeout-minutes "
                    f"{timeout_s / 60:g}: a slower save would end the run as a hang; give "
                    f"--distributed-timeout-minutes {math.ceil(3 * seconds / 60)}")
