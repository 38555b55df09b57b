#!/usr/bin/env python
"""The chunked delta rules, forward + backward: Gated DeltaNet against a baseline revision of ``delta_rule.py``, and
Kimi Delta Attention (one decay per key channel) against Gated DeltaNet and transformers' torch fallback.

Rows (all chunk 64, fp32 inputs, random documents off):

* ``gdn``: ``chunk_gated_delta_rule`` of this checkout; ``gdn@REF``: the same function from ``git show
  REF:megazero/model/recurrent/delta_rule.py`` (``--baseline REF``, default ``main``; skipped when that file
  imports more than torch, or git is absent);
* ``kda``: ``chunk_kda_rule``; ``kda-hf``: transformers' ``chunk_kimi_delta_attention`` (its torch fallback).

Timing: on the CPU, the main thread's CPU time (``time.thread_time``, one thread: the figure that holds up on shared
cores); on CUDA, wall time after a synchronize. The rows run in turn (the order reversed every other round),
``--repeats`` rounds, after one warm-up round; the table gives each row's median and its ratio to ``gdn`` (median
of the per-round ratios, and their range: the noise).

    python benchmarks/bench_delta_rule.py                      # CPU, B1 T1024 H4 dk=dv=64, ~1 min
    python benchmarks/bench_delta_rule.py --device cuda --seq 8192 --heads 16 --dim 128
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megazero.model.recurrent.delta_rule import chunk_gated_delta_rule  # noqa: E402
from megazero.model.recurrent.kda_rule import chunk_kda_rule  # noqa: E402

log = logging.getLogger("bench_delta_rule")
ROOT = Path(__file__).resolve().parents[1]


def _baseline(ref: str) -> Optional[Callable]:
    """``chunk_gated_delta_rule`` of revision ``ref`` (None when it cannot be loaded on its own)."""
    try:
        text = subprocess.run(["git", "show", f"{ref}:megazero/model/recurrent/delta_rule.py"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("no baseline %s: %s", ref, e)
        return None
    if "from ." in text:
        log.warning("baseline %s imports its package's modules; skipped", ref)
        return None
    path = Path(tempfile.mkdtemp()) / "baseline_delta_rule.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("baseline_delta_rule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chunk_gated_delta_rule


def _inputs(B: int, T: int, H: int, D: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = F.normalize(r(B, T, H, D), dim=-1), F.normalize(r(B, T, H, D), dim=-1)
    v, beta = r(B, T, H, D), torch.sigmoid(r(B, T, H))
    g_head, g_channel = F.logsigmoid(r(B, T, H) + 2), F.logsigmoid(r(B, T, H, D) + 2)
    return [x.to(device) for x in (q, k, v, g_head, g_channel, beta)]


def _step(fn: Callable, args: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        leaves = [a.detach().requires_grad_() for a in args]
        o, s = fn(*leaves)
        (o.sum() + s.sum()).backward()
    return run


def _clock(run: Callable[[], None], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return time.perf_counter() - t
    t = time.thread_time()
    run()
    return time.thread_time() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", default="main")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' chunk_kimi_delta_attention")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.device == "cpu":
        torch.set_num_threads(1)
    q, k, v, g_head, g_channel, beta = _inputs(a.batch, a.seq, a.heads, a.dim, a.device)
    rows = {"gdn": _step(chunk_gated_delta_rule, [q, k, v, g_head, beta])}
    old = _baseline(a.baseline) if a.baseline else None
    if old is not None:
        rows[f"gdn@{a.baseline}"] = _step(old, [q, k, v, g_head, beta])
    rows["kda"] = _step(chunk_kda_rule, [q, k, v, g_channel, beta])
    if not a.no_hf:
        from transformers.models.kimi_linear import modeling_kimi_linear as hf
        logging.getLogger("transformers").setLevel(logging.ERROR)
        hf_kda = lambda q, k, v, g, beta: hf.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta,
                                                                         output_final_state=True)
        rows["kda-hf"] = _step(hf_kda, [q, k, v, g_channel, beta])
    times: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(a.repeats + 1):
        order = list(rows.items())
        for name, run in order if round_ % 2 else order[::-1]:  # alternate the order: no row always runs first
            t = _clock(run, a.device)
            if round_:
                times[name].append(t)
    log.info("B%d T%d H%d dk=dv=%d chunk 64, %s, forward + backward, median of %d", a.batch, a.seq, a.heads, a.dim,
             a.device, a.repeats)
    log.info("%-12s %10s %22s", "rule", "seconds", "ratio to gdn [range]")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["gdn"])]
        log.info("%-12s %10.4f %8.3f [%.3f, %.3f]", name, statistics.median(ts), statistics.median(ratios),
                 min(ratios), max(ratios))


if __name__ == "__main__":
    main()
