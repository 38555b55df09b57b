#!/usr/bin/env python
"""What a ZeRO-3 step really holds, seen from outside: RSS of each rank, megazero vs FSDP2.

    python benchmarks/bench_zero_memory.py                     # both shapes, ~6 min on a quiet 2-core machine
    python benchmarks/bench_zero_memory.py --shapes parameter  # one shape
    python benchmarks/bench_zero_memory.py --num-layers 4 --hidden-size 256   # smoke run

Two GPTs of 16 layers, hidden 512, fp32, data parallelism 4 (tp 1), one warm-up step and one
measured step, each configuration in its own ``torchrun --nproc_per_node 4``
(``benchmarks/zero_baselines.py``):

* ``activation``-dominated: vocab 8192, seq 256, 4 sequences per rank (~55M parameters);
* ``parameter``-dominated: vocab 4096, seq 64, 1 sequence per rank (~52.6M parameters): the
  regime of a 13B run with full recompute, where what ZeRO-3 gathers and buckets shows.

``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc return freed tensors to the OS, so RSS
follows live memory and a gathered weight that autograd keeps alive shows up.

Columns (largest rank): step RSS rise = RSS at the step's high-water mark minus RSS just
before the step (activations, gathered weights, gradients in flight, the optimizer's
temporaries); "x model" = that rise over the full fp32 model's bytes (RSS sampled every
millisecond by a thread during the measured step); peak RSS = the process's ``ru_maxrss``
(start-up included). megazero runs with its defaults (the next unit prefetched, one unit per
reduce bucket), with the gather window set to one layer through DeepSpeed's keys
(``stage3_prefetch_bucket_size`` = ``stage3_max_live_parameters`` = one layer's elements, as FSDP2
prefetches), and with DeepSpeed's element counts (prefetch 5e7, bucket 5e8) for contrast.
Then one more step per configuration under ``LiveMemoryTracker`` gives the live tensors at the
step's peak by kind (gathered parameters, activations, recomputed, reduce buckets, backward's
gradients and temporaries, the step's temporaries: ``megazero.observe.step_kinds``), for megazero and
FSDP2 alike, printed as a table after each shape. The reduce buckets and the step are told apart by
the scopes megazero's engine enters; FSDP2 enters none of them, so its reduce-scatter buffers count
as backward and its optimizer step as other.

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
sys.path.insert(0, str(ROOT))
WORKER = ROOT / "benchmarks" / "zero_baselines.py"
RUNS = {  # name -> worker flags ({layer}: one transformer layer's elements, 12 h^2 + 13 h)
    "megazero ZeRO-3": ["--system", "megazero", "--zero-stage", "3"],
    "megazero ZeRO-3, one-layer window": ["--system", "megazero", "--zero-stage", "3",
                                          "--prefetch-bucket-size", "{layer}", "--max-live-parameters", "{layer}"],
    "megazero ZeRO-3, DeepSpeed sizes": ["--system", "megazero", "--zero-stage", "3",
                                         "--prefetch-bucket-size", "5e7", "--reduce-bucket-size", "5e8"],
    "megazero ZeRO-1": ["--system", "megazero", "--zero-stage", "1"],
    "FSDP2 (fully_shard per layer)": ["--system", "fsdp2"],
}
SHAPES = {  # name -> (vocab, seq, sequences per rank)
    "activation": (8192, 256, 4),
    "parameter": (4096, 64, 1),
}
FSDP2 = "FSDP2 (fully_shard per layer)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="NAME")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = p.parse_args(argv)
    for name in a.shapes:
        _shape(a, name, *SHAPES[name])
    return 0


def _shape(a, label: str, vocab: int, seq: int, rows_per_rank: int) -> None:
    shape = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "8",
             "--seq-length", str(seq), "--vocab-size", str(vocab), "--micro-batch-size", str(rows_per_rank),
             "--steps", "1", "--warmup", "1", "--tp", "1", "--dtype", "fp32", "--sample-rss", "--breakdown"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    h, layers = a.hidden_size, a.num_layers
    params = layers * (12 * h * h + 13 * h) + (vocab + seq) * h + 2 * h
    model_bytes = 4 * params
    rows, kinds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.runs:
            out = Path(tmp) / "out.json"
            flags = [f.format(layer=12 * h * h + 13 * h) for f in RUNS[name]]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(WORKER),
                   *flags, *shape, "--json", str(out)]
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            ranks = json.loads(out.read_text())["ranks"]
            rise = max(r["step_rss_rise_bytes"] for r in ranks)
            peak = max(r["peak_rss_bytes"] for r in ranks)
            rows.append((name, rise, peak, max(r["tokens_per_s"] for r in ranks)))
            worst = max(ranks, key=lambda r: r["breakdown"]["above_start"])["breakdown"]
            kinds.append((name, worst))
    print(f"\n{label}-dominated: GPT {layers} layers, hidden {h}, vocab {vocab}, seq {seq}, {rows_per_rank} "
          f"sequence(s) per rank: {params / 1e6:.1f}M parameters, fp32 model {model_bytes / 2**20:.0f} MiB; "
          "dp 4, one rank per process, MALLOC_MMAP_THRESHOLD_=65536")
    print(f"{'configuration':34s} {'step RSS rise (MiB)':>20s} {'x model':>8s} {'peak RSS (MiB)':>15s} {'tokens/s':>9s}")
    for name, rise, peak, tps in rows:
        print(f"{name:34s} {rise / 2**20:20.0f} {rise / model_bytes:8.2f} {peak / 2**20:15.0f} {tps:9.0f}")
    base = {n: (r, pk) for n, r, pk, _ in rows}
    for name in ("megazero ZeRO-3", "megazero ZeRO-3, one-layer window", "megazero ZeRO-3, DeepSpeed sizes"):
        if name in base and FSDP2 in base:
            (r3, p3), (rf, pf) = base[name], base[FSDP2]
            print(f"{name} / FSDP2: step rise {r3 / rf:.2f}x, peak RSS {p3 / pf:.2f}x")
    _print_breakdown(kinds)
    if "megazero ZeRO-3" in base and "megazero ZeRO-1" in base:
        print(f"megazero ZeRO-3 / ZeRO-1 peak RSS: {base['megazero ZeRO-3'][1] / base['megazero ZeRO-1'][1]:.2f}x")


def _print_breakdown(kinds: list) -> None:
    """What is alive at the step's peak above its start, by kind (live tensor bytes, the largest rank;
    megazero.observe.step_kinds), one column per configuration."""
    from megazero.observe.step_kinds import KINDS

    if not kinds:
        return
    print("live tensors at the step's peak, above the step's start (MiB, largest rank; LiveMemoryTracker):")
    print(f"{'kind':24s}" + "".join(f"{name[:22]:>24s}" for name, _ in kinds))
    for kind in KINDS:
        values = [b["by_kind"].get(kind, 0) for _, b in kinds]
        if any(values):
            print(f"{kind:24s}" + "".join(f"{v / 2**20:24.1f}" for v in values))
    print(f"{'total':24s}" + "".join(f"{b['above_start'] / 2**20:24.1f}" for _, b in kinds))


if __name__ == "__main__":
    sys.exit(main())
