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

Safetensors inputs are converted one layer at a time and streamed into the output file,
so memory stays at about one layer's tensors whatever the model size (13B included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megazero.data.hf_tokenizer import export_tokenizer_to_hf  # noqa: E402
from megazero.model import GPTConfig  # noqa: E402
from megazero.model.hf import build_hf_config, export_to_hf, set_token_ids, to_hf_state_dict  # noqa: E402
from megazero.model.state_dict import CONFIG_NAME, FULL_WEIGHTS_NAME, convert_streaming, load_full  # noqa: E402
from megazero.training.checkpointing import CheckpointError, open_checkpoint, resolve_checkpoint_dir  # noqa: E402
from megazero.utils.optional_deps import require_packages  # noqa: E402
from megazero.zero.shard_io import ReadCounter, ShardFile  # noqa: E402

TOOL = "convert_to_hf"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="checkpoint directory, or a full state dict file (.safetensors/.pt)")
    p.add_argument("--config", default=None, help="GPTConfig json (default: config.json next to the weights)")
    p.add_argument("--output", required=True, help="directory to write the HF model into")
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer recorded by content (default: the checkpoint's tokenizer/ directory, if any); "
                        "exported beside the model and used for bos/eos ids")
    return p


def _source(args):
    """(config, names, read, meta) of a streamable input; None for a .pt state dict."""
    if os.path.isdir(args.input) and not os.path.exists(os.path.join(args.input, FULL_WEIGHTS_NAME)):
        config, reader, _ = open_checkpoint(args.input)
        # Training-only settings do not describe the exported network.
        config = config.replace(recompute_granularity=None, sequence_parallel=False)
        return (config, reader.names, reader.full,
                lambda n: torch.empty(reader.full_shape(n), dtype=torch.float32, device="meta"))
    weights = os.path.join(args.input, FULL_WEIGHTS_NAME) if os.path.isdir(args.input) else args.input
    if not weights.endswith(".safetensors"):
        return None
    config_path = args.config or os.path.join(os.path.dirname(weights), CONFIG_NAME)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config at {config_path}; pass --config")
    config = GPTConfig.from_dict(json.load(open(config_path)))
    f = ShardFile(weights, None, ReadCounter())
    return config, f.keys(), f.tensor, lambda n: torch.empty(f.shape(n), dtype=f.dtype(n), device="meta")


def _tokenizer_type(tokenizer_dir: str) -> str | None:
    try:
        with open(os.path.join(tokenizer_dir, "megazero_tokenizer.json")) as f:
            return json.load(f).get("type")
    except (OSError, ValueError, AttributeError):
        return None  # the export itself reports what is wrong with the directory


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_packages(TOOL, ["transformers"], "hf", "writing a Hugging Face model")
    try:
        source = _source(args)
        tokenizer_dir = args.tokenizer_dir
        if tokenizer_dir is None:
            base = args.input if os.path.isdir(args.input) else os.path.dirname(args.input)
            if source is not None and os.path.isdir(args.input) and not os.path.exists(
                    os.path.join(args.input, FULL_WEIGHTS_NAME)):
                base = resolve_checkpoint_dir(args.input)  # a --save directory: its latest iteration
            found = os.path.join(base, "tokenizer")
            tokenizer_dir = found if os.path.isfile(os.path.join(found, "megazero_tokenizer.json")) else None
        if tokenizer_dir is not None and _tokenizer_type(tokenizer_dir) in SENTENCEPIECE_TYPES:
            # transformers converts the SentencePiece model to its tokenizer.json with protobuf
            require_packages(TOOL, ["sentencepiece", "google.protobuf"], "hf", "exporting a SentencePiece tokenizer")
        if source is None:
            config, full_sd = load_full(args.input, args.config)
            token_ids = None if tokenizer_dir is None else export_tokenizer_to_hf(tokenizer_dir, args.output)
            arch = export_to_hf(full_sd, config, args.output, token_ids=token_ids)
        else:
            config, names, read, meta = source
            hf_config = build_hf_config(config)
            os.makedirs(args.output, exist_ok=True)
            convert_streaming(lambda sd: to_hf_state_dict(sd, config), names, read, meta,
                              os.path.join(args.output, "model.safetensors"), metadata={"format": "pt"})
            token_ids = None if tokenizer_dir is None else export_tokenizer_to_hf(tokenizer_dir, args.output)
            set_token_ids(hf_config, token_ids, args.output)
            hf_config.save_pretrained(args.output)
            arch = hf_config.architectures[0]
    except (ValueError, KeyError, FileNotFoundError, CheckpointError) as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {arch} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
