"""Run a test function on N ranks (CPU, gloo) with a clean model-parallel state per test.

Starting processes and importing torch costs seconds, so each world size gets
one pool of long-lived worker processes for the whole session, forked from one
server process that imported torch and megazero's training path once. A test sends
``(fn, args)``; every rank runs ``fn(*args)`` (after resetting megazero's
parallel state and seeds) and sends back its return value or its traceback.
When any rank fails or the pool stops answering, the pool is torn down and the
next test gets a fresh one, so one broken test cannot hang the suite.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import queue
import socket
import traceback
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

# Workers start from multiprocessing's fork server, which imports these once: a fresh interpreter per
# worker spent about 2 s of CPU importing torch and 2 s more on the first run's own imports (the
# optimizer's first step imports torch._dynamo). The server starts with the first pool, from this process.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megazero.mpu", "megazero.training.trainer"]
if "forkserver" in mp.get_all_start_methods():
    _CTX = mp.get_context("forkserver")
    _CTX.set_forkserver_preload(PRELOAD)
else:
    _CTX = mp.get_context("spawn")
_SERVER_ENVIRON: dict[str, str] = {}  # this process's environment when the fork server started
_POOLS: dict[tuple[str, int], "_Pool"] = {}  # (pool name, world size)
DEFAULT_TIMEOUT_S = float(os.environ.get("MEGAZERO_TEST_TIMEOUT", "240"))


def _server_environ() -> dict[str, str]:
    """The environment the fork server starts in (it starts with the first worker): this process's, then."""
    if not _SERVER_ENVIRON:
        _SERVER_ENVIRON.update(os.environ)
    return _SERVER_ENVIRON


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when the process that spawned it ends, however it ends
    (a pytest-xdist worker may exit without running atexit), so no pool outlives its suite."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _destroy_subgroups(dist) -> None:
    """Destroy every process group a task made (mpu's TP/PP/DP groups, an engine's gradient
    communicator). Each gloo group keeps a TCP loop and two work threads polling: left alive, a
    long-lived worker accumulated ~170 groups and 500 threads, and the suite slowed as it went."""
    c10d = dist.distributed_c10d
    for pg in list(c10d._world.pg_map):
        # Kept: groups made with use_local_synchronization (ZeRO-3's gradient communicator). Their
        # name is a hash of their ranks, so a re-created one would rendezvous on the destroyed one's
        # store keys and hang; engines reuse them by name, so there is one per set of ranks.
        if pg is not c10d._world.default_pg and c10d._world.pg_names.get(pg, "").isdigit():
            dist.destroy_process_group(pg)


def thread_names() -> Optional[list[str]]:
    """The names of this process's threads (gloo's are ``gloo_tcp_loop`` and ``pt_gloo_runloop``);
    None where there is no Linux ``/proc``."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def _collect_if_threads_pile_up(limit: int = 64) -> None:
    """Collect garbage once a worker holds over ``limit`` threads. A destroyed gloo group stops its
    polling threads only when its last reference goes, and tasks leave ordinary reference cycles
    (modules, engines) that keep theirs until the collector runs; collecting after every task costs
    0.1-0.4 s, so only when they pile up. Without ``/proc``, the collector keeps its own pace."""
    names = thread_names()
    if names is not None and len(names) > limit:
        gc.collect()


def _worker(rank: int, world_size: int, port: int, tasks, results, environ: dict, server_environ: dict) -> None:
    _die_with_parent()
    # The environment of the pool's creator now, as a spawned process gets it, where the fork server holds
    # the one it started in (plus what its imports set, which a spawned worker's imports would set too).
    for name in server_environ.keys() - environ.keys():
        os.environ.pop(name, None)
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    from megazero import mpu

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            torch.manual_seed(1234)
            out = ("ok", fn(*args, **kwargs))
        except BaseException:  # report everything, including assertion errors
            out = ("error", traceback.format_exc())
        finally:
            mpu.destroy_model_parallel()
            _destroy_subgroups(dist)
            _collect_if_threads_pile_up()
        results.put((rank, out))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int, daemon: bool = True) -> None:
        self.world_size = world_size
        port = _free_port()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        self.results = _CTX.Queue()
        self.procs = [
            _CTX.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results, dict(os.environ),
                                               _server_environ()), daemon=daemon)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outs: dict[int, Any] = {}
        while len(outs) < self.world_size:
            try:
                rank, (status, value) = self.results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks: no answer from ranks "
                                   f"{sorted(set(range(self.world_size)) - set(outs))} within {timeout_s:.0f}s")
            if status == "error":
                raise AssertionError(f"rank {rank} of {self.world_size} failed in {fn.__name__}:\n{value}")
            outs[rank] = value
        return [outs[r] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                    pool_name: str = "megazero", **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be a module-level function (it is pickled by name). Another ``pool_name`` keeps tasks that
    patch their process (megatron-core's CPU shims) in workers of their own, apart from megazero's; those
    workers are not daemonic, so their tasks may start processes (megatron-core's checkpoint writers). Every
    worker dies with this process all the same (``_die_with_parent``).
    """
    key = (pool_name, world_size)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(world_size, daemon=pool_name == "megazero")
    try:
        return pool.run(fn, args, kwargs, timeout_s)
    except BaseException:
        # Ranks may be stuck in a collective the failed rank never joined: start over.
        _POOLS.pop(key, None)
        pool.close(graceful=False)
        raise


@atexit.register
def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
