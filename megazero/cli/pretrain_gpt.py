"""Pre-train a GPT with tensor parallelism and ZeRO (Megatron-LM's flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tp 2 --zero-stage 3 \\
        --model-preset gpt-tiny --data-path PREFIX --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --micro-batch-size 4 --global-batch-size 32 --train-iters 100 \\
        --lr 1e-3 --save ckpt --save-interval 50 --load ckpt

Installed, ``megazero-pretrain-gpt`` is the same program (``torchrun --no-python
megazero-pretrain-gpt ...``). The command line is parsed and checked before
torch.distributed starts, so an impossible configuration exits with a message instead of
hanging a collective.

What the run reports goes through logging (``megazero.training.*`` and this module's logger): for
the program's duration INFO records reach stdout and warnings and errors stderr, one plain line each
(``megazero.utils.output.console``).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Sequence

import torch

PROG = "pretrain_gpt.py"

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flag set (``megazero.config.arguments.build_parser``)."""
    from megazero.config.arguments import build_parser as training_parser

    return training_parser()


def main(argv: list[str] | None = None, *, callbacks: Sequence = ()) -> int:
    """Parse ``argv``, train, and return the exit status: 0 done (or a planned exit), 1 a failure
    during the run, 2 (``SystemExit``) a configuration refused before starting. ``callbacks``
    (``megazero.training.loop.Callback``) hear the training loop's events. A failure is one line,
    logged once and left in torchrun's error file (its summary's root cause then shows it)."""
    from megazero.utils.output import RUN_LOGGERS, console

    with console(*RUN_LOGGERS, __name__):
        return _main(argv, callbacks)


def _main(argv: list[str] | None, callbacks: Sequence) -> int:
    from megazero import mpu
    from megazero.config import describe, parse_args_or_exit
    from megazero.training.trainer import TrainingDiverged, pretrain
    from megazero.utils.output import write_error_file
    from megazero.utils.phase_agreement import report

    mpu.export_slurm_env()  # under plain `srun`, the world size the parser checks comes from SLURM
    config = parse_args_or_exit(argv)
    if config.parallel.local_rank is not None:  # `deepspeed` / torch.distributed.launch pass --local_rank=N
        os.environ.setdefault("LOCAL_RANK", str(config.parallel.local_rank))
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the host's cores; a thread count the user chose (OMP_NUM_THREADS) is kept.
        torch.set_num_threads(max(1, torch.get_num_threads() // max(1, config.parallel.world_size)))
    with mpu.distributed_run(config.parallel.distributed_backend,
                             config.parallel.distributed_timeout_minutes * 60) as (rank, _):
        if rank == 0:
            log.info(describe(config))
        try:
            pretrain(config, callbacks=callbacks)
        except TrainingDiverged as e:  # found alike on every rank (the losses are reduced): said once
            if rank == 0:
                log.error(f"{PROG}: {e}")
            write_error_file(f"{PROG}: {e}")
            return 1
        except Exception as e:  # noqa: BLE001 - one line per failure (a traceback only for internal errors)
            return report(e, PROG)
    return 0
