"""Sample text from a megazero checkpoint, at any tensor-parallel size.

    python tools/generate.py --load CKPT_DIR --prompt "ROMEO:" --max-new-tokens 80
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT_DIR --tp 2 --prompt "ROMEO:"

Installed: ``megazero-generate``. The model shape and the tokenizer come from the
checkpoint's config.json. Each process reads (and verifies) only its own TP shard of every
weight, straight from the ZeRO shards whatever tp x dp saved them: nothing holds the whole
model. The text goes to stdout; progress and errors to stderr.
"""

from __future__ import annotations

import argparse
import logging
import torch

from megazero import mpu
from megazero.cli.common import setup_logging, tool_parser
from megazero.data import build_tokenizer
from megazero.model import GPTModel, materialize_
from megazero.model.sampling import generate_text
from megazero.training.checkpointing import CheckpointError, open_checkpoint
from megazero.training.failures import agree, report
from megazero.utils.progress import Progress

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of pretrain_gpt.py)")
    p.add_argument("--ckpt-step", "--iteration", dest="ckpt_step", type=int, default=None,
                   help="the iteration to load (default: the one 'latest' names)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="tensor-parallel size (= the number of processes)")
    p.add_argument("--prompt", "--generate-prompt", dest="prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", "--generate-tokens", dest="max_new_tokens", type=int, default=64,
                   help="tokens to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-model", default=None, help="override the tokenizer file recorded in the checkpoint")
    return p


@torch.no_grad()
def load_tp_shard(config, reader, groups: mpu.ParallelGroups, show_progress: bool = False) -> torch.nn.Module:
    """This process's shard of the model for ``groups``' tensor-parallel rank and size, read slice
    by slice from the checkpoint."""
    model = materialize_(GPTModel(config, device="meta"), mpu.get_device())
    rank, world = groups.tp_rank, groups.tp_size
    params = list(model.named_parameters())

    def load() -> None:
        with Progress("loaded", total=len(params), unit="tensors", logger=log, enabled=show_progress) as progress:
            for name, p in params:
                p.copy_(reader.tp_shard(name, rank, world))
                progress.update()

    agree("checkpoint load", load)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    setup_logging()
    try:
        config, reader, saved = open_checkpoint(args.load, args.ckpt_step)
    except CheckpointError as e:
        p.error(str(e))
    config = config.replace(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                            recompute_granularity=None)
    data = saved["data"]
    tokenizer = build_tokenizer(data["tokenizer_type"],
                                tokenizer_model=args.tokenizer_model or data["tokenizer_model"],
                                vocab_file=data["vocab_file"], merge_file=data["merge_file"],
                                vocab_size=data["vocab_size"])

    torch.set_num_threads(max(1, torch.get_num_threads() // args.tp))
    with mpu.distributed_run() as (rank, _):
        groups = mpu.initialize_model_parallel(args.tp)
        mpu.model_parallel_manual_seed(args.seed)
        try:
            model = load_tp_shard(config, reader, groups, show_progress=rank == 0)
            text = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
            if rank == 0:
                print(text)
        except Exception as e:  # noqa: BLE001 - one line, every rank stops
            return report(e, "generate.py")
    return 0
