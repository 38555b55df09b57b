"""Checkpoint flags (--save/--load/--pretrained-checkpoint ...), and what the run resumed from saved."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional

from megazero.config.train_config import CheckpointConfig, ConfigError


def start_checkpoint(ns: argparse.Namespace) -> Optional[str]:
    """The checkpoint the run's weights come from: --load when it holds a megazero checkpoint ('latest'),
    full weights (a converter's output) or a torch_dist checkpoint (Megatron-LM's or megazero's), else
    --pretrained-checkpoint; None for a fresh start."""
    from megazero.checkpoint.megatron_resume import is_torch_dist_load
    from megazero.checkpoint.native import FULL_WEIGHTS, latest_iteration

    if ns.load is not None and os.path.isdir(ns.load):
        if is_torch_dist_load(ns.load):
            return ns.load
        try:
            if latest_iteration(ns.load) is not None:
                return ns.load
        except Exception:  # a damaged 'latest' is the load's to report, with its own message
            return ns.load
        if os.path.isfile(os.path.join(ns.load, FULL_WEIGHTS)):
            return ns.load
    return ns.pretrained_checkpoint


def check_pretrained(ns: argparse.Namespace, check_files: bool) -> None:
    """Refuse a --pretrained-checkpoint without full weights (before anything reads its config)."""
    if ns.pretrained_checkpoint is not None and check_files and not os.path.exists(
            os.path.join(ns.pretrained_checkpoint, "model_full.safetensors")):
        raise ConfigError(f"--pretrained-checkpoint {ns.pretrained_checkpoint} has no model_full.safetensors "
                          "(make one with tools/convert_from_hf.py or tools/convert_from_megatron.py)")


def _iteration(ns: argparse.Namespace, source: str) -> Optional[int]:
    return ns.ckpt_step if source == ns.load else None


def checkpoint_model(ns: argparse.Namespace, source: str) -> tuple[str, dict[str, Any]]:
    """``(where, saved GPTConfig dict)`` of the checkpoint ``source`` (any format the run can start from)."""
    from megazero.checkpoint.native import CheckpointError
    from megazero.checkpoint.reader import saved_model_config

    try:
        return saved_model_config(source, _iteration(ns, source))
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"cannot read the model arguments of {source}: {e}") from None


# The model of the checkpoint a run starts from: every field below the command line does not set is the
# checkpoint's. CHECKPOINT_MODEL_FIELDS are the network its weights belong to (their shapes and what they
# compute): a flag that disagrees is refused by both values. The learned position table is among them
# (CHECKPOINT_LEARNED_FIELDS). CHECKPOINT_TRAINING_FIELDS are how the network trains (dropout, the load
# balancing, the initialisation it records): a flag sets another value, which the start-up notes name beside the
# checkpoint's. The sequence length and the vocabulary padding fill what the command line leaves unset (the
# padding is then kept by keep_saved_vocab_padding). Execution settings (recompute, sequence parallelism, the
# attention backend, the dtype) are the run's own.
CHECKPOINT_MODEL_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size", "num_query_groups",
    "kv_channels", "position_embedding_type", "rotary_base", "rotary_percent", "normalization", "layernorm_epsilon",
    "activation", "glu_linear_offset", "activation_func_clamp_value", "qk_layernorm", "apply_layernorm_1p",
    "add_bias_linear", "add_qkv_bias", "tie_embeddings",
    "apply_query_key_layer_scaling", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_router_pre_softmax", "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_bias",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "latent_layernorm_epsilon", "rope_type",
    "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "yarn_correction_range_round_to_int", "mtp_num_layers", "low_freq_factor", "high_freq_factor", "hf_model_type",
    "window_size", "window_attn_skip_freq", "softmax_type", "hybrid_layer_pattern", "experimental_attention_variant",
    "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "kda_f_lora_rank", "kda_gate_lora_rank", "mamba_num_heads",
    "mamba_head_dim", "mamba_state_dim", "mamba_num_groups", "attention_output_gate")
CHECKPOINT_LEARNED_FIELDS = ("max_position_embeddings",)
CHECKPOINT_TRAINING_FIELDS = (
    "hidden_dropout", "attention_dropout", "init_method_std", "init_method", "label_smoothing",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
    "moe_router_dtype", "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
    "moe_min_capacity", "moe_eval_capacity_factor", "mtp_loss_scaling_factor")
CHECKPOINT_FILL_FIELDS = ("seq_length", "max_position_embeddings", "make_vocab_size_divisible_by")
MODEL_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")


def flags_give_the_shape(ns: argparse.Namespace) -> bool:
    """Whether the command line sizes the model itself (--num-layers, --hidden-size, --num-attention-heads or
    --model-preset): a checkpoint it starts from that cannot be read at parse time is then left to the load to
    report."""
    return ns.model_preset is not None or any(getattr(ns, a) is not None for a in MODEL_SHAPE_FLAGS)


def checkpoint_args_source(ns: argparse.Namespace, check_files: bool) -> Optional[str]:
    """The checkpoint whose model the run takes: the one it starts from (:func:`start_checkpoint`), whatever
    model flags the command line gives; None for a fresh start. --use-checkpoint-args without one is refused."""
    source = start_checkpoint(ns)
    if ns.use_checkpoint_args:
        if ns.load is None and ns.pretrained_checkpoint is None:
            raise ConfigError("--use-checkpoint-args needs --load or --pretrained-checkpoint (the checkpoint whose "
                              "model arguments to use)")
        if source is None and check_files:
            raise ConfigError(f"--use-checkpoint-args: {ns.load or ns.pretrained_checkpoint} holds no checkpoint "
                              "('latest', model_full.safetensors or a torch_dist iteration) to take the model "
                              "arguments from")
    return source


def _effective(saved, field: str) -> Any:
    """A saved GPTConfig's value of ``field`` as a flag would give it (defaults resolved)."""
    resolved = {"num_query_groups": "query_groups", "kv_channels": "head_dim", "ffn_hidden_size": "ffn_size",
                "rope_type": "resolved_rope_type", "mamba_num_heads": "mamba_heads",
                "moe_ffn_hidden_size": "moe_ffn_size"}
    value = getattr(saved, resolved.get(field, field))
    return tuple(value) if isinstance(value, list) else value


def _layers(field: str, value: Any) -> Any:
    """A value as the weights see it: a hybrid pattern without its pipeline cuts (which a run may place anew)."""
    return value.replace("|", "") if field == "hybrid_layer_pattern" and isinstance(value, str) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9)
    return (tuple(a) if isinstance(a, list) else a) == b


