"""Sample text from a megazero checkpoint, at any tensor-parallel size.

    python tools/generate.py --load CKPT_DIR --prompt "ROMEO:" --max-new-tokens 80
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT_DIR --tp 2 --prompt "ROMEO:"
    python tools/generate.py --load CONVERTED_DIR --temperature 0 --prompt "Hello"

Installed: ``megazero-generate``. ``--load`` is a --save directory of pretrain_gpt.py in either
--ckpt-format, or of Megatron-LM's torch_dist (its latest iteration, or --ckpt-step), one of its iter_*
directories, or a full checkpoint as tools/convert_from_hf.py and tools/convert_from_megatron.py write it. The model shape comes from
the checkpoint's config.json; the tokenizer from the checkpoint's tokenizer/ directory (else the
tokenizer files its run named), unless --tokenizer-type gives one. A checkpoint without a
tokenizer reads and writes token ids as text (Megatron's NullTokenizer: ``--prompt "17 4 99"``).
Each process reads only its own TP shard of every weight (straight from the ZeRO shards, whatever
tp x dp saved them, from the torch_dist chunks, or from the full weights): nothing holds the whole model. The text goes to
stdout; progress and errors to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from megazero import mpu
from megazero.checkpoint.native import CheckpointError
from megazero.checkpoint.reader import checkpoint_tokenizer_dir, open_checkpoint
from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.config.train_config import GenerateConfig
from megazero.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer
from megazero.data.tokenizer_files import load_tokenizer_from_dir, recorded_tokenizer_args
from megazero.model import GPTModel, materialize_
from megazero.model.sampling import generate_text
from megazero.utils.phase_agreement import agree, report
from megazero.utils.progress import Progress

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--load", required=True,
                   help="checkpoint directory: the --save of pretrain_gpt.py (either --ckpt-format) or of Megatron-LM "
                        "(torch_dist), one iter_* directory, or a full checkpoint (tools/convert_from_hf.py --output)")
    p.add_argument("--ckpt-step", "--iteration", dest="ckpt_step", type=int, default=None,
                   help="the iteration to load (default: the one 'latest' names)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                   help="tensor-parallel size (= the number of processes)")
    p.add_argument("--prompt", "--generate-prompt", dest="prompt", default="",
                   help="text to continue (token ids separated by spaces with NullTokenizer)")
    p.add_argument("--max-new-tokens", "--generate-tokens", dest="max_new_tokens", type=int,
                   default=GenerateConfig.tokens, help="tokens to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities sum to p (nucleus); 1 = all")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling (the same on every rank)")
    p.add_argument("--distributed-timeout-minutes", type=float, default=10.0, metavar="MINUTES",
                   help="collective timeout of every process group, as pretrain_gpt.py's (default: %(default)g)")
    g = p.add_argument_group("tokenizer (default: the checkpoint's)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="use this tokenizer instead of the checkpoint's, with the file flags below")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model or Hugging Face tokenizer directory (without --tokenizer-type: "
                        "replaces the file of the checkpoint's tokenizer type)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (ids 0..N-1; its end-of-document id is N) "
                        "(default: the model's vocabulary less one)")
    return p


def resolve_tokenizer(args: argparse.Namespace, saved: dict, vocab_size: int) -> Tokenizer:
    """The tokenizer to read the prompt and write the text with: --tokenizer-type with its files, else the
    checkpoint's recorded tokenizer/ (its type with the file flags given instead of its files, if any),
    else the tokenizer its run named, else NullTokenizer over the model's ``vocab_size``."""
    given = {k: v for k, v in (("tokenizer_model", args.tokenizer_model), ("vocab_file", args.vocab_file),
                               ("merge_file", args.merge_file)) if v is not None}
    recorded = checkpoint_tokenizer_dir(args.load, args.ckpt_step)
    known: dict = {}
    if args.tokenizer_type is not None:
        kind = args.tokenizer_type
    elif recorded is not None:
        if not given:
            return load_tokenizer_from_dir(recorded)
        kind, known = recorded_tokenizer_args(recorded)
    else:  # a checkpoint from before tokenizers were recorded: the files its run named
        data = saved.get("data") or {}
        kind = data.get("tokenizer_type")
        known = {k: data[k] for k in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size", "vocab_extra_ids")
                 if data.get(k)}
    if kind is None:
        kind = "NullTokenizer"
        log.info("no tokenizer in %s: the prompt and the output are token ids", args.load)
    kwargs = {**known, **given}
    if kind == "NullTokenizer":
        kwargs["vocab_size"] = args.vocab_size or known.get("vocab_size") or vocab_size - 1
    return build_tokenizer(kind, **kwargs)


@torch.no_grad()
def load_tp_shard(config, reader, groups: mpu.ParallelGroups, show_progress: bool = False) -> torch.nn.Module:
    """This process's shard of the model for ``groups``' tensor-parallel rank and size, read slice
    by slice from the checkpoint."""
    model = materialize_(GPTModel(config, device="meta"), mpu.get_device())
    rank, world = groups.tp_rank, groups.tp_size
    # the persistent buffers too (the routers' expert bias): the model's function depends on them
    stored, persistent = set(reader.names), model.state_dict().keys()
    buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
    missing = [n for n, _ in buffers if n not in stored]
    if missing:
        raise CheckpointError(f"the checkpoint has no {missing[:3]}: it was saved by a model without them (e.g. "
                              "without --moe-router-enable-expert-bias); serve it with the config it was trained with")
    params = list(model.named_parameters()) + buffers

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
    from megazero.config.resolve.parallel import timeout_problem

    problem = timeout_problem(args.distributed_timeout_minutes)
    if problem:
        p.error(problem)
    if not os.path.isdir(args.load):
        p.error(f"--load {args.load} is not a directory")
    try:
        config, reader, saved = open_checkpoint(args.load, args.ckpt_step)
        tokenizer = resolve_tokenizer(args, saved, config.vocab_size)
    except (CheckpointError, ValueError, OSError) as e:
        p.error(str(e))
    if tokenizer.vocab_size > config.padded_vocab_size:
        p.error(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.padded_vocab_size}: "
                "give the model's tokenizer (--tokenizer-type and its files, or --vocab-size)")
    config = config.replace(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                            recompute_granularity=None, sequence_parallel=False)

    torch.set_num_threads(max(1, torch.get_num_threads() // args.tp))
    with mpu.distributed_run(timeout_s=args.distributed_timeout_minutes * 60) as (rank, _):
        groups = mpu.initialize_model_parallel(args.tp)
        mpu.model_parallel_manual_seed(args.seed)
        try:
            model = load_tp_shard(config, reader, groups, show_progress=rank == 0)
            text = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
            if rank == 0:
                write_output(text)
        except Exception as e:  # noqa: BLE001 - one line, every rank stops
            return report(e, "generate.py")
    return 0
