"""Import a Megatron-LM (legacy mp_rank_XX format) or Megatron-DeepSpeed GPT checkpoint,
at any tp and pp, as a full megazero checkpoint (``model_full.safetensors`` + ``config.json``).

Files are read with ``torch.load(weights_only=True)`` and an explicit allow-list (see
megazero/training/megatron_ckpt.py); nothing in the checkpoint is executed and Megatron
need not be installed. Train from the result with ``--pretrained-checkpoint OUTPUT``.
Example::

    python tools/convert_from_megatron.py --input /ckpt/gpt-1.3b --output ckpt/gpt-1.3b-mz --vocab-size 50257

Installed: ``megazero-convert-from-megatron``.
"""

from __future__ import annotations

import argparse
import logging
import os

from megazero.cli.common import setup_logging, tool_parser
from megazero.model.state_dict import save_full
from megazero.training.megatron_ckpt import import_megatron, load_megatron_file
from megazero.utils.progress import Progress

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--input", required=True, help="Megatron checkpoint directory (the --save dir or one iteration dir)")
    p.add_argument("--output", required=True, help="directory for model_full.safetensors + config.json")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary (default: the checkpoint's padded vocabulary, every row kept)")
    return p


def _counted_load(progress: Progress):
    def load(path: str) -> dict:
        state = load_megatron_file(path)
        progress.update(postfix=os.path.basename(path))
        return state
    return load


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        with Progress("read", unit="checkpoint files", logger=log) as progress:
            config, full_sd, info = import_megatron(args.input, vocab_size=args.vocab_size,
                                                    load=_counted_load(progress))
        save_full(args.output, full_sd, config)
    except (ValueError, KeyError, FileNotFoundError) as e:
        log.error("convert_from_megatron: error: %s", e)
        return 1
    log.info("read %s checkpoint (tp=%s, pp=%s); wrote %d-layer %d-wide GPT to %s", info.get("format"), info.get("tp"),
             info.get("pp", 1), config.num_layers, config.hidden_size, args.output)
    if info.get("gelu") == "erf":
        log.warning("note: the run used exact (erf) GeLU (--no-bias-gelu-fusion); megazero's GeLU is the tanh "
                    "approximation, so activations differ by up to ~1e-3")
    return 0
