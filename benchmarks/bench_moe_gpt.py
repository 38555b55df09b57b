#!/usr/bin/env python
"""A small mixture-of-experts GPT through ``pretrain_gpt.py``: tokens/s and memory at EP 1, 2 and 4.

Every row is the user's command, ``torchrun --nproc-per-node 4 pretrain_gpt.py ...`` on 4 gloo ranks
(one thread each; data parallel 4, the same global batch), on mock data:

* dense:          the GPT with a SwiGLU MLP of ffn = top_k x moe ffn (the same active FLOPs per token);
* loop, ep E:     8 experts, top-2, the experts run one after another (the default);
* grouped, ep E:  the same with ``--moe-grouped-gemm`` (a rank's experts in two grouped matmuls).

Per row: tokens/s (the log's, median over the iterations after the first two), rank 0's largest
logged RSS (``memory_mb``, MiB, read at each log line: Python, torch and the data included), the last
iteration's loss (equal across EP layouts up to the summation order: the layouts train the same
model), and ratios against the loop at ep 1 and against dense, all from this invocation. DeepSpeed-MoE
has no GPT of its own to run here (Megatron-DeepSpeed is a separate program); its layer is compared
in ``bench_moe.py``.

    python benchmarks/bench_moe_gpt.py            # about 10 min on 2 shared cores
    python benchmarks/bench_moe_gpt.py --quick    # tiny shapes, 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4


def _flags(quick: bool, iters: int) -> list[str]:
    layers, hidden, heads, seq, ffn = (2, 64, 4, 64, 128) if quick else (4, 256, 8, 256, 512)
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "2",
            "--global-batch-size", "16", "--vocab-size", "4096", "--tokenizer-type", "NullTokenizer",
            "--mock-data", "--train-iters", str(iters), "--lr", "1e-4", "--swiglu", "--disable-bias-linear",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
            "--seed", "1234", "--moe-ffn-hidden-size", str(ffn), "--ffn-hidden-size", str(2 * ffn)]


MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]


def _run(name: str, extra: list[str], base: list[str], work: Path) -> dict:
    """One launch: its median tokens/s, largest logged RSS and last loss (or the error)."""
    metrics = work / f"{name.replace(' ', '_')}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           str(ROOT / "pretrain_gpt.py"), *base, *extra, "--metrics-file", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        return dict(name=name, error="no result in 20 minutes")
    if run.returncode != 0:
        return dict(name=name, error=(run.stderr or run.stdout)[-400:])
    its = [r for r in map(json.loads, open(metrics)) if "lm_loss" in r]
    timed = its[2:] or its
    return dict(name=name, tps=statistics.median(r["tokens_per_s"] for r in timed),
                rss=max(r["memory_mb"] for r in its), loss=its[-1]["lm_loss"])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (2 layers, hidden 64)")
    p.add_argument("--iters", type=int, default=8, help="training iterations per row")
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    a = p.parse_args(argv)
    base = _flags(a.quick, a.iters)
    print(f"pretrain_gpt.py on {WORLD} gloo ranks x 1 thread, {os.cpu_count()} cores; {' '.join(base)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(_run("dense", [], base, Path(tmp)))
        for ep in a.eps:
            for kind, flag in (("loop", []), ("grouped", ["--moe-grouped-gemm"])):
                rows.append(_run(f"{kind} ep {ep}", MOE + ["--expert-model-parallel-size", str(ep)] + flag,
                                 base, Path(tmp)))
    _print(rows)
    return 0


def _print(rows: list[dict]) -> None:
    ok = {r["name"]: r for r in rows if "error" not in r}
    base, dense = ok.get("loop ep 1"), ok.get("dense")
    print(f"\n{'row':<14}{'tokens/s':>10}{'RSS MiB r0':>17}{'last loss':>11}{'tok/s vs loop ep 1':>20}"
          f"{'tok/s vs dense':>16}{'RSS vs loop ep 1':>18}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<14}  not run: {r['error']}")
            continue
        vs = (lambda b, k: f"{r[k] / b[k]:.2f}x" if b else "-")
        print(f"{r['name']:<14}{r['tps']:10.0f}{r['rss']:17.0f}{r['loss']:11.4f}{vs(base, 'tps'):>20}"
              f"{vs(dense, 'tps'):>16}{vs(base, 'rss'):>18}")


if __name__ == "__main__":
    sys.exit(main())
