"""Time to resume or initialize a run, per rank, from the layout: bytes read at resume, values drawn.

    python tools/estimate_startup.py --world-size 64 --model-preset gpt-13b --tp 4 --zero-stage 3 ...

The flags are pretrain_gpt.py's, as tools/estimate_memory.py takes them (megazero/cli/planning.py);
this tool's own: --world-size, --read-gbps-per-rank, --fs-gbps. Installed: ``megazero-estimate-startup``.
Read bandwidths are stated (flags; they belong to the cluster); the sha256 and initialization rates
are measured here (one thread).
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Optional, Sequence

from megazero.cli.common import write_output
from megazero.cli.planning import plan_config, planning_parser, tool_args
from megazero.config.train_config import ConfigError
from megazero.observe.startup import estimate_startup, measure_rates

log = logging.getLogger(__name__)


def _add_own(add: Callable) -> None:
    add("--world-size", type=int, help="ranks of the launch (torchrun's world size)")
    add("--read-gbps-per-rank", type=float, default=1.0, help="GB/s one rank reads from the filesystem")
    add("--fs-gbps", type=float, default=40.0, help="GB/s the filesystem serves to all ranks together")
    add("--train-args", action="store_true", help=argparse.SUPPRESS)  # an earlier spelling: not needed


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flags and this tool's own (its --help)."""
    return planning_parser("estimate_startup.py", __doc__, _add_own)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parsed = tool_args(argv, build_parser, _add_own)
    if isinstance(parsed, int):
        return parsed
    own, rest = parsed
    try:
        if own.world_size is None:
            raise ConfigError("give --world-size (the ranks torchrun would start for this launch)")
        cfg = plan_config(rest, own.world_size, build_parser())
    except (ConfigError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    sha, rate = measure_rates()
    est = estimate_startup(cfg.model, tp=cfg.parallel.tp, dp=cfg.parallel.dp, zero_stage=cfg.parallel.zero_stage,
                           read_gbps_per_rank=own.read_gbps_per_rank, fs_gbps=own.fs_gbps, sha256_gbps=sha,
                           init_values_per_s=rate)
    write_output(est.to_text())
    return 0
