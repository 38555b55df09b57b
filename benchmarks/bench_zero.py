#!/usr/bin/env python
"""ZeRO-3 with tensor parallelism on 4 CPU processes: megazero vs FSDP2(+DTensor TP) vs DeepSpeed.

    python benchmarks/bench_zero.py                       # every configuration: ~20 min on a quiet 2-core machine
    python benchmarks/bench_zero.py --repeats 3 --dtypes fp32
    python benchmarks/bench_zero.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --vocab-size 512 --steps 2 --repeats 1    # smoke run, ~1 min
    python benchmarks/bench_zero.py --against                 # the working tree against HEAD, ~15 min
    python benchmarks/bench_zero.py --against HEAD~3 --dtypes fp32 --repeats 6

Configurations (one GPT shape; default 4 layers, hidden 256, 8 heads, seq 256,
vocab 8192, micro-batch 4 sequences per DP rank; AdamW, no clipping):

1. ``megazero tp2``    megazero.zero stage 3, tp=2 x dp=world size/2
2. ``megazero tp1``    megazero.zero stage 3, tp=1 x dp=world size
3. ``FSDP2+TP tp2``    plain-torch GPT, DTensor TP (parallelize_module) + fully_shard on a [dp, tp=2] mesh
4. ``DeepSpeed tp2``   DeepSpeed ZeRO-3 on megazero's GPT, ``deepspeed.initialize(..., mpu=megazero.mpu)``
5. ``Megatron-DS tp2`` / ``tp1``: the Megatron-DeepSpeed arrangement, DeepSpeed ZeRO-3 driving a GPT of
   megatron-core's TP layers through megatron-core's ``parallel_state`` (``benchmarks/megatron_ds.py``)

(4 and 5 are skipped when deepspeed / megatron-core are not importable.) The compute-bound shape:

    python benchmarks/bench_zero.py --world-size 2 --configs "megazero tp1" "Megatron-DS tp1" --dtypes fp32 \
        --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --micro-batch-size 2

Each (configuration, dtype) runs as its own ``torchrun --nproc_per_node 4`` child
(``benchmarks/zero_baselines.py``), one thread per rank, so peak RSS is per process and
runs do not share a heap. Runs are interleaved (1 2 3 4 1 2 3 4 ...) so that slow drifts
of the machine hit every configuration alike; the table reports medians over repeats.

Columns: tokens/s = global tokens of the timed steps / wall time (after ``--warmup``
steps); tokens/CPU-s = the same tokens / CPU seconds of all ranks together (robust when
other jobs share the machine); "vs" = ratio to megazero at the same tp and dtype; model state = the largest rank's
parameters + gradients + optimizer state (what each engine holds between steps; see
README: examples/zero_with_tp), peak RSS = the largest rank's ``ru_maxrss``; kernels / rest =
the CPU time per rank and step inside the model's matmul and attention kernels (timed in one
extra step, ``zero_baselines.ComputeTimer``; the same FLOPs in every arrangement) and the rest of
the step's CPU time, which is what the arrangement itself costs ("vs": its ratio to megazero's).

``--against REF`` (a commit, branch or tag; default ``HEAD``, so that uncommitted changes are what is
measured) compares this checkout's megazero with the ref's: the ref is checked out into a temporary git worktree, and each run imports megazero
from one of the two trees through this same harness (``zero_baselines.py``). The two alternate
within every repeat (A B, then B A), and the table gives each tree's medians, the ratio of every
repeat's pair and the kernels/rest split, so that a change of the engine's own cost shows in one
command. Two columns do not depend on the machine's load: the tensor operations a rank dispatches
in a step and the Python bytecodes it executes (one more step each, counted by the worker), so a
change of the step's work shows even where the timings are noisy. It runs ``megazero tp2`` unless ``--configs`` names megazero configurations, 20 timed
steps per run and 4 repeats unless told otherwise, and exits 0 (a measurement, not a test).

The header gives this CPU's single-thread GEMM rate in fp32 and bf16 at the model's shape: where
bf16 has no native instructions (AVX2 only), bf16 matmuls run several times slower than fp32
ones, the bf16 rows are bound by them alike, and only the "rest" column tells the arrangements apart.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "zero_baselines.py"

CONFIGS = {  # name -> (system, tp); dp = --world-size / tp
    "megazero tp2": ("megazero", 2),
    "megazero tp1": ("megazero", 1),
    "FSDP2+TP tp2": ("fsdp2", 2),
    "DeepSpeed tp2": ("deepspeed", 2),
    "Megatron-DS tp2": ("megatron-ds", 2),
    "Megatron-DS tp1": ("megatron-ds", 1),
}
NEEDS = {"deepspeed": ("deepspeed",), "megatron-ds": ("deepspeed", "megatron.core")}
AGAINST_DEFAULT = "HEAD"  # a bare --against: the working tree's changes against the last commit
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size",
               "steps", "warmup", "persistence_threshold")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS), metavar="NAME",
                   help=f"subset of: {', '.join(repr(c) for c in CONFIGS)} (default all; 'megazero tp2' "
                        "with --against)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3; 4 with --against)")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", "--num-heads", dest="num_attention_heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--micro-batch-size", "--micro-batch", dest="micro_batch_size", type=int, default=4,
                   help="sequences per DP rank per step")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 6; 20 with --against)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (DeepSpeed ZeRO-3 records its "
                   "module trace over the first step and prefetches from the second: steady state is "
                   "measured from the third)")
    p.add_argument("--persistence-threshold", type=int, default=10_000,
                   help="stage3_param_persistence_threshold for megazero and DeepSpeed (their default 1e5 "
                        "would keep most of this small model's matrices whole)")
    p.add_argument("--world-size", "--nproc", dest="world_size", type=int, default=4, help="processes per run")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child run")
    p.add_argument("--json", default=None, help="also write every run's raw results here")
    p.add_argument("--against", nargs="?", const=AGAINST_DEFAULT, default=None, metavar="REF",
                   help=f"compare this checkout's megazero with REF's (a commit, branch or tag; default "
                        f"{AGAINST_DEFAULT}: the uncommitted changes), paired and interleaved")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 4 if args.against else 3
    if args.steps is None:
        args.steps = 20 if args.against else 6
    if args.configs is None:
        args.configs = ["megazero tp2"] if args.against else list(CONFIGS)
    others = [c for c in args.configs if CONFIGS[c][0] != "megazero"]
    if args.against and others:
        p.error(f"--against compares megazero with itself: drop {', '.join(map(repr, others))} from --configs")
    return args


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def run_one(name: str, dtype: str, args, workdir: Path, index: int, tree: Path | None = None) -> dict:
    """One configuration as its own torchrun; megazero imported from ``tree`` where given (--against)."""
    system, tp = CONFIGS[name]
    out = workdir / f"run{index}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}",
           str(WORKER), "--system", system, "--tp", str(tp), "--dtype", dtype, "--json", str(out), "--compute-split",
           "--count-work"]
    for flag in SHAPE_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
           "PYTHONFAULTHANDLER": "1"}
    if tree is not None:
        env["MEGAZERO_BENCH_TREE"] = str(tree)
    for attempt in (1, 2):  # one retry: a child that fails before its results were written
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = -1, f"timed out after {args.timeout} s\n{(e.stderr or b'')[-2000:]!r}"
        wall = time.perf_counter() - t0
        if out.exists():  # rank 0 wrote the results after the last step: the measurement is complete
            if rc != 0:
                print(f"  {name} {dtype}: results complete, but the child exited with {rc} at teardown",
                      file=sys.stderr, flush=True)
            break
        print(f"  {name} {dtype}: FAILED (attempt {attempt}) after {wall:.0f} s\n{tail}", file=sys.stderr, flush=True)
    else:
        return {"name": name, "dtype": dtype, "ok": False, "error": tail}
    ranks = json.loads(out.read_text())["ranks"]
    res = {
        "name": name, "dtype": dtype, "ok": True, "wall_s": wall,
        "tokens_per_s": ranks[0]["tokens_per_s"],  # barriers around every step: the same on all ranks
        # CPU time of all ranks together: insensitive to other load on the machine (unlike wall time)
        "tokens_per_cpu_s": ranks[0]["timed_tokens"] / sum(r["timed_cpu_s"] for r in ranks),
        "load_avg": max(load_before, os.getloadavg()[0]),
        "model_state_bytes": max(r["model_state"]["total"] for r in ranks),
        "model_state": ranks[0]["model_state"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "loss": ranks[0]["loss"],
        "megazero": ranks[0]["megazero"],
    }
    # CPU per rank and step, split into the model's own matmul/attention kernels (the same work in
    # every arrangement) and the rest: what the arrangement adds (collectives, waits, copies, hooks,
    # the optimizer step). Left unclamped: a negative rest says the one split step's kernels ran
    # slower than the timed steps' average, i.e. the run's noise exceeds the arrangement's own cost.
    cpu_step = statistics.mean(r["timed_cpu_s"] for r in ranks) / args.steps
    kernels = statistics.mean(r["compute_s"]["matmul"] + r["compute_s"]["attention"] for r in ranks)
    res.update(cpu_ms=1e3 * cpu_step, kernel_ms=1e3 * kernels, rest_ms=1e3 * (cpu_step - kernels))
    # the step's work, independent of the machine's load: tensor operations and Python bytecodes per rank
    res.update(ops=statistics.mean(r["compute_s"]["ops"] for r in ranks),
               opcodes=statistics.mean(r["python_opcodes"] for r in ranks))
    print(f"  {name:14s} {dtype}: {res['tokens_per_s']:8.0f} tokens/s {res['tokens_per_cpu_s']:6.0f} tokens/CPU-s"
          f"  state {res['model_state_bytes'] / 2**20:6.1f} MiB  RSS {res['peak_rss_bytes'] / 2**20:6.0f} MiB"
          f"  CPU/rank-step {res['cpu_ms']:.0f} ms = kernels {res['kernel_ms']:.0f} + rest {res['rest_ms']:.0f}"
          f"  ({wall:.0f} s, load {res['load_avg']:.1f})", file=sys.stderr, flush=True)
    return res


def gemm_rates(args) -> str:
    """This CPU's one-thread GEMM rate (GFLOP/s) for the model's first MLP matmul, fp32 and bf16."""
    import torch

    torch.set_num_threads(1)
    tokens = args.micro_batch_size * args.seq_length
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, args.hidden_size, dtype=dtype)
        w = torch.randn(4 * args.hidden_size, args.hidden_size, dtype=dtype)
        torch.nn.functional.linear(x, w)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.5:
            torch.nn.functional.linear(x, w)
            n += 1
        rates[dtype] = 2 * x.numel() * w.shape[0] * n / (time.perf_counter() - t0) / 1e9
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    return (f"one-thread GEMM [{tokens} x {args.hidden_size}] x [{args.hidden_size} x {4 * args.hidden_size}]: "
            f"fp32 {rates[torch.float32]:.1f} GFLOP/s, bf16 {rates[torch.bfloat16]:.1f} GFLOP/s "
            f"(native bf16: {', '.join(native) if native else 'none'})")


def table(results: list[dict], configs: list[str], dtypes: list[str]) -> str:
    lines = ["| configuration | dtype | tokens/s | vs megazero | tokens/CPU-s | vs | kernels CPU-ms/rank-step "
             "| rest CPU-ms/rank-step | vs | model state MiB/rank | peak RSS MiB/rank | runs |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keys = ("tokens_per_s", "tokens_per_cpu_s", "kernel_ms", "rest_ms", "model_state_bytes", "peak_rss_bytes")
    for dtype in dtypes:
        meds = {}
        for name in configs:
            ok = [r for r in results if r["name"] == name and r["dtype"] == dtype and r["ok"]]
            if ok:
                meds[name] = {k: statistics.median(r[k] for r in ok) for k in keys}
        for name in configs:
            base = meds.get(f"megazero tp{CONFIGS[name][1]}")
            n_ok = sum(1 for r in results if r["name"] == name and r["dtype"] == dtype and r["ok"])
            n_bad = sum(1 for r in results if r["name"] == name and r["dtype"] == dtype and not r["ok"])
            runs = f"{n_ok}" + (f" ({n_bad} failed)" if n_bad else "")
            m = meds.get(name)
            if m is None:
                lines.append(f"| {name} | {dtype} | failed | | | | | | | | | {runs} |")
                continue

            def ratio(k):
                return f"{m[k] / base[k]:.2f}x" if base else "n/a"

            lines.append(f"| {name} | {dtype} | {m['tokens_per_s']:.0f} | {ratio('tokens_per_s')} | "
                         f"{m['tokens_per_cpu_s']:.0f} | {ratio('tokens_per_cpu_s')} | "
                         f"{m['kernel_ms']:.0f} | {m['rest_ms']:.0f} | {ratio('rest_ms')} | "
                         f"{m['model_state_bytes'] / 2**20:.1f} | {m['peak_rss_bytes'] / 2**20:.0f} | {runs} |")
    return "\n".join(lines)


def _git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *argv], check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def commit_tree(commit: str, parent: Path):
    """A detached git worktree of ``commit`` under ``parent``, removed on exit."""
    path = parent / "against"
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still removes its worktree
    try:
        try:
            _git("worktree", "add", "--detach", str(path), commit)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"--against {commit}: git worktree add failed ({e.stderr.strip().splitlines()[-1]}); "
                             "name a commit, branch or tag of this repository") from None
        try:
            yield path
        finally:
            _git("worktree", "remove", "--force", str(path))
    finally:
        signal.signal(signal.SIGTERM, before)


def this_checkout() -> str:
    """HEAD's short hash, marked where megazero/ differs from it."""
    dirty = _git("status", "--porcelain", "--", "megazero")
    return f"HEAD ({_git('rev-parse', '--short', 'HEAD')}{' + changes' if dirty else ''})"


