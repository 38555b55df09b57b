"""Commands started in the background and shared by the tests of a session that run the same command.

A test that waits on one single-threaded process (the 13B launch script's dry runs, a rehearsal of
one rank) leaves the machine's other cores idle, so a module starts the runs its tests will read all at
once, and a test elsewhere that runs the same command (same arguments, same changes to the
environment, same directory) reads the same run instead of starting another.
"""

from __future__ import annotations

import atexit
import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

__all__ = ["run"]

_POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="background-command")
_RUNS: dict[tuple, Future] = {}


def _run(argv: tuple[str, ...], env: dict[str, str], timeout: float, cwd: Optional[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def run(argv: list[str], changes: dict[str, Optional[str]], timeout: float, cwd: Optional[str] = None) -> Future:
    """``argv`` in this process's environment with ``changes`` (None removes a variable), started in the
    background now, or earlier in the session by a caller with the same arguments, changes and directory;
    the future of its finished process (stdout and stderr as text). ``timeout``: seconds it may run."""
    key = (tuple(argv), tuple(sorted(changes.items())), cwd)
    if key not in _RUNS:
        env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}  # the environment now
        _RUNS[key] = _POOL.submit(_run, tuple(argv), env, timeout, cwd)
    return _RUNS[key]


@atexit.register
def _shutdown() -> None:
    _POOL.shutdown(wait=False, cancel_futures=True)  # runs no test will read
