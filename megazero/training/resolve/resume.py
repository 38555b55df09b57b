"""Checkpoint flags (--save/--load/--pretrained-checkpoint ...), and what the run resumed from saved."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

from megazero.training.config import CheckpointConfig, ConfigError


def checkpoint_model(load: str) -> dict[str, Any]:
    """The model section of the config saved with the latest checkpoint in ``load`` (--use-checkpoint-args)."""
    from megazero.training.checkpointing import checkpoint_dir, latest_iteration

    iteration = latest_iteration(load) if os.path.isdir(load) else None
    if iteration is None:
        raise ConfigError(f"--use-checkpoint-args: {load} holds no megazero checkpoint ('latest' is missing)")
    path = os.path.join(checkpoint_dir(load, iteration), "config.json")
    try:
        with open(path) as f:
            return json.load(f)["model"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"--use-checkpoint-args: cannot read the model config from {path}: {e}") from None



# --use-checkpoint-args, as Megatron's load_args_from_checkpoint: shapes fill what the command line
# left unset; the architecture is forced to the checkpoint's (the weights only mean something with it).
CHECKPOINT_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size",
                            "max_position_embeddings", "seq_length", "kv_channels", "layernorm_epsilon",
                            "norm_epsilon", "make_vocab_size_divisible_by")
CHECKPOINT_FORCED_FIELDS = ("num_query_groups", "position_embedding_type", "rotary_base", "rotary_percent",
                             "add_bias_linear", "activation", "tie_embeddings", "apply_layernorm_1p", "normalization",
                             "qk_layernorm", "apply_query_key_layer_scaling")


def saved_model_fields(ns: argparse.Namespace) -> Optional[tuple[str, dict[str, Any]]]:
    """``(where, saved GPTConfig dict)`` of the weights this run starts from: the latest checkpoint in
    --load, else --pretrained-checkpoint's config.json; None for a fresh start."""
    from megazero.training.checkpointing import checkpoint_dir, latest_iteration

    if ns.load is not None and os.path.isdir(ns.load):
        try:
            iteration = latest_iteration(ns.load)
        except Exception:  # a damaged 'latest' is the load's to report, with its own message
            iteration = None
        if iteration is not None:
            path = os.path.join(checkpoint_dir(ns.load, iteration), "config.json")
            try:
                with open(path) as f:
                    return path, json.load(f)["model"]
            except (OSError, KeyError, ValueError, TypeError):
                return None  # the checkpoint load names what is wrong with it
    if ns.pretrained_checkpoint is not None:
        path = os.path.join(ns.pretrained_checkpoint, "config.json")
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return None
        return (path, saved) if isinstance(saved, dict) else None
    return None


def keep_saved_vocab_padding(ns: argparse.Namespace, kw: dict[str, Any], tp: int, notes: list[str]) -> None:
    """A resume at another tp keeps the embedding rows of the checkpoint: Megatron's padding depends
    on the tp of the run that *created* the weights, and the weights cannot change shape."""
    found = saved_model_fields(ns)
    if found is None:
        return
    where, saved = found
    from megazero.mpu.utils import pad_vocab_size

    if saved.get("vocab_size") != kw["vocab_size"]:
        return  # another vocabulary altogether: the weight load reports the shape mismatch by name
    divisible = int(saved.get("make_vocab_size_divisible_by", 128))
    saved_tp = int(saved.get("vocab_padding_tp", 1))
    saved_padded = pad_vocab_size(kw["vocab_size"], saved_tp, divisible)
    padded = pad_vocab_size(kw["vocab_size"], kw["vocab_padding_tp"], kw.get("make_vocab_size_divisible_by", 128))
    if saved_padded == padded:
        return
    if saved_padded % tp:
        raise ConfigError(f"the weights in {os.path.dirname(where)} have a padded vocabulary of {saved_padded} rows "
                          f"({kw['vocab_size']} padded to a multiple of {divisible} x tp {saved_tp}), which does not "
                          f"split over --tp {tp}; resume with a --tp that divides {saved_padded}")
    kw["make_vocab_size_divisible_by"], kw["vocab_padding_tp"] = divisible, saved_tp
    notes.append(f"padded vocabulary {saved_padded} kept from {os.path.dirname(where)} (made at tp {saved_tp}); "
                 f"a fresh run at --tp {tp} would pad to {padded}")


def resolve_checkpoint(ns: argparse.Namespace, notes: list[str], check_files: bool) -> CheckpointConfig:
    """--save, --load, --save-interval, --pretrained-checkpoint and how to load (--finetune, --no-load-*)."""
    if ns.pretrained_checkpoint is not None and check_files and not os.path.exists(
            os.path.join(ns.pretrained_checkpoint, "model_full.safetensors")):
        raise ConfigError(f"--pretrained-checkpoint {ns.pretrained_checkpoint} has no model_full.safetensors "
                          "(make one with tools/convert_from_hf.py)")
    save_interval = ns.save_interval
    if save_interval is not None and save_interval < 1:
        raise ConfigError(f"--save-interval must be >= 1, got {save_interval}")
    if save_interval is not None and ns.save is None:
        notes.append(f"warning: --save-interval {save_interval} without --save: no checkpoints will be written "
                     "(as in Megatron)")
        save_interval = None
    for flag_name, value in (("--finetune", ns.finetune), ("--no-load-optim", ns.no_load_optim),
                             ("--no-load-rng", ns.no_load_rng), ("--ckpt-step", ns.ckpt_step is not None)):
        if value and ns.load is None and ns.pretrained_checkpoint is None:
            raise ConfigError(f"{flag_name} needs --load (the checkpoint it changes how to load)")
    return CheckpointConfig(save=ns.save, load=ns.load, save_interval=save_interval,
                            pretrained=ns.pretrained_checkpoint, finetune=bool(ns.finetune),
                            no_load_optim=bool(ns.no_load_optim), no_load_rng=bool(ns.no_load_rng),
                            use_checkpoint_args=bool(ns.use_checkpoint_args), ckpt_step=ns.ckpt_step)
