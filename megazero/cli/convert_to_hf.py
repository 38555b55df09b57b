"""Export a megazero checkpoint to a Hugging Face transformers directory.

``--load`` is a training checkpoint (the ``--save`` directory of pretrain_gpt.py, or one
of its ``iter_*`` directories; any tp x pp x dp x ZeRO stage, either --ckpt-format), a Megatron-LM
``torch_dist`` checkpoint (any tp x pp x ep), a full checkpoint
(``model_full.safetensors`` + ``config.json``, as tools/convert_from_hf.py and
``megazero.model.state_dict.save_full`` write it), or a ``.safetensors``/``.pt`` full state dict
with ``--config``. The output loads with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
as GPT2LMHeadModel (the default architecture), LlamaForCausalLM (rope + rmsnorm + swiglu),
MixtralForCausalLM (Llama with a mixture of experts in every layer), Qwen2MoeForCausalLM (with a
gated shared expert), Qwen3MoeForCausalLM (with query/key norms), GptOssForCausalLM (sinks, windows, quick-GEGLU
experts; plain weights, not MXFP4), DeepseekV3ForCausalLM (multi-latent attention, with its multi-token
prediction modules as DeepSeek's extra layers), Qwen3NextForCausalLM, Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM
(Gated DeltaNet among gated attention layers), NemotronHForCausalLM (a hybrid pattern of Mamba-2, attention, MLP and
mixture blocks) or KimiLinearForCausalLM (Kimi Delta Attention among multi-latent attention). The checkpoint's tokenizer
goes with it. Example::

    python tools/convert_to_hf.py --load ckpt/full --output hf/my-gpt

Installed: ``megazero-convert-to-hf``. Safetensors inputs are converted one layer at a time
and streamed into the output file, so memory stays at about one layer's tensors whatever
the model size (13B included).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from megazero.checkpoint.native import TOKENIZER_DIR, CheckpointError
from megazero.checkpoint.reader import FullWeightsReader, checkpoint_tokenizer_dir, open_checkpoint
from megazero.cli.common import setup_logging, tool_parser
from megazero.cli.streaming import LayerProgress
from megazero.data.hf_tokenizer import export_tokenizer_to_hf
from megazero.model import GPTConfig
from megazero.model.interop.hf import build_hf_config, export_to_hf, set_token_ids, to_hf_state_dict
from megazero.model.interop.hf_deepseek import streaming_group
from megazero.model.state_dict import CONFIG_NAME, FULL_WEIGHTS_NAME, convert_streaming, load_full
from megazero.utils.optional_deps import require_packages

TOOL = "convert_to_hf"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--load", "--input", dest="load", required=True,
                   help="checkpoint directory (pretrain_gpt.py's --save in either format, Megatron-LM's torch_dist, "
                        "a full checkpoint), or a full state dict file (.safetensors/.pt)")
    p.add_argument("--config", default=None, help="GPTConfig json (default: config.json next to the weights)")
    p.add_argument("--output", required=True, help="directory to write the HF model into")
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer recorded by content (default: the checkpoint's tokenizer/ directory, if any); "
                        "exported beside the model and used for bos/eos ids")
    return p


def _source(args):
    """(config, names, read, meta) of a streamable input; None for a .pt state dict."""
    if os.path.isdir(args.load) and args.config is None:
        config, reader, _ = open_checkpoint(args.load)
    else:
        weights = os.path.join(args.load, FULL_WEIGHTS_NAME) if os.path.isdir(args.load) else args.load
        if not weights.endswith(".safetensors"):
            return None
        config_path = args.config or os.path.join(os.path.dirname(weights), CONFIG_NAME)
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"no config at {config_path}; pass --config")
        config = GPTConfig.from_dict(json.load(open(config_path)))
        reader = FullWeightsReader(weights, config)
    # Training-only settings do not describe the exported network.
    config = config.replace(recompute_granularity=None, sequence_parallel=False)
    dtype = getattr(reader, "full_dtype", lambda name: torch.float32)  # a training checkpoint holds fp32 masters
    return (config, reader.names, reader.full,
            lambda n: torch.empty(reader.full_shape(n), dtype=dtype(n), device="meta"))


def _tokenizer_type(tokenizer_dir: str) -> str | None:
    try:
        with open(os.path.join(tokenizer_dir, "megazero_tokenizer.json")) as f:
            return json.load(f).get("type")
    except (OSError, ValueError, AttributeError):
        return None  # the export itself reports what is wrong with the directory


def _find_tokenizer_dir(args) -> str | None:
    """--tokenizer-dir, else the checkpoint's own tokenizer/ directory, if it has one."""
    if args.tokenizer_dir is not None:
        return args.tokenizer_dir
    if os.path.isdir(args.load):
        return checkpoint_tokenizer_dir(args.load)
    found = os.path.join(os.path.dirname(args.load), TOKENIZER_DIR)  # a weights file: the tokenizer beside it
    return found if os.path.isfile(os.path.join(found, "megazero_tokenizer.json")) else None


def _export_streaming(source, output: str, tokenizer_dir: str | None) -> str:
    config, names, read, meta = source
    hf_config = build_hf_config(config)
    os.makedirs(output, exist_ok=True)
    group_of = (lambda n: streaming_group(n, config)) if config.multi_latent_attention else None
    with LayerProgress(read, names, log) as counted:
        convert_streaming(lambda sd: to_hf_state_dict(sd, config), names, counted, meta,
                          os.path.join(output, "model.safetensors"), metadata={"format": "pt"}, group_of=group_of)
    token_ids = None if tokenizer_dir is None else export_tokenizer_to_hf(tokenizer_dir, output)
    set_token_ids(hf_config, token_ids, output)
    hf_config.save_pretrained(output)
    return hf_config.architectures[0]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    require_packages(TOOL, ["transformers"], "hf", "writing a Hugging Face model")
    try:
        source = _source(args)
        tokenizer_dir = _find_tokenizer_dir(args)
        if tokenizer_dir is not None and _tokenizer_type(tokenizer_dir) in SENTENCEPIECE_TYPES:
            # transformers converts the SentencePiece model to its tokenizer.json with protobuf
            require_packages(TOOL, ["sentencepiece", "google.protobuf"], "hf", "exporting a SentencePiece tokenizer")
        if source is None:
            log.info("reading %s whole (a .pt state dict: no layer-by-layer streaming)", args.load)
            config, full_sd = load_full(args.load, args.config)
            token_ids = None if tokenizer_dir is None else export_tokenizer_to_hf(tokenizer_dir, args.output)
            arch = export_to_hf(full_sd, config, args.output, token_ids=token_ids)
        else:
            arch = _export_streaming(source, args.output, tokenizer_dir)
    except (ValueError, KeyError, FileNotFoundError, CheckpointError) as e:
        log.error("%s: error: %s", TOOL, e)
        return 1
    log.info("wrote %s to %s", arch, args.output)
    return 0
