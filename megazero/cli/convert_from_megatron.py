"""Import a Megatron-LM (torch_dist, the default format, or legacy mp_rank_XX) or Megatron-DeepSpeed GPT
checkpoint, at any tp, pp and ep, as a full megazero checkpoint (``model_full.safetensors`` + ``config.json``).

Files are read with ``torch.load(weights_only=True)`` and an explicit allow-list (see
megazero/checkpoint/megatron_legacy.py and megazero/checkpoint/torch_dist.py); nothing in the checkpoint is
executed and Megatron need not be installed. A torch_dist checkpoint is streamed one tensor at a time
(peak memory: the largest tensor), so its size is bounded by the disk, not the memory. Dense, MoE
(any expert implementation), multi-latent attention and MTP models are read; the optimizer state is not
converted. Train from the result with ``--pretrained-checkpoint OUTPUT``.
Example::

    python tools/convert_from_megatron.py --input /ckpt/gpt-1.3b --output ckpt/gpt-1.3b-mz --vocab-size 50257

Installed: ``megazero-convert-from-megatron``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from megazero.checkpoint.megatron_legacy import import_megatron, load_megatron_file
from megazero.checkpoint.torch_dist import is_torch_dist
from megazero.cli.common import setup_logging, tool_parser
from megazero.model.state_dict import SafetensorsStreamWriter, save_full
from megazero.utils.progress import Progress
from megazero.zero.shard_io import CheckpointError

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


def convert_torch_dist(path: str, output: str, vocab_size: int | None = None) -> tuple:
    """Stream a torch_dist checkpoint (read by the loader every program shares, ``checkpoint_reader.open_checkpoint``)
    into ``output``/model_full.safetensors + config.json, one tensor at a time, in its stored dtypes. Returns
    ``(config, info)``; ``info["bytes_read"]`` counts the checkpoint bytes read."""
    from megazero.checkpoint.reader import open_checkpoint

    config, reader, saved = open_checkpoint(path, vocab_size=vocab_size)
    names = list(reader.names)
    os.makedirs(output, exist_ok=True)
    layout = [(n, tuple(reader.full_shape(n)), reader.full_dtype(n)) for n in names]
    writer = SafetensorsStreamWriter(os.path.join(output, "model_full.safetensors"), layout, {"format": "pt"})
    try:
        with Progress("convert", total=len(names), unit="tensors", logger=log) as progress:
            for n in names:
                writer.write(n, reader.full(n))
                progress.update(postfix=n)
        writer.close()
    except BaseException:  # no half-written file is left behind
        writer._f.close()
        if os.path.exists(writer.path + ".tmp"):
            os.remove(writer.path + ".tmp")
        raise
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    info = dict(saved["torch_dist"])
    info["bytes_read"] = reader.source.ckpt.bytes_read
    return config, info


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    if is_torch_dist(args.input):
        try:
            config, info = convert_torch_dist(args.input, args.output, args.vocab_size)
        except (CheckpointError, ValueError, KeyError) as e:
            log.error("convert_from_megatron: error: %s", e)
            return 1
        log.info("read Megatron-LM torch_dist checkpoint of iteration %s (tp=%s, pp=%s, ep=%s; optimizer state: %s, "
                 "not converted); wrote %d-layer %d-wide GPT to %s", info["iteration"], info["tp"], info["pp"],
                 info["ep"], info["optimizer"], config.num_layers, config.hidden_size, args.output)
        return 0
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
