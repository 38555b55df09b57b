"""The checks of :class:`~megazero.model.config.GPTConfig` that span several fields: gated units, mixtures of
experts, multi-latent attention, RoPE scaling and multi-token prediction. ``GPTConfig.validate`` runs them;
each raises ValueError naming the clashing values."""

from __future__ import annotations

from typing import Any

GPTConfig = Any  # megazero.model.config.GPTConfig, which imports this module

__all__ = ["check_glu", "check_moe", "check_mla", "check_rope_scaling", "check_mtp"]


def check_glu(c: GPTConfig) -> None:
    clamp = c.activation_func_clamp_value
    if (c.glu_linear_offset or clamp is not None) and not c.gated_linear_unit:
        raise ValueError(f"glu_linear_offset and activation_func_clamp_value apply to a gated MLP (activation "
                         f"'swiglu' or 'quick_geglu'), got activation={c.activation!r}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"activation_func_clamp_value must be > 0 (or None), got {clamp}")


def check_moe(c: GPTConfig, tp_size: int) -> None:
    e, k = c.num_experts, c.moe_router_topk
    if e < 1 or not 1 <= k <= e:
        raise ValueError(f"num_experts must be >= 1 and moe_router_topk in 1..num_experts, got {e} experts, "
                         f"top-{k}")
    f = c.moe_layer_freq
    if isinstance(f, (tuple, list)):
        if len(f) != c.num_layers or set(f) - {0, 1}:
            raise ValueError(f"moe_layer_freq pattern {list(f)} must give 0 (dense) or 1 (experts) for each of the "
                             f"{c.num_layers} layers")
    elif f < 1:
        raise ValueError(f"moe_layer_freq must be >= 1, got {f}")
    if c.moe_ffn_size % tp_size:
        raise ValueError(f"moe ffn size ({c.moe_ffn_size}) must be divisible by the tensor parallel size "
                         f"({tp_size})")
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % tp_size):
        raise ValueError(f"moe_shared_expert_intermediate_size ({shared}) must be >= 1 and divisible by the "
                         f"tensor parallel size ({tp_size})")
    if c.moe_shared_expert_gate and shared is None:
        raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size (a shared expert)")
    if c.moe_router_score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', got "
                         f"{c.moe_router_score_function!r}")
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' (DeepSeek-V3's "
                         "routing; the bias is added to the sigmoid scores that choose the experts)")
    if c.moe_router_dtype not in ("fp32", "fp64"):
        raise ValueError(f"moe_router_dtype must be 'fp32' or 'fp64', got {c.moe_router_dtype!r}")
    g, gk = c.moe_router_num_groups, c.moe_router_group_topk
    if (g is None) != (gk is None):
        raise ValueError("moe_router_num_groups and moe_router_group_topk go together")
    if g is not None and (e % g or not 1 <= gk <= g or k % gk or (e // g) < k // gk):
        raise ValueError(f"group-limited routing: {e} experts in {g} groups (must divide), {gk} groups per "
                         f"token (1..{g}, dividing top-{k}), each group holding at least {k} // {gk} experts")
    if c.moe_expert_capacity_factor is not None and c.moe_expert_capacity_factor <= 0:
        raise ValueError(f"moe_expert_capacity_factor must be > 0, got {c.moe_expert_capacity_factor}")
    if c.moe_pad_expert_input_to_capacity and c.moe_expert_capacity_factor is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor (the capacity to pad to)")
    if c.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(f"moe_token_drop_policy must be 'probs' or 'position', got {c.moe_token_drop_policy!r}")
    if c.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
        raise ValueError(f"moe_router_load_balancing_type {c.moe_router_load_balancing_type!r}: 'aux_loss', "
                         "'seq_aux_loss' or 'none' (sinkhorn is not available)")


def check_mla(c: GPTConfig) -> None:
    for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
        if getattr(c, name) < 1:
            raise ValueError(f"multi-latent attention: {name} must be >= 1, got {getattr(c, name)}")
    if c.latent_layernorm_epsilon is not None and not c.latent_layernorm_epsilon > 0:
        raise ValueError(f"latent_layernorm_epsilon must be > 0 or None, got {c.latent_layernorm_epsilon}")
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        raise ValueError(f"q_lora_rank must be >= 1 or None (no query LoRA), got {c.q_lora_rank}")
    d = c.qk_pos_emb_head_dim
    if c.position_embedding_type not in ("rope", "none"):
        raise ValueError(f"multi-latent attention rotates its decoupled query/key parts: it needs "
                         f"position_embedding_type='rope' (or 'none': the parts unrotated, Kimi Linear's NoPE), got "
                         f"{c.position_embedding_type!r}")
    rotated = c.position_embedding_type == "rope"
    if rotated and (d < 2 or d % 2):
        raise ValueError(f"qk_pos_emb_head_dim ({d}) must be even and >= 2: RoPE rotates pairs")
    if d < 0:
        raise ValueError(f"qk_pos_emb_head_dim must be >= 0, got {d}")
    if rotated and c.rotary_percent != 1.0:
        raise ValueError(f"multi-latent attention rotates the whole qk_pos_emb_head_dim; rotary_percent must "
                         f"be 1.0, got {c.rotary_percent}")
    if c.num_query_groups is not None and c.num_query_groups != c.num_attention_heads:
        raise ValueError(f"multi-latent attention has no query groups (num_query_groups={c.num_query_groups}):"
                         f" leave it unset")


def check_rope_scaling(c: GPTConfig) -> None:
    kind = c.resolved_rope_type
    if kind not in ("rope", "yarn", "llama3"):
        raise ValueError(f"rope_type must be 'rope', 'yarn' or 'llama3', got {c.rope_type!r}")
    if kind == "llama3":
        check_llama3_rope(c)
    if kind == "yarn":
        if c.position_embedding_type != "rope":
            raise ValueError("rope_type='yarn' needs position_embedding_type='rope'")
        if not c.rotary_scaling_factor > 0:
            raise ValueError(f"YaRN needs rotary_scaling_factor > 0 (the context extension), got "
                             f"{c.rotary_scaling_factor}")
        if c.original_max_position_embeddings < 1:
            raise ValueError(f"original_max_position_embeddings must be >= 1, got "
                             f"{c.original_max_position_embeddings}")
        if not 0 < c.beta_slow <= c.beta_fast:
            raise ValueError(f"YaRN needs 0 < beta_slow <= beta_fast, got {c.beta_slow}, {c.beta_fast}")


def check_llama3_rope(c: GPTConfig) -> None:
    if c.position_embedding_type != "rope" or c.multi_latent_attention:
        raise ValueError("rope_type='llama3' needs position_embedding_type='rope' without multi-latent attention")
    if not c.rotary_scaling_factor > 0 or c.original_max_position_embeddings < 1:
        raise ValueError(f"rope_type='llama3' needs rotary_scaling_factor > 0 and original_max_position_embeddings "
                         f">= 1, got {c.rotary_scaling_factor}, {c.original_max_position_embeddings}")
    if not 0 < c.low_freq_factor < c.high_freq_factor:
        raise ValueError(f"rope_type='llama3' needs 0 < low_freq_factor < high_freq_factor, got "
                         f"{c.low_freq_factor}, {c.high_freq_factor}")


def check_mtp(c: GPTConfig) -> None:
    if c.mtp_num_layers < 0:
        raise ValueError(f"mtp_num_layers must be >= 0, got {c.mtp_num_layers}")
    if c.mtp_num_layers and c.seq_length < c.mtp_num_layers + 1:
        raise ValueError(f"multi-token prediction with {c.mtp_num_layers} layers predicts "
                         f"{c.mtp_num_layers + 1} tokens ahead: seq_length ({c.seq_length}) must be >= "
                         f"{c.mtp_num_layers + 1}")
    if not c.mtp_loss_scaling_factor >= 0:
        raise ValueError(f"mtp_loss_scaling_factor must be >= 0, got {c.mtp_loss_scaling_factor}")


def check_recurrent(c: GPTConfig, tp_size: int) -> None:
    """Gated DeltaNet's, KDA's and Mamba-2's sizes against each other and the tensor-parallel size (heads and groups
    are never split by TP), and the hybrid pattern's mixtures of experts against ``num_experts``."""
    kinds = [c.layer_kinds(i) for i in range(c.num_layers)]
    mixers = {k.mixer for k in kinds}
    if c.hybrid_layer_pattern is not None and not all(k.mixer or k.mlp for k in kinds):
        raise ValueError("every hybrid layer needs a mixer or an MLP")  # unreachable with valid symbols
    if c.hybrid_layer_pattern is not None and ("E" in c.hybrid_layer_pattern) != bool(c.num_experts):
        raise ValueError(f"hybrid layer pattern {c.hybrid_layer_pattern!r} " + (
            "has mixture-of-experts layers (E): set --num-experts" if c.num_experts is None else
            f"has no mixture-of-experts layer (E) but num_experts is {c.num_experts}: add E layers or drop it"))
    if "gdn" in mixers:
        nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
        if min(nk, nv, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) < 1:
            raise ValueError("Gated DeltaNet's head counts, head dimensions and convolution width must be >= 1")
        if nv % nk:
            raise ValueError(f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk}): each "
                             "key head serves the same number of value heads")
        if nk % tp_size:
            raise ValueError(f"linear_num_key_heads ({nk}) must be divisible by the tensor parallel size ({tp_size}): "
                             "TP splits Gated DeltaNet by key heads; lower tp")
    if "kda" in mixers:
        check_kda(c, tp_size)
    if "mamba" in mixers:
        heads, groups = c.mamba_heads, c.mamba_num_groups
        if min(heads, groups, c.mamba_head_dim, c.mamba_state_dim, c.linear_conv_kernel_dim) < 1:
            raise ValueError(f"Mamba-2 needs heads, groups, head and state dimensions >= 1, got {heads} heads "
                             f"(mamba_num_heads={c.mamba_num_heads}, 2 x hidden / mamba_head_dim when None), "
                             f"{groups} groups, head dim {c.mamba_head_dim}, state dim {c.mamba_state_dim}")
        if c.mamba_num_heads is None and (2 * c.hidden_size) % c.mamba_head_dim:
            raise ValueError(f"Mamba-2's heads default to 2 x hidden_size / mamba_head_dim = {2 * c.hidden_size} / "
                             f"{c.mamba_head_dim}, which does not divide: set mamba_num_heads (--mamba-num-heads)")
        if heads % groups:
            raise ValueError(f"mamba heads ({heads}) must be a multiple of mamba_num_groups ({groups})")
        if groups % tp_size:
            raise ValueError(f"mamba_num_groups ({groups}) must be divisible by the tensor parallel size ({tp_size}): "
                             "TP splits Mamba-2 by whole groups (its grouped norm never spans two ranks); lower tp "
                             "or raise --mamba-num-groups")
    if c.linear_cp_comm_type not in ("state_passing", "a2a"):
        raise ValueError(f"linear_cp_comm_type must be 'state_passing' or 'a2a', got {c.linear_cp_comm_type!r}")
    if c.attention_output_gate and c.multi_latent_attention:
        raise ValueError("attention_output_gate is for standard attention (Qwen3-Next's), not multi-latent attention")


def check_kda(c: GPTConfig, tp_size: int) -> None:
    """Kimi Delta Attention's sizes: one value head per key head (Kimi Linear's and Megatron's layout), key heads
    split by TP, low-rank projections of rank >= 1."""
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    if min(nk, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) < 1:
        raise ValueError("KDA's head count, head dimensions and convolution width must be >= 1")
    if nv != nk:
        raise ValueError(f"KDA has one value head per key head: linear_num_value_heads ({nv}) must equal "
                         f"linear_num_key_heads ({nk})")
    if nk % tp_size:
        raise ValueError(f"linear_num_key_heads ({nk}) must be divisible by the tensor parallel size ({tp_size}): "
                         "TP splits KDA by heads; lower tp")
    for name in ("kda_f_lora_rank", "kda_gate_lora_rank"):
        rank = getattr(c, name)
        if rank is not None and rank < 1:
            raise ValueError(f"{name} must be >= 1 (a low-rank projection), or None for a full-rank one; got {rank}")
