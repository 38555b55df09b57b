#!/usr/bin/env python
"""What a ZeRO-3 step really holds, seen from outside: RSS of each rank, megazero vs FSDP2.

    python benchmarks/bench_zero_memory.py            # ~3 min on a quiet 2-core machine
    python benchmarks/bench_zero_memory.py --num-layers 4 --hidden-size 256   # smoke run

A 16-layer GPT of about 55M parameters (hidden 512, vocab 8192, seq 256, 4 sequences per
rank), fp32, data parallelism 4 (tp 1), one warm-up step and one measured step, each
configuration in its own ``torchrun --nproc_per_node 4`` (``benchmarks/zero_baselines.py``).
``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc return freed tensors to the OS, so RSS
follows live memory and a gathered weight that autograd keeps alive shows up.

Columns (largest rank): step RSS rise = RSS at the step's high-water mark minus RSS just
before the step (activations, gathered weights, gradients in flight); "x model" = that rise
over the full fp32 model's bytes (RSS sampled every millisecond by a thread during the measured
step); peak RSS = the process's ``ru_maxrss`` (start-up included). ZeRO-3 prefetches one layer ahead,
as FSDP2 does.

Baseline (same invocation): PyTorch FSDP2, ``fully_shard`` per layer and on the root, which
frees unsharded storage with ``untyped_storage().resize_(0)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "zero_baselines.py"
RUNS = {  # name -> worker flags
    "megazero ZeRO-3": ["--system", "megazero", "--zero-stage", "3"],
    "megazero ZeRO-1": ["--system", "megazero", "--zero-stage", "1"],
    "FSDP2 (fully_shard per layer)": ["--system", "fsdp2"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="NAME")
    a = p.parse_args(argv)
    shape = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-heads", "8",
             "--seq-length", "256", "--vocab-size", "8192", "--micro-batch", "4", "--steps", "1", "--warmup", "1",
             "--tp", "1", "--dtype", "fp32",
             # prefetch one layer ahead, as FSDP2 does (DeepSpeed's default 5e7 elements would be the
             # whole of this small model)
             "--prefetch-bucket-size", str(12 * a.hidden_size ** 2)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    h, layers, vocab = a.hidden_size, a.num_layers, 8192
    params = layers * (12 * h * h + 13 * h) + (vocab + 256) * h + 2 * h
    model_bytes = 4 * params
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.runs:
            out = Path(tmp) / "out.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(WORKER),
                   *RUNS[name], *shape, "--out", str(out)]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            ranks = json.loads(out.read_text())["ranks"]
            rise = max(r["step_rss_rise_bytes"] for r in ranks)
            peak = max(r["peak_rss_bytes"] for r in ranks)
            rows.append((name, rise, peak, max(r["tokens_per_s"] for r in ranks)))
    print(f"GPT {layers} layers, hidden {h}: {params / 1e6:.1f}M parameters, fp32 model {model_bytes / 2**20:.0f} MiB; "
          "dp 4, one rank per process, MALLOC_MMAP_THRESHOLD_=65536")
    print(f"{'configuration':32s} {'step RSS rise (MiB)':>20s} {'x model':>8s} {'peak RSS (MiB)':>15s} {'tokens/s':>9s}")
    for name, rise, peak, tps in rows:
        print(f"{name:32s} {rise / 2**20:20.0f} {rise / model_bytes:8.2f} {peak / 2**20:15.0f} {tps:9.0f}")
    base = {n: (r, pk) for n, r, pk, _ in rows}
    if "megazero ZeRO-3" in base and "FSDP2 (fully_shard per layer)" in base:
        (r3, p3), (rf, pf) = base["megazero ZeRO-3"], base["FSDP2 (fully_shard per layer)"]
        print(f"megazero ZeRO-3 / FSDP2: step rise {r3 / rf:.2f}x, peak RSS {p3 / pf:.2f}x")
    if "megazero ZeRO-3" in base and "megazero ZeRO-1" in base:
        print(f"megazero ZeRO-3 / ZeRO-1 peak RSS: {base['megazero ZeRO-3'][1] / base['megazero ZeRO-1'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
