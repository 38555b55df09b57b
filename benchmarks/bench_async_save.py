#!/usr/bin/env python
"""What a checkpoint save costs the training loop, synchronous against ``--async-save``, in both formats.

    python benchmarks/bench_async_save.py                       # 2 ranks, ZeRO-1, 3 interleaved repeats
    python benchmarks/bench_async_save.py --world 4 -- --tp 2 --zero-stage 3

Each run is ``torchrun --nproc_per_node WORLD pretrain_gpt.py`` of a small dense GPT (about 44M
parameters: the state a rank copies and writes is hundreds of MB, not a toy's kilobytes) saving every
``--interval`` iterations, in one of five modes: no save (the baseline), megazero's format and torch_dist,
each synchronous and in the background. Runs alternate within every repeat. From the metrics file
(``--log-interval 1``) the wall-clock gap between consecutive iterations' timestamps is taken: for an
iteration that saves it holds the save as the loop sees it (the whole write when synchronous, the staging
copy when in the background); the other iterations' gaps show what a write going on beside them costs.
The table gives, per mode, what the loop waited for at a save (rank 0's logged "saved checkpoint ... in"
or "staged checkpoint ... in" time), the median gap of the saving iterations and of the others, and the
run's total wall time, with ratios against the no-save baseline of the same repeat. A measurement: it
exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = ["--num-layers", "8", "--hidden-size", "640", "--num-attention-heads", "10", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "8192", "--micro-batch-size", "2", "--lr", "1e-4",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--log-interval", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear"]
MODES = {"no save": [], "megazero sync": ["--ckpt-format", "megazero"],
         "megazero async": ["--ckpt-format", "megazero", "--async-save"],
         "torch_dist sync": ["--ckpt-format", "torch_dist"],
         "torch_dist async": ["--ckpt-format", "torch_dist", "--async-save"]}


def run_once(mode: str, world: int, iters: int, interval: int, extra: list[str], workdir: Path) -> dict:
    """One launch: the gaps (ms) of the iterations that save and of the others (the first two left out)."""
    metrics, save = workdir / "metrics.jsonl", workdir / "ckpt"
    metrics.unlink(missing_ok=True)
    shutil.rmtree(save, ignore_errors=True)
    saving = MODES[mode]
    flags = (["--save", str(save), "--save-interval", str(interval), *saving] if saving else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(world),
           str(ROOT / "pretrain_gpt.py"), *MODEL, "--train-iters", str(iters), "--global-batch-size",
           str(2 * world), "--metrics-file", str(metrics), *flags, *extra]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    stamps = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "timestamp" in rec and "lm_loss" in rec:
            stamps[rec["iteration"]] = rec["timestamp"]
    gaps = {it: (stamps[it + 1] - stamps[it]) * 1e3 for it in sorted(stamps) if it + 1 in stamps and it > 2}
    # the save of iteration i happens after its step, before iteration i + 1's
    save_gaps = [g for it, g in gaps.items() if it % interval == 0]
    other = [g for it, g in gaps.items() if it % interval]
    # what the loop waited for at each save: the whole save (synchronous) or its staging (background)
    blocked = [float(m.group(1)) * 1e3 for m in re.finditer(r"(?:saved|staged) checkpoint \S+ in ([0-9.]+)s",
                                                             proc.stdout + proc.stderr)]
    return {"save": statistics.median(save_gaps) if saving and save_gaps else float("nan"),
            "blocked": statistics.median(blocked) if blocked else float("nan"),
            "other": statistics.median(other), "total": (max(stamps.values()) - min(stamps.values())) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                results[mode].append(run_once(mode, args.world, args.iters, args.interval, args.extra, Path(tmp)))
    base = results["no save"]
    print(f"world {args.world}, {args.iters} iterations, a save every {args.interval}, {args.repeats} repeats; "
          f"extra flags: {' '.join(args.extra) or '-'}")
    print(f"{'mode':<18}{'blocked ms':>12}{'saving iter ms':>16}{'other iter ms':>15}{'x no-save':>11}{'run ms':>10}"
          f"{'x no-save':>11}")
    for mode, runs in results.items():
        blocked = statistics.median(x["blocked"] for x in runs)
        save = statistics.median(x["save"] for x in runs)
        other = statistics.median(x["other"] for x in runs)
        total = statistics.median(x["total"] for x in runs)
        r_other = statistics.median(x["other"] / b["other"] for x, b in zip(runs, base))
        r_total = statistics.median(x["total"] / b["total"] for x, b in zip(runs, base))
        print(f"{mode:<18}{blocked:>12.1f}{save:>16.1f}{other:>15.1f}{r_other:>11.3f}{total:>10.0f}{r_total:>11.3f}")


if __name__ == "__main__":
    main()
