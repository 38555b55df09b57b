"""The ``args`` Namespace Megatron-LM's ``pretrain_gpt.py`` stores in a checkpoint, built as Megatron-LM builds it.

Megatron-LM's ``parse_args`` makes one argument per field of megatron-core's ``TransformerConfig`` (its
``ArgumentGroupFactory``, less the fields listed in ``_add_network_size_args``' ``exclude``) and adds its own
arguments with their defaults; ``validate_args`` then derives the rest. :func:`megatron_lm_args` does the same
for the ``TransformerConfig`` megatron-core built the model from: every one of its argument fields with the
config's value (what ``core_transformer_config_from_args`` copied from the args), :data:`DEFAULTS` (Megatron-LM's
own arguments this reader side touches, with the defaults of ``megatron/training/arguments.py`` and
``megatron/training/config/*.py`` of NVIDIA/Megatron-LM at d98e8a64), then the command line's values and
``validate_args``' derived values. Nothing here comes from megazero's writer.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

__all__ = ["DEFAULTS", "RUN_FLAGS", "POSITION_EMBEDDING", "megatron_lm_args", "model_flags", "megatron_lm_args_on_rank"]

POSITION_EMBEDDING = {"learned": "learned_absolute", "rope": "rope", "none": "none"}  # megazero's -> the flag's

# TransformerConfig fields that are not arguments (callables, or the names Megatron-LM's args spell otherwise).
_NOT_ARGUMENTS = {
    "timers", "finalize_model_grads_func", "grad_scale_func", "moe_grad_scale_func", "mtp_grad_scale_func",
    "no_sync_func", "grad_sync_func", "param_sync_func", "_cpu_offloading_context", "init_method",
    "output_layer_init_method", "embedding_init_method", "activation_func", "moe_layer_freq",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "num_moe_experts", "gated_linear_unit",
    "params_dtype", "pipeline_dtype", "autocast_dtype", "enable_autocast", "softmax_scale",
    "experimental_attention_variant_loss_scale_func", "virtual_pipeline_model_parallel_size",
    "bias_activation_fusion", "gradient_accumulation_fusion", "masked_softmax_fusion", "persist_layer_norm",
    "bias_dropout_fusion", "apply_rope_fusion", "attention_softmax_in_fp32", "overlap_p2p_comm",
}

# Megatron-LM's own arguments (not TransformerConfig fields) and their defaults.
DEFAULTS: dict[str, Any] = dict(
    # network size
    max_position_embeddings=None, position_embedding_type="learned_absolute", use_rotary_position_embeddings=False,
    rotary_base=10000, rotary_percent=1.0, rotary_seq_len_interpolation_factor=None, use_rope_scaling=False,
    rope_scaling_factor=8.0, add_position_embedding=True, make_vocab_size_divisible_by=128, openai_gelu=False,
    squared_relu=False, swiglu=False, quick_geglu=False, untie_embeddings_and_output_weights=False,
    group_query_attention=False, encoder_num_layers=None, decoder_num_layers=None,
    # mixture of experts, multi-latent attention
    num_experts=None, moe_layer_freq=1, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
    moe_use_upcycling=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
    # training, learning rate, regularization, optimizer
    micro_batch_size=None, global_batch_size=None, rampup_batch_size=None, train_iters=None, train_samples=None,
    lr=None, min_lr=0.0, lr_decay_style="linear", lr_decay_iters=None, lr_decay_samples=None,
    lr_warmup_fraction=None, lr_warmup_iters=0, lr_warmup_samples=0, lr_warmup_init=0.0,
    override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False, weight_decay=0.01,
    start_weight_decay=None, end_weight_decay=None, weight_decay_incr_style="constant", clip_grad=1.0,
    adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-08, optimizer="adam", use_distributed_optimizer=False,
    hidden_dropout=0.1, attention_dropout=0.1, seed=1234, fp16=False, bf16=False,
    # checkpointing
    save=None, load=None, save_interval=None, no_save_optim=None, no_save_rng=None, no_load_optim=None,
    no_load_rng=None, finetune=False, ckpt_format="torch_dist", dist_ckpt_optim_fully_reshardable=False,
    use_dist_ckpt_deprecated=False, ckpt_fully_parallel_save_deprecated=False, async_save=None,
    # data and tokenizer
    seq_length=None, tokenizer_type=None, vocab_size=None, data_path=None, split=None, mock_data=False,
)


def _transformer_config_arguments(tcfg) -> dict[str, Any]:
    """The arguments Megatron-LM makes of TransformerConfig's fields, with ``tcfg``'s values."""
    return {f.name: getattr(tcfg, f.name) for f in dataclasses.fields(tcfg) if f.name not in _NOT_ARGUMENTS}


def _padded_vocab(vocab: int, args: argparse.Namespace) -> int:
    """Megatron-LM's _vocab_size_with_padding: a multiple of make_vocab_size_divisible_by x tp."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab / multiple) * multiple)


