#!/usr/bin/env python
"""Context parallelism at long sequences: ring attention (zigzag and contiguous layouts) and a2a.

One causal self-attention (fp32, batch 1, 8 query heads, 2 key/value groups, head dim 64) of a
sequence of S tokens split over cp gloo ranks (one process and one thread per rank), forward and
backward, for cp 1, 2, 4 and S 8192, 16384:

* ring, zigzag:     ``ring_attention`` with the balanced layout (rank r holds chunks r and 2cp-1-r);
* ring, contiguous: the same with rank r holding the r-th contiguous chunk (the unbalanced baseline);
* a2a:              the Ulysses all-to-all over heads (``a2a_attention``) on the zigzag split.

Per configuration and rank, two steps: one timed (CPU time of the rank's main thread, which runs
forward and backward; wall time too, but the ranks share the machine's cores, so wall time is
contended and per-rank CPU time is the figure), one under ``LiveMemoryTracker``: the peak of the
live tensor bytes the step allocated (saved tensors, received blocks, gradients; the inputs q, k, v
excluded), and the bytes saved for backward (``saved_tensors_hooks``, unique storages). Query-key
pairs and bytes sent come from ``RingStats`` (ring) and ``CommCounter`` (a2a; its pairs are the
causal pairs of its heads/cp heads, in whole-head units). Bytes sent forward are checked against
(S/cp) g (d + dv) (cp-1) x 4 for the ring and S (heads + g) (d + dv) (cp-1) / cp^2 x 4 for a2a (dv:
the value heads' width, ``--v-head-dim``, as multi-latent attention's; d by default). Tokens/s = S /
the largest rank's CPU seconds. Ratios: zigzag against contiguous (largest rank's CPU time), and each
configuration against cp 1 (per rank).

    python benchmarks/bench_context_parallel.py            # ~10 min on 2 cores
    python benchmarks/bench_context_parallel.py --quick    # tiny shapes, seconds
    python benchmarks/bench_context_parallel.py --head-dim 192 --v-head-dim 128   # MLA's head widths
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ranks import run_ranks  # noqa: E402

VARIANTS = ("ring zigzag", "ring contiguous", "a2a")
ELEM = 4  # fp32


@dataclass(frozen=True)
class Shape:
    heads: int
    groups: int
    head_dim: int  # of queries and keys
    v_head_dim: int  # of values


def _layout(variant: str, seq: int, cp: int):
    from megazero.model.attention.cp.layout import contiguous_layout, zigzag_layout

    return contiguous_layout(seq, cp) if variant == "ring contiguous" else zigzag_layout(seq, cp)


def _inputs(seq: int, shape: Shape, rank: int, cp: int, layout) -> list[torch.Tensor]:
    """This rank's q, k, v (the same full sequence on every rank, split by the layout)."""
    from megazero.model.attention.cp.layout import split_for_rank

    g = torch.Generator().manual_seed(seq)
    widths = ((shape.heads, shape.head_dim), (shape.groups, shape.head_dim), (shape.groups, shape.v_head_dim))
    full = [torch.randn(seq, 1, n, d, generator=g) for n, d in widths]
    return [split_for_rank(t, rank, cp, 0, layout).requires_grad_() for t in full]


