"""Pre-train a GPT with tensor parallelism and ZeRO (Megatron-LM's flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tp 2 --zero-stage 3 \\
        --model-preset gpt-tiny --data-path PREFIX --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --micro-batch-size 4 --global-batch-size 32 --train-iters 100 \\
        --lr 1e-3 --save ckpt --save-interval 50 --load ckpt

Installed, ``megazero-pretrain-gpt`` is the same program (``torchrun --no-python
megazero-pretrain-gpt ...``). The command line is parsed and checked before
torch.distributed starts, so an impossible configuration exits with a message instead of
hanging a collective.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

PROG = "pretrain_gpt.py"


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flag set (``megazero.training.arguments.build_parser``)."""
    from megazero.training.arguments import build_parser as training_parser

    return training_parser()


def main(argv: list[str] | None = None) -> int:
    from megazero import mpu
    from megazero.training import describe, parse_args_or_exit
    from megazero.training.failures import report
    from megazero.training.trainer import TrainingDiverged, pretrain

    mpu.export_slurm_env()  # under plain `srun`, the world size the parser checks comes from SLURM
    config = parse_args_or_exit(argv)
    if config.parallel.local_rank is not None:  # `deepspeed` / torch.distributed.launch pass --local_rank=N
        os.environ.setdefault("LOCAL_RANK", str(config.parallel.local_rank))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, torch.get_num_threads() // max(1, config.parallel.world_size)))
    with mpu.distributed_run(config.parallel.distributed_backend) as (rank, _):
        if rank == 0:
            print(describe(config), flush=True)
        try:
            pretrain(config)
        except TrainingDiverged as e:
            print(f"error on rank {rank}: {e}", file=sys.stderr, flush=True)
            return 1
        except Exception as e:  # noqa: BLE001 - one line per failure (a traceback only for internal errors)
            return report(e, PROG)
    return 0
