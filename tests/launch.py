"""Run what users run: ``pretrain_gpt.py`` and the ``tools/`` programs, with their flags.

Two ways, one result type (:class:`Run`: exit status, stdout, stderr):

* :func:`in_pool` calls the program's ``main(argv)`` on ``world`` ranks of the test's persistent
  gloo pool (``tests/distributed.py``), each rank's stdout and stderr captured. It is the program
  ``torchrun --nproc_per_node world pretrain_gpt.py ARGS`` runs, flag for flag, without starting
  ``world + 1`` interpreters that each import torch: most launches in the suite take this way.
* :func:`launch` starts the real command: ``python X`` for one process, ``torchrun --standalone``
  for several. Kept for what only a fresh launch shows: the launcher's exit codes and messages,
  ``--max-restarts``, faults injected through the environment, one line per failing rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import subprocess
import sys
from typing import Callable, Optional, Sequence

from tests.distributed import DEFAULT_TIMEOUT_S, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
PRETRAIN = "pretrain_gpt.py"


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check(self, what: str = "") -> "Run":
        assert self.returncode == 0, f"{what}: exit {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}"
        return self


def _module_of(script: str) -> str:
    """``pretrain_gpt.py`` / ``tools/x.py`` -> the ``megazero.cli`` module the script runs."""
    return "megazero.cli." + os.path.splitext(os.path.basename(script))[0]


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def _main_on_rank(module: str, argv: Sequence[str], cwd: Optional[str], env: dict,
                  before: Optional[Callable[[], None]]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in env}
    saved_cwd = os.getcwd()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if before is not None:
                before()
            try:
                rc = importlib.import_module(module).main(list(argv))
            except SystemExit as e:
                rc = _exit_status(e)
    finally:
        os.chdir(saved_cwd)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return int(rc or 0), out.getvalue(), err.getvalue()


def in_pool(world: int, argv: Sequence[str], *, script: str = PRETRAIN, cwd=None, env: Optional[dict] = None,
            before: Optional[Callable[[], None]] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Run:
    """``script``'s ``main(argv)`` on ``world`` pool ranks; ``before`` (a module-level function) runs
    first on every rank. The exit status is the first non-zero rank's, as torchrun reports a failure;
    the outputs are the ranks' in rank order."""
    results = run_distributed(world, _main_on_rank, _module_of(script), list(map(str, argv)),
                              None if cwd is None else str(cwd), dict(env or {}), before, timeout_s=timeout_s)
    codes = [rc for rc, _, _ in results]
    return Run(next((c for c in codes if c), 0), "".join(o for _, o, _ in results), "".join(e for _, _, e in results))


def command(world: int, script: str = PRETRAIN) -> list[str]:
    """The command line a user types: ``python SCRIPT`` or ``torchrun --standalone --nproc_per_node N SCRIPT``."""
    path = os.path.join(ROOT, script)
    if world == 1:
        return [sys.executable, path]
    return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", str(world), path]


def launch(world: int, argv: Sequence[str], *, script: str = PRETRAIN, cwd=None, env: Optional[dict] = None,
           timeout_s: float = 300) -> Run:
    """The real command in a fresh process tree (see :func:`command`), one thread per rank."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    proc = subprocess.run(command(world, script) + list(map(str, argv)), env=full_env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(cwd or ROOT))
    return Run(proc.returncode, proc.stdout, proc.stderr)
