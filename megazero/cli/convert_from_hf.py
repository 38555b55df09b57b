"""Import a local Hugging Face model (GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss (its
MXFP4 experts dequantised), DeepSeek-V3, Kimi-K2 and Moonlight among its kind, Qwen3-Next, Qwen3.5 dense and MoE (a
multimodal Qwen3.5 as its text model), Nemotron-H, Kimi Linear) as a full megazero checkpoint.

Writes into ``--output`` ``model_full.safetensors``, ``config.json`` (the GPTConfig) and, where the
model directory has one, its tokenizer by content in ``tokenizer/`` (tokenizer.json,
tokenizer_config.json, vocab + merges, a SentencePiece model: whichever it has). The result needs
no shape flags and no tokenizer flags: ``tools/generate.py --load OUTPUT``,
``pretrain_gpt.py --pretrained-checkpoint OUTPUT`` (or ``--load OUTPUT --finetune``) at any TP and
PP size, ``tools/convert_to_hf.py --load OUTPUT``. Only safetensors is needed, not transformers
(the tokenizer is read with ``tokenizers``). Safetensors checkpoints (single or sharded) are
converted one layer at a time and streamed into the output: memory stays at about one layer's
tensors at any size. Example::

    python tools/convert_from_hf.py --input hf/gpt2 --output ckpt/gpt2 \\
        --override seq_length=1024 --override make_vocab_size_divisible_by=128

Installed: ``megazero-convert-from-hf``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import torch

from megazero.checkpoint.native import TOKENIZER_DIR
from megazero.cli.common import setup_logging, tool_parser
from megazero.cli.streaming import LayerProgress
from megazero.data.hf_tokenizer import import_tokenizer_from_hf
from megazero.model import GPTConfig
from megazero.model.interop.hf import HF_IMPORT_FAMILIES, config_from_hf, from_hf_state_dict, import_from_hf
from megazero.model.interop.hf_deepseek import streaming_group
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
    p.add_argument("--input", required=True,
                   help="local HF model directory (config.json + weights, and its tokenizer files if any) of a "
                        "model_type among " + ", ".join(HF_IMPORT_FAMILIES))
    p.add_argument("--output", required=True,
                   help="directory for model_full.safetensors, config.json and tokenizer/")
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
        hf = json.load(f)
    counter = ReadCounter()
    where = {}
    for name in _safetensors_files(hf_dir):
        sf = ShardFile(os.path.join(hf_dir, name), None, counter)
        where.update({k: sf for k in sf.keys()})
    config = config_from_hf(hf, list(where), **overrides)
    os.makedirs(out_dir, exist_ok=True)
    group_of = (lambda n: streaming_group(n, config)) if config.multi_latent_attention else None
    with LayerProgress(lambda n: where[n].tensor(n), list(where), log) as read:
        convert_streaming(lambda sd: from_hf_state_dict(sd, config, hf), list(where), read,
                          lambda n: torch.empty(where[n].shape(n), dtype=where[n].dtype(n), device="meta"),
                          os.path.join(out_dir, FULL_WEIGHTS_NAME), metadata={"format": "pt"}, group_of=group_of)
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
        carry_tokenizer(args.input, args.output, config)
    except (ValueError, KeyError, FileNotFoundError, TypeError, CheckpointError) as e:
        log.error("convert_from_hf: error: %s", e)
        return 1
    log.info("wrote %d-layer %d-wide GPT to %s", config.num_layers, config.hidden_size, args.output)
    return 0


def carry_tokenizer(hf_dir: str, out_dir: str, config: GPTConfig) -> None:
    """Record ``hf_dir``'s tokenizer in ``out_dir/tokenizer`` (so the checkpoint's users need no tokenizer
    flags); a model without one is written without, and says so."""
    target = os.path.join(out_dir, TOKENIZER_DIR)
    shutil.rmtree(target, ignore_errors=True)  # a stale one from an earlier conversion into the same place
    try:
        tok = import_tokenizer_from_hf(hf_dir, target)
    except (ValueError, OSError, ImportError) as e:
        raise ValueError(f"the tokenizer in {hf_dir} does not load ({e}); fix it, or move its files out of the "
                         "directory to convert the model without it") from None
    if tok is None:
        log.info("%s has no tokenizer files: the checkpoint has none (generate.py then reads and writes token "
                 "ids; give pretrain_gpt.py --tokenizer-type)", hf_dir)
        return
    if tok.vocab_size > config.padded_vocab_size:
        shutil.rmtree(target)
        raise ValueError(f"the tokenizer in {hf_dir} has {tok.vocab_size} tokens, more than the model's "
                         f"{config.padded_vocab_size} embedding rows: it is not this model's tokenizer")
    log.info("recorded the tokenizer (%d tokens, end-of-document id %d) in %s", tok.vocab_size, tok.eod, target)