def checkpoint_model_kwargs(saved: dict[str, Any], given: dict[str, tuple[str, Any]], where: str) -> dict[str, Any]:
    """The GPTConfig fields the checkpoint's weights fix (``saved``, read from ``where``), refusing a model
    flag (``given``: field -> (the flag as typed, its value)) that disagrees, by both values."""
    from megazero.model.config import GPTConfig

    try:
        ref = GPTConfig.from_dict(saved)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where} does not hold a model configuration this build reads: {e}") from None
    fields = CHECKPOINT_MODEL_FIELDS + (CHECKPOINT_LEARNED_FIELDS if ref.position_embedding_type == "learned" else ())
    for field, (flag, value) in given.items():
        if field in fields and not _same(_layers(field, value), _layers(field, _effective(ref, field))):
            raise ConfigError(f"{flag} disagrees with the checkpoint's {field}={_effective(ref, field)!r} ({where}): "
                              "drop the flag, the model comes from the checkpoint")
    return {k: saved[k] for k in fields if k in saved}


def checkpoint_training_kwargs(saved: dict[str, Any], given: dict[str, tuple[str, Any]], where: str,
                               notes: list[str]) -> dict[str, Any]:
    """The CHECKPOINT_TRAINING_FIELDS of ``saved`` (read from ``where``) that no flag of ``given`` sets; each
    flag that sets another value than the checkpoint's is named in ``notes`` beside it."""
    out: dict[str, Any] = {}
    for field in CHECKPOINT_TRAINING_FIELDS:
        if field not in saved:
            continue
        if field not in given:
            out[field] = tuple(saved[field]) if isinstance(saved[field], list) else saved[field]
        elif not _same(given[field][1], saved[field]):
            notes.append(f"{given[field][0]} in place of the checkpoint's {field}={saved[field]!r} ({where})")
    return out