def against_table(results: list[dict], configs: list[str], dtypes: list[str], labels: list[str]) -> str:
    """Each tree's medians, then this checkout over the commit: the medians' ratio and every repeat's."""
    keys = ("tokens_per_s", "tokens_per_cpu_s", "kernel_ms", "rest_ms", "ops", "opcodes")
    lines = ["| configuration | dtype | megazero | tokens/s | tokens/CPU-s | kernels CPU-ms/rank-step "
             "| rest CPU-ms/rank-step | tensor ops/rank-step | Python bytecodes/rank-step | runs |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for dtype in dtypes:
        for name in configs:
            ok = {lab: [r for r in results if (r["name"], r["dtype"], r["tree"]) == (name, dtype, lab) and r["ok"]]
                  for lab in labels}
            meds = {lab: {k: statistics.median(r[k] for r in ok[lab]) for k in keys} for lab in labels if ok[lab]}
            for lab in labels:
                m = meds.get(lab)
                cells = " | ".join(f"{m[k]:.0f}" for k in keys) if m else "failed | | | | |"
                lines.append(f"| {name} | {dtype} | {lab} | {cells} | {len(ok[lab])} |")
            if len(meds) == 2:
                base, this = (meds[lab] for lab in labels)
                lines.append(f"| {name} | {dtype} | ratio | " +
                             " | ".join(f"{this[k] / base[k]:.3f}x" for k in keys) + " | |")
            pairs = {}
            for r in results:
                if (r["name"], r["dtype"]) == (name, dtype) and r["ok"]:
                    pairs.setdefault(r["repeat"], {})[r["tree"]] = r
            pairs = [p for _, p in sorted(pairs.items()) if len(p) == 2]
            for k, what in (("tokens_per_s", "tokens/s"), ("rest_ms", "rest CPU-ms")):
                each = [p[labels[1]][k] / p[labels[0]][k] for p in pairs]
                if each:
                    notes.append(f"{name} {dtype}, {what}, {labels[1]} / {labels[0]} per repeat: "
                                 f"{' '.join(f'{x:.3f}' for x in each)} (median {statistics.median(each):.3f})")
    return "\n".join(lines + [""] + notes)


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = list(args.configs)
    for name in list(configs):
        missing = [m for m in NEEDS.get(CONFIGS[name][0], ()) if not _importable(m)]
        if missing:
            print(f"{' and '.join(missing)} not installed: skipping {name!r}", file=sys.stderr)
            configs.remove(name)
    shape = (f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
             f"seq {args.seq_length}, vocab {args.vocab_size}, micro-batch {args.micro_batch_size}/DP rank, "
             f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} repeats, "
             f"{args.world_size} processes x 1 thread")
    print(f"bench_zero: {shape}", file=sys.stderr, flush=True)
    cpu = gemm_rates(args)
    print(f"this CPU: {cpu}", file=sys.stderr, flush=True)
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmp, \
            (commit_tree(args.against, Path(tmp)) if args.against else contextlib.nullcontext()) as base:
        trees = [(None, "")]
        if base is not None:
            short = _git("rev-parse", "--short", args.against)
            label = short if short.startswith(args.against) else f"{args.against} ({short})"
            trees = [(base, label), (ROOT, this_checkout())]
        index = 0
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
            for dtype in args.dtypes:
                for name in configs:
                    for tree, label in (trees if rep % 2 == 0 else trees[::-1]):  # A B, B A: drifts cancel
                        results.append({**run_one(name, dtype, args, Path(tmp), index, tree),
                                        "tree": label, "repeat": rep})
                        index += 1
                        if tree is not None and results[-1]["ok"] and results[-1]["megazero"] != str(tree.resolve()):
                            raise SystemExit(f"the run meant for {tree} imported megazero from "
                                             f"{results[-1]['megazero']}: check PYTHONPATH")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\nZeRO-3 benchmark ({shape}; total {time.perf_counter() - t0:.0f} s)\nthis CPU: {cpu}\n")
    if args.against:
        print(against_table(results, configs, args.dtypes, [label for _, label in trees]))
    else:
        print(table(results, configs, args.dtypes))
    loads = [r["load_avg"] for r in results if r["ok"]]
    cores = os.cpu_count() or 1
    print(f"\nmedians over repeats; 1-min load average during the runs: {min(loads, default=0):.1f}.."
          f"{max(loads, default=0):.1f} on {cores} cores")
    if loads and max(loads) > args.world_size + cores:
        print("warning: the load average exceeded ranks + cores (other work on the machine, or the ranks' own "
              "communication threads): wall-clock tokens/s is noisy; tokens/CPU-s and the kernels/rest split "
              "are steadier")
    return 0 if args.against or all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
