"""Import a local Hugging Face GPT-2 or Llama checkpoint as a full megazero checkpoint.

Writes ``model_full.safetensors`` + ``config.json`` (a GPTConfig) into ``--output``;
training loads it with ``--pretrained-checkpoint OUTPUT`` at any TP size. Only
safetensors is needed, not transformers. Safetensors checkpoints (single or sharded) are
converted one layer at a time and streamed into the output: memory stays at about one
layer's tensors at any size. Example::

    python tools/convert_from_hf.py --input hf/gpt2 --output ckpt/gpt2 \\
        --override seq_length=1024 --override make_vocab_size_divisible_by=128

Installed: ``megazero-convert-from-hf``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from megazero.cli.common import setup_logging, tool_parser
from megazero.cli.streaming import LayerProgress
from megazero.model import GPTConfig
from megazero.model.hf import config_from_hf, from_hf_state_dict, import_from_hf
from megazero.model.state_dict import CONFIG_NAME, FULL_WEIGHTS_NAME, convert_streaming, save_full
from megazero.zero.shard_io import CheckpointError, ReadCounter, ShardFile

log = logging.getLogger(__name__)


def _override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--override expects FIELD=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string, e.g. attention_backend=sdpa


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--input", required=True, help="local HF model directory (config.json + weights)")
    p.add_argument("--output", required=True, help="directory for model_full.safetensors + config.json")
    p.add_argument("--override", action="append", type=_override, default=[], metavar="FIELD=VALUE",
                   help="set a GPTConfig field (JSON value), repeatable")
    return p


def _safetensors_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"] if os.path.isfile(os.path.join(hf_dir, "model.safetensors")) else []


def import_streaming(hf_dir: str, out_dir: str, **overrides) -> GPTConfig:
    """HF safetensors checkpoint -> ``model_full.safetensors`` + ``config.json``, one layer at a time."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = config_from_hf(json.load(f), **overrides)
    counter = ReadCounter()
    where = {}
    for name in _safetensors_files(hf_dir):
        sf = ShardFile(os.path.join(hf_dir, name), None, counter)
        where.update({k: sf for k in sf.keys()})
    os.makedirs(out_dir, exist_ok=True)
    with LayerProgress(lambda n: where[n].tensor(n), list(where), log) as read:
        convert_streaming(lambda sd: from_hf_state_dict(sd, config), list(where), read,
                          lambda n: torch.empty(where[n].shape(n), dtype=where[n].dtype(n), device="meta"),
                          os.path.join(out_dir, FULL_WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if _safetensors_files(args.input):
            config = import_streaming(args.input, args.output, **dict(args.override))
        else:  # pickled .bin checkpoints load whole (torch.load cannot read one tensor)
            log.info("reading %s whole (a .bin checkpoint: no layer-by-layer streaming)", args.input)
            config, full_sd = import_from_hf(args.input, **dict(args.override))
            save_full(args.output, full_sd, config)
    except (ValueError, KeyError, FileNotFoundError, TypeError, CheckpointError) as e:
        log.error("convert_from_hf: error: %s", e)
        return 1
    log.info("wrote %d-layer %d-wide GPT to %s", config.num_layers, config.hidden_size, args.output)
    return 0
