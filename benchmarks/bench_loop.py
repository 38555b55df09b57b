#!/usr/bin/env python
"""The whole training loop, paired: ``torchrun pretrain_gpt.py`` on a tiny dense GPT, this checkout
against a commit.

    python benchmarks/bench_loop.py --against COMMIT            # 4 ranks, 6 interleaved pairs
    python benchmarks/bench_loop.py --against COMMIT --repeats 10 --iters 200 -- --tp 2

``bench_zero.py`` times the engine's step alone; this times what the loop adds around it (the phase
marks, the watchdog's heartbeat thread, the logging) through the program users run. Each run is a
fresh ``torchrun --nproc_per_node WORLD pretrain_gpt.py`` of the tree under test (the commit is checked
out into a temporary git worktree). Runs alternate within every repeat (A B, then B A), so slow drifts
of the machine hit both alike. Figures: the median elapsed milliseconds per iteration over the
iterations after ``--warmup`` (from the metrics file, ``--log-interval 1``), per run; the table gives
each tree's median over runs, and the median and range of the paired ratios (this checkout over the
commit). A measurement, not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_zero import _git, commit_tree, this_checkout  # noqa: E402

# The dense tiny shape of docs/benchmarks.md's step measurements, here through the whole loop.
TINY = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
        "--max-position-embeddings", "256", "--vocab-size", "8192", "--micro-batch-size", "4", "--lr", "1e-4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "3"]


def run_once(tree: Path, world: int, iters: int, warmup: int, extra: list[str], workdir: Path) -> float:
    """One launch of ``tree``'s pretrain_gpt.py: the median ms per iteration after ``warmup``."""
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(world),
           str(tree / "pretrain_gpt.py"), *TINY, "--train-iters", str(iters), "--metrics-file", str(metrics), *extra]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = [json.loads(line)["elapsed_ms_per_iteration"] for line in metrics.read_text().splitlines()
             if line.strip() and "elapsed_ms_per_iteration" in line]
    return statistics.median(times[warmup:])


def mark_costs(passes: int = 8, reps: int = 20000) -> tuple[float, float]:
    """(µs of one iteration's phase marks with ``passes`` forward and backward passes, µs of one heartbeat
    into an in-process store): what the loop's health adds, measured without the machine's noise."""
    import timeit

    import torch.distributed as dist

    from megazero.training.health import PhaseBoard
    from megazero.training.health.watchdog import Watchdog

    board = PhaseBoard()

    def iteration() -> None:
        board.enter("data", iteration=1)
        board.enter("forward-backward", passes=passes)
        for _ in range(passes):
            board.lap("fwd")
        for _ in range(passes):
            board.lap("bwd")
        board.lap("step")

    marks = min(timeit.repeat(iteration, number=reps, repeat=5)) / reps * 1e6
    dog = Watchdog(board, 600.0, rank=0, world=1, store=dist.HashStore())
    beat = min(timeit.repeat(lambda: dog._beat(0.0), number=2000, repeat=5)) / 2000 * 1e6
    return marks, beat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, metavar="COMMIT", help="the commit to compare this checkout with")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=60, help="iterations per run")
    p.add_argument("--warmup", type=int, default=10, help="iterations left out of each run's median")
    p.add_argument("--repeats", type=int, default=6, help="interleaved pairs")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = p.parse_args(argv)
    here = this_checkout()
    short = _git("rev-parse", "--short", args.against)
    pairs: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp, commit_tree(args.against, Path(tmp)) as base:
        work = Path(tmp) / "work"
        work.mkdir()
        for r in range(args.repeats):
            order = [("head", ROOT), ("base", base)] if r % 2 == 0 else [("base", base), ("head", ROOT)]
            got = {name: run_once(tree, args.world_size, args.iters, args.warmup, args.extra, work)
                   for name, tree in order}
            pairs.append((got["head"], got["base"]))
            print(f"repeat {r + 1}/{args.repeats}: {here} {got['head']:.2f} ms, {short} {got['base']:.2f} ms, "
                  f"ratio {got['head'] / got['base']:.3f}", flush=True)
    ratios = [h / b for h, b in pairs]
    marks, beat = mark_costs()
    print(f"\nthis checkout's phase marks: {marks:.1f} µs per iteration of 8 forward and 8 backward passes; one "
          f"heartbeat (every 2 s, in the watchdog's thread): {beat:.1f} µs into an in-process store")
    print(f"\n| tree | ms per iteration (median of {args.repeats} runs) |\n|---|---|")
    print(f"| {here} | {statistics.median(h for h, _ in pairs):.2f} |")
    print(f"| {short} | {statistics.median(b for _, b in pairs):.2f} |")
    print(f"\nthis checkout / {short}, paired: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} ({args.world_size} ranks, {args.iters} iterations, "
          f"first {args.warmup} left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
