"""Time to resume or initialize a run, per rank, from the layout: bytes read at resume, values drawn.

    python tools/estimate_startup.py --world-size 64 --train-args --model-preset gpt-13b --tp 4 --zero-stage 3 ...

Installed: ``megazero-estimate-startup``. Read bandwidths are stated (flags; they belong to
the cluster); the sha256 and initialization rates are measured here (one thread).
"""

from __future__ import annotations

import argparse
import logging

from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.training.arguments import ConfigError, parse_args
from megazero.training.startup import estimate_startup, measure_rates

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--world-size", type=int, required=True, help="ranks of the launch")
    p.add_argument("--read-gbps-per-rank", type=float, default=1.0, help="GB/s one rank reads from the filesystem")
    p.add_argument("--fs-gbps", type=float, default=40.0, help="GB/s the filesystem serves to all ranks together")
    p.add_argument("--train-args", nargs=argparse.REMAINDER, required=True, help="pretrain_gpt.py's arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging()
    try:
        cfg = parse_args(a.train_args, a.world_size, check_files=False)
    except (ConfigError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    sha, rate = measure_rates()
    est = estimate_startup(cfg.model, tp=cfg.parallel.tp, dp=cfg.parallel.dp, zero_stage=cfg.parallel.zero_stage,
                           read_gbps_per_rank=a.read_gbps_per_rank, fs_gbps=a.fs_gbps, sha256_gbps=sha,
                           init_values_per_s=rate)
    write_output(est.to_text())
    return 0