def checkpoint_tokenizer_flags(ns: argparse.Namespace, notes: list[str]) -> bool:
    """Without tokenizer flags, a run that starts from a checkpoint with a recorded tokenizer/ takes that
    one: its type and files set in ``ns``. Whether it did."""
    if ns.tokenizer_type is not None or ns.tokenizer_model or ns.vocab_file or ns.merge_file:
        return False
    if ns.no_use_tokenizer_model_from_checkpoint_args:  # the tokenizer flags are then required
        return False
    source = start_checkpoint(ns)
    if source is None:
        return False
    from megazero.checkpoint.native import CheckpointError
    from megazero.checkpoint.reader import checkpoint_tokenizer_dir
    from megazero.data.tokenizer_files import recorded_tokenizer_args

    try:
        directory = checkpoint_tokenizer_dir(source, _iteration(ns, source))
        if directory is None:
            return False
        kind, files = recorded_tokenizer_args(directory)
    except (CheckpointError, OSError, ValueError) as e:
        raise ConfigError(f"cannot read the tokenizer recorded in {source}: {e}; pass --tokenizer-type and its "
                          "files") from None
    ns.tokenizer_type = kind
    for name, value in files.items():
        setattr(ns, name, value)
    notes.append(f"tokenizer: the {kind} recorded in {directory}")
    return True


def saved_model_fields(ns: argparse.Namespace) -> Optional[tuple[str, dict[str, Any]]]:
    """``(where, saved GPTConfig dict)`` of the weights this run starts from (:func:`start_checkpoint`);
    None for a fresh start or an unreadable checkpoint (whose load then names what is wrong)."""
    source = start_checkpoint(ns)
    if source is None:
        return None
    try:
        return checkpoint_model(ns, source)
    except ConfigError:
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
    from megazero.checkpoint.native import is_full_checkpoint

    pretrained = ns.pretrained_checkpoint
    if check_files and ns.load is not None and os.path.isdir(ns.load) and is_full_checkpoint(ns.load, ns.ckpt_step):
        if pretrained not in (None, ns.load):
            raise ConfigError(f"--load {ns.load} holds full weights and --pretrained-checkpoint {pretrained} others; "
                              "pass one")
        pretrained = ns.load
        notes.append(f"--load {ns.load}: full weights (no 'latest'): the run starts from them, as with "
                     "--pretrained-checkpoint, at iteration 0")
    if ns.exit_on_missing_checkpoint and ns.load is not None and check_files and start_checkpoint(ns) != ns.load:
        raise ConfigError(f"--exit-on-missing-checkpoint: --load {ns.load} holds no checkpoint (no 'latest', full "
                          "weights or torch_dist iteration); fix the path, or drop the flag to start from scratch")
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
                            pretrained=pretrained, finetune=bool(ns.finetune),
                            no_load_optim=bool(ns.no_load_optim), no_load_rng=bool(ns.no_load_rng),
                            use_checkpoint_args=bool(ns.use_checkpoint_args), ckpt_step=ns.ckpt_step,
                            ckpt_format=ns.ckpt_format or "megazero", async_save=bool(ns.async_save),
                            transformer_impl=getattr(ns, "transformer_impl", None) or "transformer_engine")
