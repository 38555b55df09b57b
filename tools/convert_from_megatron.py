#!/usr/bin/env python
"""Import a Megatron-LM (legacy mp_rank_XX format) or Megatron-DeepSpeed GPT checkpoint,
at any tp and pp, as a full megazero checkpoint (``model_full.safetensors`` + ``config.json``).

Files are read with ``torch.load(weights_only=True)`` and an explicit allow-list (see
megazero/training/megatron_ckpt.py); nothing in the checkpoint is executed and Megatron
need not be installed. Train from the result with ``--pretrained-checkpoint OUTPUT``.
Example::

    python tools/convert_from_megatron.py --input /ckpt/gpt-1.3b --output ckpt/gpt-1.3b-mz --vocab-size 50257
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.model.state_dict import save_full  # noqa: E402
from megazero.training.megatron_ckpt import import_megatron  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Megatron checkpoint directory (the --save dir or one iteration dir)")
    p.add_argument("--output", required=True, help="directory for model_full.safetensors + config.json")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary (default: the checkpoint's padded vocabulary, every row kept)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, full_sd, info = import_megatron(args.input, vocab_size=args.vocab_size)
        save_full(args.output, full_sd, config)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"convert_from_megatron: error: {e}", file=sys.stderr)
        return 1
    print(f"read {info.get('format')} checkpoint (tp={info.get('tp')}, pp={info.get('pp', 1)}); wrote "
          f"{config.num_layers}-layer {config.hidden_size}-wide GPT to {args.output}")
    if info.get("gelu") == "erf":
        print("note: the run used exact (erf) GeLU (--no-bias-gelu-fusion); megazero's GeLU is the tanh "
              "approximation, so activations differ by up to ~1e-3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
