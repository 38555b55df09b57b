"""Closed-form parameter counts and training FLOPs of a GPTConfig.

Parameters: exact for any config (checked against the model built on ``meta``). For
the default architecture (tied, learned positions, biases, LayerNorm, GeLU, ffn=4h)
it is Narayanan et al. 2021's ``P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))`` plus the
final LayerNorm's ``2h``, with V the padded vocabulary and s the position table size.

FLOPs: matmul FLOPs only (2 per multiply-add). Per token and layer, forward:
QKV ``2h(heads+2*groups)d`` + scores and context ``4 s heads d`` (the full s x s square,
as the paper counts it) + projection ``2 heads d h`` + MLP ``2h*ffn*(2 if swiglu else 1)
+ 2*ffn*h``; the logit layer adds ``2hV``. Backward costs twice the forward; full
recomputation adds one more forward of the transformer layers (not of the logit layer).
For the default architecture with full recompute this is exactly Eq. 3 of the paper,
``F = 96 B s l h^2 (1 + s/(6h) + V/(16lh))``; without recompute it is
``72 B s l h^2 (1 + s/(6h) + V/(12lh))`` (Megatron-DeepSpeed's code reuses V/(16lh) there,
which undercounts the logit layer by 1.5 B s h V).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .config import GPTConfig

__all__ = ["num_parameters", "expert_parameters", "mlp_parameters", "active_parameters", "moe_layers", "flops_per_iteration",
           "flops_per_token", "layer_forward_flops_per_token"]


def moe_layers(c: GPTConfig) -> int:
    """How many layers are mixtures of experts (:meth:`GPTConfig.is_moe_layer`)."""
    return sum(c.is_moe_layer(i) for i in range(c.num_layers))


def _expert(c: GPTConfig, width: Optional[int] = None) -> int:
    """One routed expert's parameters (with biases where the model has them); ``width``: another MLP width
    (a shared expert)."""
    gate = 2 if c.activation == "swiglu" else 1
    f = width or c.moe_ffn_size
    bias = gate * f + c.hidden_size if c.add_bias_linear else 0
    return c.hidden_size * gate * f + f * c.hidden_size + bias


def _shared(c: GPTConfig) -> int:
    """A mixture layer's shared expert and its gate (0 without one)."""
    width = c.moe_shared_expert_intermediate_size
    return (_expert(c, width) + (c.hidden_size if c.moe_shared_expert_gate else 0)) if width else 0


def mlp_parameters(c: GPTConfig) -> tuple[int, int]:
    """(a dense layer's MLP, a mixture layer's MLP without its routed experts: the router and the shared
    expert), the parameters by which the two kinds of layer differ outside the experts."""
    h, f, gate = c.hidden_size, c.ffn_size, 2 if c.activation == "swiglu" else 1
    bias = 1 if c.add_bias_linear else 0
    return h * gate * f + bias * gate * f + f * h + bias * h, (h * c.num_experts + _shared(c)) if c.num_experts else 0


def expert_parameters(c: GPTConfig) -> int:
    """The routed experts' parameters of the whole model (0 for a dense model)."""
    return moe_layers(c) * c.num_experts * _expert(c) if c.num_experts else 0


def active_parameters(c: GPTConfig) -> int:
    """Parameters one token passes through: all but the routed experts, plus the k it is routed to."""
    return num_parameters(c) - expert_parameters(c) + moe_layers(c) * c.moe_router_topk * _expert(c)


def _config_parameters(c: GPTConfig) -> int:
    h, d, n, g, f, v = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size, c.padded_vocab_size
    bias = 1 if c.add_bias_linear else 0
    gate = 2 if c.activation == "swiglu" else 1
    norm = h * (2 if c.normalization == "layernorm" else 1)
    qkv = (n + 2 * g) * d
    qk_norm = 2 * d * (2 if c.normalization == "layernorm" else 1) if c.qk_layernorm else 0
    layer = (2 * norm + qk_norm
             + h * qkv + (1 if c.add_bias_linear or c.add_qkv_bias else 0) * qkv  # linear_qkv
             + n * d * h + bias * h  # linear_proj
             + h * gate * f + bias * gate * f  # linear_fc1
             + f * h + bias * h)  # linear_fc2
    mlp, mixture = mlp_parameters(c)
    total = v * h + c.num_layers * layer + norm
    if c.num_experts:  # a mixture's MLP is its router and experts
        total += moe_layers(c) * (mixture + c.num_experts * _expert(c) - mlp)
    if c.position_embedding_type == "learned":
        total += c.max_position_embeddings * h
    if not c.tie_embeddings:
        total += v * h
    return total


def num_parameters(model_or_config: Union[torch.nn.Module, GPTConfig], *, local: bool = False) -> int:
    """Number of parameters of the full (unsharded) model.

    For a config: closed form (nothing is built). For a module: counted from its
    parameters, multiplying TP shards by the model's ``tp_size`` (``local=True``: just this
    rank's elements). Works on meta models.
    """
    if isinstance(model_or_config, GPTConfig):
        return _config_parameters(model_or_config)
    tp = 1 if local else int(getattr(model_or_config, "tp_size", 1))
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in model_or_config.parameters())


def layer_forward_flops_per_token(config: GPTConfig, seq_length: Optional[int] = None) -> int:
    """Forward matmul FLOPs of one transformer layer for one token of a length-``seq_length`` sequence."""
    c = config
    s = seq_length or c.seq_length
    h, d, n, g, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.query_groups, c.ffn_size
    gate = 2 if c.activation == "swiglu" else 1
    return 2 * h * (n + 2 * g) * d + 4 * s * n * d + 2 * n * d * h + 2 * h * gate * f + 2 * f * h


def _moe_flops_per_token(c: GPTConfig) -> int:
    """What the mixtures add to :func:`layer_forward_flops_per_token` summed over the layers: the k
    experts' MLPs and the router (2hE) in place of the dense MLP."""
    if not c.num_experts:
        return 0
    gate = 2 if c.activation == "swiglu" else 1
    dense = 2 * c.hidden_size * gate * c.ffn_size + 2 * c.ffn_size * c.hidden_size
    return moe_layers(c) * (c.moe_router_topk * 2 * _expert(c) + 2 * c.hidden_size * c.num_experts + 2 * _shared(c)
                            - dense)


def flops_per_iteration(config: GPTConfig, global_batch_size: int, seq_length: Optional[int] = None,
                        recompute_full: bool = False) -> float:
    """Training FLOPs (forward + backward [+ recompute]) of one iteration of ``global_batch_size`` sequences."""
    s = seq_length or config.seq_length
    f = 4 if recompute_full else 3
    layers = config.num_layers * layer_forward_flops_per_token(config, s) + _moe_flops_per_token(config)
    logits = 2 * config.hidden_size * config.padded_vocab_size
    return float(global_batch_size * s * (f * layers + 3 * logits))


def flops_per_token(config: GPTConfig, seq_length: Optional[int] = None, recompute_full: bool = False) -> float:
    """Training FLOPs per token (``flops_per_iteration`` / tokens)."""
    s = seq_length or config.seq_length
    return flops_per_iteration(config, 1, s, recompute_full) / s