def megatron_lm_args(tcfg, flags: dict[str, Any], *, data_parallel_size: int) -> argparse.Namespace:
    """The args of a Megatron-LM run whose model megatron-core built from ``tcfg``; ``flags``: the values
    the command line gave (``swiglu=True``, ``lr=3e-4``, ...), by destination. The tokenizer is a NullTokenizer
    (its vocabulary ``vocab_size + 1``, EOD included), padded as Megatron-LM pads it."""
    fields = _transformer_config_arguments(tcfg)
    unknown = sorted(set(flags) - set(DEFAULTS) - set(fields))
    if unknown:
        raise KeyError(f"not arguments of Megatron-LM here (add their defaults to DEFAULTS first): {unknown}")
    if flags.get("tokenizer_type") != "NullTokenizer" or flags.get("vocab_size") is None:
        raise ValueError("give tokenizer_type='NullTokenizer' and its vocab_size: the padded vocabulary comes from it")
    args = argparse.Namespace(**{**DEFAULTS, **fields, **flags})
    # validate_args and the tokenizer's set-up
    args.data_parallel_size = data_parallel_size
    args.world_size = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                       * args.context_parallel_size * data_parallel_size)
    if args.weight_decay_incr_style == "constant":
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    args.params_dtype = tcfg.params_dtype
    args.virtual_pipeline_model_parallel_size = None
    args.padded_vocab_size = _padded_vocab(args.vocab_size + 1, args)
    return args


# What the runs behind the fixture's checkpoints gave Megatron-LM's training arguments (batch sizes, schedule).
RUN_FLAGS = dict(micro_batch_size=2, global_batch_size=8, train_iters=100, lr=3e-4, min_lr=3e-5,
                 lr_decay_style="cosine", lr_warmup_iters=2, clip_grad=1.0, adam_beta2=0.95, seed=1234)


def model_flags(config, grouped_gemm: bool = False) -> dict[str, Any]:
    """What a Megatron-LM command line for megazero's ``config`` gives its own arguments (the TransformerConfig
    fields come from the config megatron-core builds, ``tests.mcore.transformer_config``): the local layer spec,
    and a NullTokenizer whose vocabulary (its EOD included) is the model's."""
    flags = dict(transformer_impl="local", swiglu=config.activation == "swiglu",
                 squared_relu=config.activation == "squared_relu",
                 position_embedding_type=POSITION_EMBEDDING[config.position_embedding_type],
                 rotary_base=int(config.rotary_base), rotary_percent=config.rotary_percent,
                 max_position_embeddings=config.max_position_embeddings,
                 seq_length=config.seq_length, make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                 untie_embeddings_and_output_weights=not config.tie_embeddings, tokenizer_type="NullTokenizer",
                 vocab_size=config.vocab_size - 1, moe_grouped_gemm=grouped_gemm,
                 group_query_attention=not config.multi_latent_attention
                 and config.query_groups != config.num_attention_heads)
    if config.num_experts is not None:
        freq = config.moe_layer_freq
        flags.update(num_experts=config.num_experts, moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
                     moe_router_load_balancing_type=config.moe_router_load_balancing_type,
                     moe_aux_loss_coeff=config.moe_aux_loss_coeff)
    return flags


def megatron_lm_args_on_rank(model, job: dict) -> argparse.Namespace:
    """A rank's args of :mod:`tests.mcore`'s ``job`` for the model megatron-core built: ``job['flags']`` on the
    command line, the iteration and samples of the save at ``job['save_at']``."""
    args = megatron_lm_args(model.config, job["flags"], data_parallel_size=job["dp"])
    if args.padded_vocab_size != job["config"].padded_vocab_size:
        raise ValueError(f"Megatron-LM pads the vocabulary to {args.padded_vocab_size}, the model has "
                         f"{job['config'].padded_vocab_size} rows: choose vocab_size and make_vocab_size_divisible_by "
                         "that agree")
    args.consumed_train_samples = job["save_at"] * args.global_batch_size
    args.iteration = job["save_at"]
    return args
