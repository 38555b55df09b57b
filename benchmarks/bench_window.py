#!/usr/bin/env python
"""Sliding-window attention against full causal attention of the same shape, on the CPU.

* **core**: ``core_attention`` forward + backward (``backend='sdpa'``: full attention is torch's fused SDPA,
  a window runs the block kernels on the cells the window reaches) at each sequence length, for each
  window and for full attention, batch 1, fp32, one thread. The windows and the full run alternate
  (full, w1, w2, ..., then again) ``--repeats`` times; the table gives the medians of the thread CPU time,
  the median of the per-round ratios full / window, and the peak of the live tensors one step allocated
  (``LiveMemoryTracker``; the inputs excluded).
* **ring**: the query-key pairs a rank computes at cp 4 (zigzag), with and without the window
  (:func:`~megazero.model.attention.cp.layout.work_per_rank`: the planned blocks, which the ring's counters
  match in the tests), and the key/value bytes a rank sends forward: the halo exchange's (only the keys
  other ranks' windows reach, :mod:`~megazero.model.attention.cp.halo`) or the ring's (P - 1 whole shards).

    python benchmarks/bench_window.py            # ~3 min on 2 shared cores
    python benchmarks/bench_window.py --tiny     # seconds
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megazero.model.attention.core import core_attention  # noqa: E402
from megazero.model.attention.cp.halo import halo_of  # noqa: E402
from megazero.model.attention.cp.layout import work_per_rank, zigzag_layout  # noqa: E402
from megazero.utils.memory_tracker import LiveMemoryTracker  # noqa: E402

log = logging.getLogger("bench_window")
MIB = 2 ** 20


def _inputs(seq: int, heads: int, groups: int, dim: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, heads, dim, generator=g).requires_grad_()
    k, v = (torch.randn(seq, 1, groups, dim, generator=g).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(seq, 1, heads * dim, generator=g)


def _step(inputs, window: Optional[int]) -> None:
    q, k, v, grad = inputs
    core_attention(q, k, v, backend="sdpa", window=window).backward(grad)


def _timed(inputs, window: Optional[int]) -> float:
    start = time.thread_time()
    _step(inputs, window)
    return time.thread_time() - start


def _peak(inputs, window: Optional[int]) -> int:
    with LiveMemoryTracker("cpu", scan_existing=False) as tracker:
        _step(inputs, window)
    return tracker.peak_bytes


def core_table(seqs, windows, heads: int, groups: int, dim: int, repeats: int) -> list[str]:
    rows = [f"| tokens | window | fwd+bwd ms | full / window (range) | peak MiB | full's peak MiB |",
            "|---:|---:|---:|---:|---:|---:|"]
    for seq in seqs:
        inputs = _inputs(seq, heads, groups, dim)
        kinds = [None] + [w for w in windows if w + 1 < seq]
        _step(inputs, None)  # warm-up
        times: dict = {w: [] for w in kinds}
        for _ in range(repeats):
            for w in kinds:
                times[w].append(_timed(inputs, w))
        full_peak = _peak(inputs, None)
        for w in kinds[1:]:
            ratios = sorted(a / b for a, b in zip(times[None], times[w]))
            rows.append(f"| {seq} | {w} | {1e3 * statistics.median(times[w]):.0f} | "
                        f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
                        f"{_peak(inputs, w) / MIB:.1f} | {full_peak / MIB:.1f} |")
        rows.append(f"| {seq} | full | {1e3 * statistics.median(times[None]):.0f} | 1.00x | {full_peak / MIB:.1f} | |")
    return rows


def ring_table(seqs, windows, cp: int, heads: int, groups: int, dim: int) -> list[str]:
    rows = ["| tokens | window | pairs per rank (max) | full's | fraction | exchange | K/V sent per rank, fwd | "
            "the ring's |", "|---:|---:|---:|---:|---:|---|---:|---:|"]
    per_token = groups * 2 * dim * 4  # K and V of one token, fp32
    for seq in seqs:
        layout = zigzag_layout(seq, cp)
        full = max(work_per_rank(layout))
        ring = (seq // cp) * per_token * (cp - 1)  # P - 1 hops of a whole shard
        for w in windows:
            pairs = max(work_per_rank(layout, w))
            halos = [halo_of((layout,), r, w) for r in range(cp)]
            kind = "halo" if halos[0] is not None else "ring"
            sent = ring if kind == "ring" else max(sum(hi - lo for _, lo, hi in h.send) for h in halos) * per_token
            rows.append(f"| {seq} | {w} | {pairs:,} | {full:,} | {pairs / full:.3f} | {kind} | "
                        f"{sent / MIB:.2f} MiB | {ring / MIB:.1f} MiB |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--windows", type=int, nargs="+", default=[127, 1023])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ring-seqs", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--tiny", action="store_true", help="seconds: short sequences, small heads")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(a)
    finally:
        torch.set_num_threads(threads)


def _run(a: argparse.Namespace) -> int:
    if a.tiny:
        a.seqs, a.windows, a.heads, a.groups, a.dim, a.repeats, a.ring_seqs = [256], [15], 2, 2, 16, 1, [1024]
    log.info("core_attention forward + backward, fp32, batch 1, %d heads (%d KV groups) of %d, one thread, "
             "%d rounds", a.heads, a.groups, a.dim, a.repeats)
    log.info("\n".join(core_table(a.seqs, a.windows, a.heads, a.groups, a.dim, a.repeats)))
    log.info("ring attention at cp 4 (zigzag): pairs the busiest rank computes, and what it sends")
    log.info("\n".join(ring_table(a.ring_seqs, a.windows, 4, a.heads, a.groups, a.dim)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