def _step(variant: str, layout, rank: int, q, k, v) -> dict[str, int]:
    """Forward and backward once; returns the counters of the exchange."""
    from megazero.model.attention.cp.exchanges import a2a_attention
    from megazero.model.attention.cp.context import ContextParallel
    from megazero.model.attention.cp.ring import RingStats, ring_attention
    from megazero.mpu.cp_exchange import CommCounter

    if variant == "a2a":
        counter = CommCounter()
        shard = ContextParallel.from_layout(layout, rank, None, "a2a").shard
        out = a2a_attention(q, k, v, shard, None, counter=counter)
        out.sum().backward()
        cp, s = layout.cp_size, layout.seq_len
        return dict(fwd_bytes=counter.bytes_sent["forward"], bwd_bytes=counter.bytes_sent["backward"],
                    pairs=s * (s + 1) // 2 // cp)
    stats = RingStats()
    ring_attention(q, k, v, layout, None, stats=stats).sum().backward()
    return dict(fwd_bytes=stats.forward_bytes_sent, bwd_bytes=stats.backward_bytes_sent, pairs=stats.forward_pairs)


def _saved_bytes(variant: str, layout, rank: int, q, k, v) -> int:
    """Bytes of the unique storages autograd saves for backward in one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(variant, layout, rank, q, k, v)
    return sum(seen.values())


def _measure(variant: str, seq: int, shape: Shape, rank: int, cp: int) -> dict[str, Any]:
    from megazero.utils.memory_tracker import LiveMemoryTracker

    layout = _layout(variant, seq, cp)
    q, k, v = _inputs(seq, shape, rank, cp, layout)
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    counts = _step(variant, layout, rank, q, k, v)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    for t in (q, k, v):
        t.grad = None
    dist.barrier()
    saved = _saved_bytes(variant, layout, rank, q, k, v)
    for t in (q, k, v):
        t.grad = None
    dist.barrier()
    with LiveMemoryTracker("cpu", scan_existing=False) as tracker:
        _step(variant, layout, rank, q, k, v)
    return dict(counts, cpu=cpu, wall=wall, peak=tracker.peak_bytes, saved=saved)


def _rank(rank: int, cp: int, configs: list, shape: Shape) -> list[dict]:
    return [_measure(variant, seq, shape, rank, cp) for seq, variant in configs]


def run_cp(cp: int, configs: list, shape: Shape) -> list[list[dict]]:
    """Every (seq, variant) of ``configs`` on ``cp`` ranks: per configuration, the ranks' results."""
    got = run_ranks(cp, _rank, configs, shape)
    return [[got[r][i] for r in range(cp)] for i in range(len(configs))]


def _variants(cp: int, shape: Shape) -> list[str]:
    from megazero.model.attention.cp.exchanges import a2a_head_split

    if cp == 1:
        return ["ring zigzag"]
    try:
        a2a_head_split(shape.heads, shape.groups, cp)
        return list(VARIANTS)
    except ValueError:
        return list(VARIANTS[:2])


def _formula(variant: str, seq: int, cp: int, shape: Shape) -> int:
    """Bytes one rank sends forward: the ring passes K/V on cp-1 times; a2a moves q, k, v and the output."""
    from megazero.model.attention.cp.exchanges import a2a_elements

    if variant == "a2a":
        return a2a_elements(seq, shape.heads, shape.groups, shape.head_dim, cp, v_head_dim=shape.v_head_dim) * ELEM
    return (seq // cp) * shape.groups * (shape.head_dim + shape.v_head_dim) * (cp - 1) * ELEM


def _row(seq: int, cp: int, variant: str, ranks: list[dict], shape: Shape) -> dict[str, Any]:
    cpu = [r["cpu"] for r in ranks]
    pairs = [r["pairs"] for r in ranks]
    formula = _formula(variant, seq, cp, shape)
    return dict(seq=seq, cp=cp, variant=variant, peak=max(r["peak"] for r in ranks),
                saved=max(r["saved"] for r in ranks), cpu_max=max(cpu), cpu_mean=sum(cpu) / cp,
                wall=max(r["wall"] for r in ranks), pairs_max=max(pairs), pairs_mean=sum(pairs) / cp,
                fwd=max(r["fwd_bytes"] for r in ranks), formula=formula, bwd=max(r["bwd_bytes"] for r in ranks),
                tps=seq / max(cpu))


def _print(rows: list[dict]) -> None:
    mib = 2 ** 20
    print(f"{'S':>6} {'cp':>2} {'exchange':<16}{'peak MiB':>9}{'saved MiB':>10}{'CPU s max':>10}{'mean':>7}"
          f"{'max/mean':>9}{'wall s':>8}{'pairs max (M)':>14}{'max/mean':>9}{'fwd MiB sent':>13}{'formula':>8}"
          f"{'bwd MiB':>8}{'tokens/s':>9}")
    for r in rows:
        print(f"{r['seq']:>6} {r['cp']:>2} {r['variant']:<16}{r['peak'] / mib:9.1f}{r['saved'] / mib:10.1f}"
              f"{r['cpu_max']:10.2f}{r['cpu_mean']:7.2f}{r['cpu_max'] / r['cpu_mean']:9.2f}{r['wall']:8.2f}"
              f"{r['pairs_max'] / 1e6:14.2f}{r['pairs_max'] / r['pairs_mean']:9.2f}{r['fwd'] / mib:13.2f}"
              f"{r['formula'] / mib:8.2f}{r['bwd'] / mib:8.2f}{r['tps']:9.0f}")


def _ratios(rows: list[dict]) -> None:
    by = {(r["seq"], r["cp"], r["variant"]): r for r in rows}
    print("\nratios (largest rank): zigzag / contiguous CPU time; configuration / cp 1 peak memory and CPU time")
    for r in rows:
        base: Optional[dict] = by.get((r["seq"], 1, "ring zigzag"))
        line = f"S {r['seq']:>6} cp {r['cp']} {r['variant']:<16}"
        if base:
            line += f" vs cp 1: peak {r['peak'] / base['peak']:.2f}x, CPU {r['cpu_max'] / base['cpu_max']:.2f}x"
        contiguous = by.get((r["seq"], r["cp"], "ring contiguous"))
        if r["variant"] == "ring zigzag" and contiguous:
            line += f"; zigzag / contiguous CPU {r['cpu_max'] / contiguous['cpu_max']:.2f}x"
        print(line)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (S 256, 512; cp 1, 2; 4 heads, head dim 16)")
    p.add_argument("--seqs", type=int, nargs="+", default=None)
    p.add_argument("--cps", type=int, nargs="+", default=None)
    p.add_argument("--head-dim", type=int, default=None, help="query/key head width (default 16 quick, 64)")
    p.add_argument("--v-head-dim", type=int, default=None, help="value head width (default: the head dim)")
    a = p.parse_args(argv)
    d = a.head_dim or (16 if a.quick else 64)
    shape = Shape(4 if a.quick else 8, 2, d, a.v_head_dim or d)
    seqs = a.seqs or ([256, 512] if a.quick else [8192, 16384])
    cps = a.cps or ([1, 2] if a.quick else [1, 2, 4])
    print(f"causal attention, fp32, batch 1, {shape.heads} query heads, {shape.groups} key/value groups, head dim "
          f"{shape.head_dim} (values {shape.v_head_dim}); forward + backward; cp gloo ranks x 1 thread on "
          f"{os.cpu_count()} cores")
    print("peak: live tensor bytes the step allocated at its peak (LiveMemoryTracker; inputs excluded); saved: "
          "tensors saved for backward; CPU s: main-thread CPU time of forward + backward per rank; wall s is "
          "contended; fwd MiB sent vs formula (ring (S/cp) g (d + dv) (cp-1) x 4, "
          "a2a S (heads + g) (d + dv) (cp-1) / cp^2 x 4); tokens/s = S / max CPU s\n")
    rows = []
    for cp in cps:
        configs = [(seq, v) for seq in seqs for v in _variants(cp, shape)]
        for (seq, variant), ranks in zip(configs, run_cp(cp, configs, shape)):
            rows.append(_row(seq, cp, variant, ranks, shape))
    rows.sort(key=lambda r: (r["seq"], r["cp"], VARIANTS.index(r["variant"])))
    _print(rows)
    _ratios(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
