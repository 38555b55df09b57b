#!/usr/bin/env python
"""Import a local Hugging Face GPT-2 or Llama checkpoint as a full megazero checkpoint.

Writes ``model_full.safetensors`` + ``config.json`` (a GPTConfig) into ``--output``;
training loads it with ``megazero.model.state_dict.load_full`` +
``load_full_state_dict`` at any TP size. Only safetensors is needed, not transformers.
Example::

    python tools/convert_from_hf.py --input hf/gpt2 --output ckpt/gpt2 \\
        --override seq_length=1024 --override make_vocab_size_divisible_by=128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.model.hf import import_from_hf  # noqa: E402
from megazero.model.state_dict import save_full  # noqa: E402


def _override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--override expects FIELD=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string, e.g. attention_backend=sdpa


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="local HF model directory (config.json + weights)")
    p.add_argument("--output", required=True, help="directory for model_full.safetensors + config.json")
    p.add_argument("--override", action="append", type=_override, default=[], metavar="FIELD=VALUE",
                   help="set a GPTConfig field (JSON value), repeatable")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, full_sd = import_from_hf(args.input, **dict(args.override))
        save_full(args.output, full_sd, config)
    except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
        print(f"convert_from_hf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {config.num_layers}-layer {config.hidden_size}-wide GPT to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
