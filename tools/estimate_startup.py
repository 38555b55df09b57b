#!/usr/bin/env python
"""Time to resume or initialize a run, per rank, from the layout: bytes read at resume, values drawn.

    python tools/estimate_startup.py --world-size 64 --train-args --model-preset gpt-13b --tp 4 --zero-stage 3 ...

Read bandwidths are stated (flags; they belong to the cluster); the sha256 and
initialization rates are measured on this machine (one thread).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.training.arguments import ConfigError, parse_args  # noqa: E402
from megazero.training.startup import estimate_startup, measure_rates  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--read-gbps-per-rank", type=float, default=1.0, help="GB/s one rank reads from the filesystem")
    p.add_argument("--fs-gbps", type=float, default=40.0, help="GB/s the filesystem serves to all ranks together")
    p.add_argument("--train-args", nargs=argparse.REMAINDER, required=True, help="pretrain_gpt.py's arguments")
    a = p.parse_args(argv)
    try:
        cfg = parse_args(a.train_args, a.world_size, check_files=False)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sha, rate = measure_rates()
    est = estimate_startup(cfg.model, tp=cfg.parallel.tp, dp=cfg.parallel.dp, zero_stage=cfg.parallel.zero_stage,
                           read_gbps_per_rank=a.read_gbps_per_rank, fs_gbps=a.fs_gbps, sha256_gbps=sha,
                           init_values_per_s=rate)
    print(est.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
