#!/usr/bin/env python
"""Start-up cost of initialization: sharded (tp 2 x dp 2 ZeRO-3, 4 CPU processes) vs a full model on one process.

    python benchmarks/bench_init.py                        # gpt-350m (~355M parameters)
    python benchmarks/bench_init.py --model-preset gpt-125m      # quicker

The full run builds ``GPTModel(config)`` at tp=1 (every value drawn, as a single
process must). The sharded run builds the model on the meta device and lets
``zero.initialize`` draw each rank's ZeRO-3 partition of its TP shard only. Both
use one thread per process. Reported: the full init's wall time, each rank's wall
and CPU time of ``zero.initialize``, and the ratio (each rank draws 1/4 of the
values, so about 1/4 plus the fixed costs). On a machine with fewer cores than ranks the ranks' wall
time includes waiting for a core; the CPU-time ratio is the figure that does not.
The rates printed (values/s) feed the 13B dry run's start-up estimate.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _full(preset: str, out) -> None:
    torch.set_num_threads(1)
    from megazero.model import GPTModel, gpt_preset

    config = gpt_preset(preset, vocab_size=50257)
    torch.manual_seed(0)
    t0, c0 = time.perf_counter(), _cpu()
    model = GPTModel(config)
    out.put(("full", time.perf_counter() - t0, _cpu() - c0, sum(p.numel() for p in model.parameters())))


def _sharded(rank: int, world: int, port: int, preset: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from megazero import mpu, zero
    from megazero.model import GPTModel, gpt_preset

    mpu.initialize_model_parallel(2)
    config = gpt_preset(preset, vocab_size=50257)
    torch.manual_seed(0)
    model = GPTModel(config, device="meta")
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch's one-time optimizer imports, not init
    import megazero.zero.materialize as materialize

    timed, original = {}, materialize.materialize_partitions

    def timing(*a, **k):  # the initialization proper, without grad buffers and optimizer set-up
        t, c = time.perf_counter(), _cpu()
        original(*a, **k)
        timed.update(wall=time.perf_counter() - t, cpu=_cpu() - c)

    materialize.materialize_partitions = timing
    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu()
    engine = zero.initialize(model, ds, mpu=mpu)
    out.put(("rank", time.perf_counter() - t0, _cpu() - c0, timed["wall"], timed["cpu"],
             engine.num_local_parameters() // 2))
    dist.barrier()
    mpu.shutdown_distributed()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", "--preset", dest="model_preset", default="gpt-350m")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_full, args=(args.model_preset, q))
    proc.start()
    _, full_wall, full_cpu, n = q.get()
    proc.join()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_sharded, args=(r, 4, port, args.model_preset, q)) for r in range(4)]
    for pr in procs:
        pr.start()
    ranks = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    wall, cpu = max(r[1] for r in ranks), max(r[2] for r in ranks)
    mwall, mcpu = max(r[3] for r in ranks), max(r[4] for r in ranks)
    print(f"{args.model_preset}: {n:,} parameters")
    print(f"full init, 1 process:                wall {full_wall:7.2f} s  cpu {full_cpu:7.2f} s  "
          f"({n / full_cpu / 1e6:.1f} M values/s per thread)")
    print(f"tp2 x dp2 ZeRO-3, zero.initialize:   wall {wall:7.2f} s  cpu {cpu:7.2f} s  (slowest of 4 ranks)")
    print(f"  of which the sharded init:         wall {mwall:7.2f} s  cpu {mcpu:7.2f} s")
    print(f"ratio sharded init / full init: wall {mwall / full_wall:.3f}  cpu {mcpu / full_cpu:.3f}; "
          f"whole zero.initialize: wall {wall / full_wall:.3f}  cpu {cpu / full_cpu:.3f}  (goal <= 0.333)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
