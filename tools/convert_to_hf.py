#!/usr/bin/env python
"""Export a full megazero checkpoint to a Hugging Face transformers directory.

The input is a training checkpoint (the ``--save`` directory of pretrain_gpt.py, or one
of its ``iter_*`` directories; any tp x dp x ZeRO stage), a directory with
``model_full.safetensors`` + ``config.json`` (as written by
``megazero.model.state_dict.save_full`` or tools/convert_from_hf.py), or a
``.safetensors``/``.pt`` full state dict with ``--config``. The output loads with
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` as GPT2LMHeadModel (default
architecture) or LlamaForCausalLM (rope + rmsnorm + swiglu). Example::

    python tools/convert_to_hf.py --input ckpt/full --output hf/my-gpt
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.model.hf import export_to_hf  # noqa: E402
from megazero.model.state_dict import load_full  # noqa: E402
from megazero.training.checkpointing import CheckpointError, load_full_model  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="checkpoint directory, or a full state dict file (.safetensors/.pt)")
    p.add_argument("--config", default=None, help="GPTConfig json (default: config.json next to the weights)")
    p.add_argument("--output", required=True, help="directory to write the HF model into")
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer recorded by content (default: the checkpoint's tokenizer/ directory, if any); "
                        "exported beside the model and used for bos/eos ids")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if os.path.isdir(args.input) and not os.path.exists(os.path.join(args.input, "model_full.safetensors")):
            config, full_sd, _ = load_full_model(args.input)
            # Training-only settings do not describe the exported network.
            config = config.replace(recompute_granularity=None, sequence_parallel=False)
        else:
            config, full_sd = load_full(args.input, args.config)
        tokenizer_dir = args.tokenizer_dir
        if tokenizer_dir is None:
            base = args.input if os.path.isdir(args.input) else os.path.dirname(args.input)
            found = os.path.join(base, "tokenizer")
            tokenizer_dir = found if os.path.isfile(os.path.join(found, "megazero_tokenizer.json")) else None
        arch = export_to_hf(full_sd, config, args.output, tokenizer_dir=tokenizer_dir)
    except (ValueError, KeyError, FileNotFoundError, CheckpointError) as e:
        print(f"convert_to_hf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {arch} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
