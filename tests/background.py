"""Scripts started in the background and shared by the tests of a session that run the same command.

The 13B launch script's dry runs (``examples/azure/run_gpt_13b.sh``) are chains of single-threaded
python processes: a test that waits on one leaves the machine's other cores idle, so a module starts
the runs it will read all at once, and a test elsewhere that runs the same command (same arguments,
same changes to the environment) reads the same run instead of starting another.
"""

from __future__ import annotations

import atexit
import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

__all__ = ["run_script"]

_POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="background-script")
_RUNS: dict[tuple, Future] = {}


def _run(argv: tuple[str, ...], changes: dict[str, Optional[str]], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    return subprocess.run(["bash", *argv], env=env, capture_output=True, text=True, timeout=timeout)


def run_script(argv: list[str], changes: dict[str, Optional[str]], timeout: float) -> Future:
    """``bash argv`` in this process's environment with ``changes`` (None removes a variable), started in
    the background now or earlier in the session by a caller with the same arguments and changes; the future
    of its finished process (stdout and stderr as text). ``timeout``: seconds the process may run."""
    argv = [os.path.realpath(argv[0]), *argv[1:]]  # one script however its path is spelled
    key = (tuple(argv), tuple(sorted(changes.items())))
    if key not in _RUNS:
        _RUNS[key] = _POOL.submit(_run, tuple(argv), dict(changes), timeout)
    return _RUNS[key]


@atexit.register
def _shutdown() -> None:
    _POOL.shutdown(wait=False, cancel_futures=True)  # runs no test will read
