"""Failure on one rank stops every rank, promptly, with that rank's message.

A rank that raises while its peers wait in a collective leaves them there until
the collective timeout (30 minutes by default), and a user mistake (a bad
path, a corrupt file) reaches the terminal as one traceback per rank. So each
collective-free phase of a run (checkpoint read and write, data set-up) goes
through :func:`agree`: every rank runs the phase, then all of them take part in
one small all-reduce of an error flag; if any rank failed, the first failing
rank's message is broadcast and every rank raises :class:`RunAborted` with it.
No rank is ever left inside a collective its peers will not join, because the
phase body itself must not communicate.

Inside the training loop an agreement per iteration would cost a collective and a host
synchronisation each time; there the phase is :func:`attempt`-ed alone, a failure rides
the step's own all-reduce (``ZeroEngine.flag_failure``), and only when that says some
rank failed do all ranks :func:`conclude` together.

Errors are either *user* errors (a message says everything; no traceback) or
*internal* ones (a traceback, logged once, by the rank where it happened).
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from megazero.utils.output import write_error_file

__all__ = ["Failure", "RunAborted", "agree", "attempt", "conclude", "failure_of", "is_user_error", "report"]

T = TypeVar("T")

log = logging.getLogger(__name__)


_USER_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def is_user_error(e: BaseException, extra: tuple[type, ...] = ()) -> bool:
    """An error whose message says everything (no traceback): a missing file, or an error class that declares
    ``user_facing = True`` (a configuration, checkpoint or data-set error)."""
    return (getattr(type(e), "user_facing", False) or isinstance(e, _USER_ERRORS + extra)
            or isinstance(e, RunAborted) and e.user)


class RunAborted(RuntimeError):
    """Raised on every rank when a phase failed somewhere; ``rank`` is where it failed."""

    def __init__(self, phase: str, rank: int, message: str, user: bool, tb: Optional[str] = None) -> None:
        super().__init__(f"{phase} failed on rank {rank}: {message}")
        self.phase, self.rank, self.message, self.user, self.tb = phase, rank, message, user, tb


def _flag_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    if dist.get_backend(group) == "nccl":  # a gloo group beside NCCL (background saves) agrees on the host
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclasses.dataclass
class Failure:
    """What went wrong on this rank in a phase (see :func:`attempt`)."""

    message: str
    user: bool
    tb: str
    error: BaseException


def attempt(fn: Callable[[], T], user_errors: tuple[type, ...] = ()) -> tuple[Optional[T], Optional[Failure]]:
    """Run ``fn`` here only: ``(result, None)``, or ``(None, the failure)``. No communication."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        return None, failure_of(e, user_errors)


def failure_of(e: BaseException, user_errors: tuple[type, ...] = ()) -> Failure:
    """The :class:`Failure` an exception caught here (now or earlier, as the engine's deferred one) is."""
    user = is_user_error(e, user_errors)
    message = e.message if isinstance(e, RunAborted) else str(e) or type(e).__name__
    if not user and not isinstance(e, RunAborted):
        message = f"{type(e).__name__}: {message}"
    tb = "" if user else "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return Failure(message, user, tb, e)


def conclude(phase: str, failure: Optional[Failure], group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank of ``group`` calls this with its own :func:`attempt`'s failure (or None): if
    any rank failed, all raise :class:`RunAborted` with the lowest failing rank's message."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if failure is not None:
            raise RunAborted(phase, dist.get_rank() if dist.is_initialized() else 0, failure.message, failure.user,
                             failure.tb) from failure.error
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flag = torch.tensor([world - rank if failure is not None else 0], dtype=torch.int64, device=_flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    src = world - int(flag.item())  # the lowest failing rank speaks for all
    box = [(failure.message, failure.user, failure.tb) if rank == src else None]
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(box, src=global_src, group=group)
    message, user, tb = box[0]
    aborted = RunAborted(phase, global_src, message, user, tb if rank == src else None)
    if failure is not None:
        raise aborted from failure.error
    raise aborted


def agree(phase: str, fn: Callable[[], T], *, user_errors: tuple[type, ...] = (),
          group: Optional[dist.ProcessGroup] = None) -> T:
    """Run the collective-free ``fn`` on every rank, then agree that it succeeded everywhere.

    ``user_errors`` adds exception types that count as user errors in this phase
    (e.g. ``ValueError`` from data set-up, whose messages name the bad file).
    """
    result, failure = attempt(fn, user_errors)
    conclude(phase, failure, group)
    return result


def report(e: BaseException, prog: str = "error") -> int:
    """Log one ERROR record for ``e`` (led by the traceback of an internal error, on the rank where it
    happened) and return the exit status, 1. The failing rank logs it; the other ranks stay silent, so
    the launching terminal shows it once. Every rank leaves the one line in torchrun's error file
    (:func:`~megazero.utils.output.write_error_file`), so torchrun's summary ends with it whichever
    rank it names."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(e, RunAborted):
        line = f"{prog}: {e}"
        if rank == e.rank:
            log.error("%s%s", e.tb if not e.user and e.tb else "", line)
    elif is_user_error(e):
        line = f"{prog}: {e} (rank {rank})"
        log.error(line)
    else:
        line = f"{prog}: internal error on rank {rank}: {type(e).__name__}: {e}"
        log.error("%s%s", "".join(traceback.format_exception(e)), line)
    write_error_file(line)
    return 1
