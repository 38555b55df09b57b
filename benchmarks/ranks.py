"""Spawned gloo ranks for the benchmarks: one process and one thread per rank, results in rank order.

``run_ranks(world, fn, *args)`` starts ``world`` processes; each initialises torch.distributed over
gloo (``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set as a launcher would) and
returns ``fn(rank, world, *args)`` (``fn`` a module-level function, picklable by reference).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def _main(rank: int, world: int, port: int, fn: Callable, args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.put((rank, fn(rank, world, *args)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 3600) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_main, args=(r, world, port, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank of {fn.__name__} on {world} ranks failed (exit code {p.exitcode})")
    return [got[r] for r in range(world)]
