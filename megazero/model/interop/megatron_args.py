"""``GPTConfig`` -> the model fields of Megatron-LM's ``args`` Namespace (what ``pretrain_gpt.py`` stores).

The inverse of :func:`~megazero.model.interop.megatron_import.config_from_megatron_args`:
``config_from_megatron_args(Namespace(**megatron_model_args(c)), c.vocab_size)`` gives ``c`` back. A
torch_dist checkpoint megazero writes carries these in ``common.pt`` so that Megatron-LM
(``--use-checkpoint-args``), its converters and megazero itself read the model's shape from it.
"""

from __future__ import annotations

from typing import Any

from ..config import GPTConfig
from .megatron_hybrid import hybrid_args

__all__ = ["megatron_model_args"]

_POSITION = {"learned": "learned_absolute", "rope": "rope", "none": "none"}


def megatron_model_args(config: GPTConfig) -> dict[str, Any]:
    """Megatron-LM's argument names and values for ``config``'s model (no layout, no training fields)."""
    mla = config.multi_latent_attention
    gqa = config.query_groups != config.num_attention_heads and not mla
    args: dict[str, Any] = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, group_query_attention=gqa,
        num_query_groups=config.query_groups if gqa else 1, kv_channels=None if mla else config.head_dim,
        ffn_hidden_size=config.ffn_size, seq_length=config.seq_length,
        max_position_embeddings=config.max_position_embeddings, padded_vocab_size=config.padded_vocab_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        swiglu=config.activation == "swiglu", squared_relu=config.activation == "squared_relu",
        quick_geglu=config.activation == "quick_geglu", glu_linear_offset=config.glu_linear_offset,
        activation_func_clamp_value=config.activation_func_clamp_value,
        normalization="RMSNorm" if config.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=config.layernorm_epsilon, apply_layernorm_1p=config.apply_layernorm_1p,
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        untie_embeddings_and_output_weights=not config.tie_embeddings,
        position_embedding_type=_POSITION[config.position_embedding_type],
        add_position_embedding=config.position_embedding_type == "learned",
        rotary_base=config.rotary_base, rotary_percent=config.rotary_percent,
        qk_layernorm=config.qk_layernorm or mla, hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout, init_method_std=config.init_method_std,
        mtp_num_layers=config.mtp_num_layers or None, mtp_loss_scaling_factor=config.mtp_loss_scaling_factor,
        multi_latent_attention=mla, num_experts=config.num_experts,
        window_size=None if config.window_size is None else tuple(config.window_size),
        window_attn_skip_freq=(list(config.window_attn_skip_freq) if isinstance(config.window_attn_skip_freq, tuple)
                               else config.window_attn_skip_freq),
        softmax_type=config.softmax_type,
        **hybrid_args(config),
    )
    if config.num_experts:
        freq = config.moe_layer_freq
        args.update(
            moe_router_topk=config.moe_router_topk, moe_ffn_hidden_size=config.moe_ffn_size,
            moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
            moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=config.moe_shared_expert_gate,
            moe_router_load_balancing_type=config.moe_router_load_balancing_type,
            moe_router_pre_softmax=config.moe_router_pre_softmax,
            moe_router_score_function=config.moe_router_score_function,
            moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
            moe_router_num_groups=config.moe_router_num_groups, moe_router_group_topk=config.moe_router_group_topk,
            moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
            moe_router_dtype=config.moe_router_dtype, moe_grouped_gemm=config.moe_grouped_gemm,
            moe_expert_capacity_factor=config.moe_expert_capacity_factor,
            moe_token_drop_policy=config.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=config.moe_pad_expert_input_to_capacity,
            moe_aux_loss_coeff=config.moe_aux_loss_coeff, moe_z_loss_coeff=config.moe_z_loss_coeff,
            moe_router_bias_update_rate=config.moe_router_bias_update_rate)
    if mla:
        args.update(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                    qk_head_dim=config.qk_head_dim, qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
                    v_head_dim=config.v_head_dim)
    if config.position_embedding_type == "rope" and config.resolved_rope_type == "llama3":
        # Megatron-LM's --use-rope-scaling: Llama 3.1's scaling with its factor, low 1, high 4 and original 8192
        # fixed; megazero's own factors ride beside it under names Megatron-LM does not use.
        args.update(rope_type="rope", use_rope_scaling=True, rope_scaling_factor=config.rotary_scaling_factor,
                    rope_scaling_low_freq_factor=config.low_freq_factor,
                    rope_scaling_high_freq_factor=config.high_freq_factor,
                    rope_scaling_original_max_position_embeddings=config.original_max_position_embeddings)
    elif config.position_embedding_type == "rope":
        args["rope_type"] = config.resolved_rope_type
        if config.resolved_rope_type == "yarn":
            args.update(rotary_scaling_factor=config.rotary_scaling_factor,
                        original_max_position_embeddings=config.original_max_position_embeddings,
                        beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                        mscale_all_dim=config.mscale_all_dim,
                        yarn_correction_range_round_to_int=config.yarn_correction_range_round_to_int)
    return args
