"""Rehearse ranks of a pretrain_gpt.py launch on this host: memory and traffic per rank, no GPU.

    python tools/rehearse.py --world-size 64 [--ranks 0,13] [--json out.json] [--device-memory-gb 80] \\
        --tp 4 --zero-stage 3 --num-layers 40 --hidden-size 5120 ... (pretrain_gpt.py's flags)

Installed: ``megazero-rehearse``. The flags are pretrain_gpt.py's, as tools/estimate_memory.py takes
them (the training-only ones, --lr, --train-iters, the data and the tokenizer, may be left out), and
this tool's own; the two sets share no name, so a ``--`` before pretrain_gpt.py's is optional. Each
rank runs pretrain_gpt.py's own loop (megazero.training.trainer.pretrain) for two iterations at the
real shapes, on the meta device and a fake process group, in this one process. Per rank: the state it
keeps between iterations, its peak in iteration 2 (by kind), the bytes it sends per group, and the
host reads the loop makes. Default ranks: first and last pipeline stage x first and last
data-parallel rank, tensor-parallel rank 0. What is measured and how:
megazero/observe/rehearsal.py.

Exit status: 0 fits, 1 a rank's peak plus its NCCL communicators (estimate) exceeds --device-memory-gb, 2 invalid flags, 3 the run failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Optional, Sequence

# Destroying a fake process group that serves two device types warns once per group ("No backend
# of type 0 found ... Assuming no hooks are registered"): C++ warnings off unless asked for.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from megazero.cli.common import setup_logging, write_output  # noqa: E402
from megazero.cli.planning import add_device_memory, planning_parser, split_own  # noqa: E402
from megazero.config.train_config import ConfigError  # noqa: E402
from megazero.observe.planner import GiB  # noqa: E402
from megazero.observe.rehearsal import default_ranks, format_report, launch_line, rehearsal_config, rehearse, write_json  # noqa: E402
from megazero.utils.progress import Progress  # noqa: E402

log = logging.getLogger(__name__)


def _add_own(add: Callable) -> None:
    add("--world-size", type=int, help="ranks of the launch being rehearsed (required)")
    add("--ranks", help="comma-separated global ranks to rehearse (default: one per distinct role)")
    add("--json", help="write the figures of every rank to this file")
    add_device_memory(add, "a larger peak plus the NCCL estimate exits 1")
    add("--micro-batches", type=int,
        help="rehearse this many micro-batches per iteration instead of the global batch's (faster; "
             "the peak is the same from pp x v on; bytes sent are then for this many)")
    add("--verbose", action="store_true", help="show pretrain's own output for each rank")


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flags and this tool's own (its --help)."""
    return planning_parser("rehearse.py", __doc__, _add_own)


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this tool's flags, pretrain_gpt.py's): the two sets share no name, so each word is told by its
    flag wherever it stands; a ``--`` between them is optional."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return split_own(argv[:cut] + argv[cut + 1:], _add_own)


def _run(config, ranks: list[int], verbose: bool):
    with Progress("rehearsed", total=len(ranks), unit="ranks", logger=log, interval=0.0) as progress:
        def on_rank(report) -> None:
            write_output(format_report(report))
            progress.update()
        return rehearse(config, ranks, log=sys.stdout if verbose else None, on_rank=on_rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    head = words[:words.index("--")] if "--" in words else words
    if "-h" in head or "--help" in head:
        build_parser().print_help()
        return 0
    try:
        args, train = _split(words)
        if args.world_size is None:
            raise ConfigError("give --world-size (the ranks of the launch being rehearsed)")
        config, notes = rehearsal_config(train, args.world_size, args.micro_batches, parser=build_parser())
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else default_ranks(config)
        bad = [r for r in ranks if not 0 <= r < args.world_size]
        if bad:
            raise ConfigError(f"--ranks {bad}: outside the world of {args.world_size} ranks")
    except (ConfigError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    write_output(f"rehearsal of {launch_line(config)}; ranks {', '.join(map(str, ranks))}")
    for n in notes:
        write_output(f"  > {n}")
    try:
        reports = _run(config, ranks, args.verbose)
    except Exception:  # noqa: BLE001 - the run itself failed: its traceback, then exit 3
        log.exception("error: the rehearsed run failed")
        return 3
    if args.json:
        write_json(args.json, reports, config, notes)
    limit = args.device_memory_gb * GiB
    # A GPU holds the NCCL communicators' buffers beside the rehearsed tensors (an estimate).
    over = [r for r in reports if r.peak_bytes + r.nccl_bytes > limit]
    for r in over:
        log.error(f"rank {r.rank}: peak {r.peak_bytes / GiB:.2f} GiB + NCCL communicators ~{r.nccl_bytes / GiB:.2f} "
                  f"GiB (estimate) exceeds --device-memory-gb {args.device_memory_gb:g}")
    return 1 if over else 0
