"""Closed-form parameter counts and training FLOPs of a GPTConfig.

Parameters: exact for any config (checked against the model built on ``meta``), multi-latent
attention and multi-token prediction's depths included (the embedding's copy on a later pipeline
stage is the same parameter, counted once). For the default architecture (tied, learned positions,
biases, LayerNorm, GeLU, ffn=4h) it is Narayanan et al. 2021's ``P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))`` plus the
final LayerNorm's ``2h``, with V the padded vocabulary and s the position table size.

FLOPs: matmul FLOPs only (2 per multiply-add). Per token and layer, forward:
QKV ``2h(heads+2*groups)d`` + scores and context ``4 s heads d`` (the full s x s square,
as the paper counts it) + projection ``2 heads d h`` + MLP ``2h*ffn*(2 if swiglu else 1)
+ 2*ffn*h``; the logit layer adds ``2hV``. Multi-latent attention: its down- and up-projections
in place of QKV, scores at ``qk_dim`` and context at ``v_dim`` (``4 s heads d`` is
``2 s heads (qk_dim + v_dim)``). Each multi-token prediction depth adds its ``eh_proj`` ``4h^2``, a
layer and the logits ``2hV``. Backward costs twice the forward; full recomputation adds one more
forward of the decoder layers (not of the logit layer nor the prediction depths).
Hybrid stacks (``GPTConfig.layer_kinds``): each layer counts its own parts, a norm for each of its mixer and
MLP; a recurrent mixer (Gated DeltaNet, Mamba-2: :mod:`megazero.model.recurrent.counts`) counts its projections,
its convolution and its chunked scan, which grow with no power of s; attention layers keep their square. A
multi-token prediction depth is built as the last layer (``mtp.py``) and counted as it.
For the default architecture with full recompute this is exactly Eq. 3 of the paper,
``F = 96 B s l h^2 (1 + s/(6h) + V/(16lh))``; without recompute it is
``72 B s l h^2 (1 + s/(6h) + V/(12lh))`` (Megatron-DeepSpeed's code reuses V/(16lh) there,
which undercounts the logit layer by 1.5 B s h V).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Union

import torch

from .config import GPTConfig
from .layer_pattern import RECURRENT_MIXERS, LayerKinds
from .recurrent.counts import recurrent_flops_per_token, recurrent_parameters

__all__ = ["num_parameters", "expert_parameters", "mlp_parameters", "attention_parameters", "mtp_parameters",
           "replicated_parameters", "mixer_parameters", "layer_parameters", "layer_flops_per_token", "uniform_layers",
           "active_parameters", "moe_layers", "flops_per_iteration", "flops_per_token", "layer_forward_flops_per_token",
           "attention_matrices", "attention_square_flops_per_token"]


def moe_layers(c: GPTConfig) -> int:
    """How many layers are mixtures of experts (:meth:`GPTConfig.is_moe_layer`)."""
    return sum(c.is_moe_layer(i) for i in range(c.num_layers))


def _mtp_moe_layers(c: GPTConfig) -> int:
    """How many multi-token prediction layers are mixtures (each is of the last layer's kind)."""
    return c.mtp_num_layers if c.mtp_num_layers and c.is_moe_layer(c.num_layers - 1) else 0


def _norm(c: GPTConfig, size: Optional[int] = None) -> int:
    return (size or c.hidden_size) * (2 if c.normalization == "layernorm" else 1)


def _expert(c: GPTConfig, width: Optional[int] = None) -> int:
    """One routed expert's parameters (with biases where the model has them); ``width``: another MLP width
    (a shared expert)."""
    gate = 2 if c.gated_linear_unit else 1
    f = width or c.moe_ffn_size
    bias = gate * f + c.hidden_size if c.add_bias_linear else 0
    return c.hidden_size * gate * f + f * c.hidden_size + bias


def _shared(c: GPTConfig) -> int:
    """A mixture layer's shared expert and its gate (0 without one)."""
    width = c.moe_shared_expert_intermediate_size
    return (_expert(c, width) + (c.hidden_size if c.moe_shared_expert_gate else 0)) if width else 0


def attention_parameters(c: GPTConfig) -> tuple[int, int]:
    """(one layer's attention parameters, those of them tensor parallelism replicates).

    Standard: the fused QKV (``(heads + 2 groups) d`` rows), the per-head query/key norms and the
    projection; replicated: the query/key norms and the projection's bias;
    with ``attention_output_gate`` the QKV also projects a gate per query head (``n d`` more rows). Multi-latent
    attention: the query projection ``[n (qk + rope), h]`` or its down-projection ``[q_lora, h]``, norm and
    up-projection ``[n (qk + rope), q_lora]``; the key/value down-projection ``[kv_lora + rope, h]`` (the
    latent and the shared RoPE key), its norm and up-projection ``[n (qk + v), kv_lora]``; the projection
    ``[h, n v]``; replicated: the down-projections, their norms and the projection's bias."""
    h, n, b = c.hidden_size, c.num_attention_heads, 1 if c.add_bias_linear else 0
    proj_bias = b * h
    if not c.multi_latent_attention:  # an output gate (Qwen3-Next's) projects one gate head per query head
        gates = n if c.attention_output_gate else 0
        d, qkv = c.head_dim, (c.num_attention_heads + gates + 2 * c.query_groups) * c.head_dim
        qk_norm = 2 * _norm(c, d) if c.qk_layernorm else 0
        qkv_bias = (1 if c.add_bias_linear or c.add_qkv_bias else 0) * qkv
        return h * qkv + qkv_bias + qk_norm + n * d * h + proj_bias, qk_norm + proj_bias
    qk, rope, v, kv_lora = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.kv_lora_rank
    q_out = n * (qk + rope)
    replicated = (h + b) * (kv_lora + rope) + _norm(c, kv_lora) + proj_bias
    sharded = (kv_lora + b) * n * (qk + v) + n * v * h
    if c.q_lora_rank is None:
        sharded += (h + b) * q_out
    else:
        replicated += (h + b) * c.q_lora_rank + _norm(c, c.q_lora_rank)
        sharded += (c.q_lora_rank + b) * q_out
    return sharded + replicated, replicated


def mlp_parameters(c: GPTConfig) -> tuple[int, int]:
    """(a dense layer's MLP, a mixture layer's MLP without its routed experts: the router and the shared
    expert), the parameters by which the two kinds of layer differ outside the experts."""
    h, f, gate = c.hidden_size, c.ffn_size, 2 if c.gated_linear_unit else 1
    bias = 1 if c.add_bias_linear else 0
    return h * gate * f + bias * gate * f + f * h + bias * h, (_router(c) + _shared(c)) if c.num_experts else 0


def _router(c: GPTConfig) -> int:
    """A mixture layer's router: its weight ``[E, h]`` and, with ``moe_router_bias``, its bias ``[E]``."""
    return (c.hidden_size + (1 if c.moe_router_bias else 0)) * c.num_experts


def uniform_layers(c: GPTConfig) -> bool:
    """Every decoder layer is attention and an MLP (a GPT without recurrent or one-part layers), the model the
    closed forms averaged over layers describe."""
    if c.hybrid_layer_pattern is None and c.linear_attention_freq is None:
        return True
    return all(k.mixer in ("standard", "mla") and k.mlp for k in map(c.layer_kinds, range(c.num_layers)))


def mixer_parameters(c: GPTConfig, kind: str) -> tuple[int, int]:
    """(one ``kind`` mixer's parameters, those of them tensor parallelism replicates): attention's
    (:func:`attention_parameters`) or a recurrent mixer's
    (:func:`~megazero.model.recurrent.counts.recurrent_parameters`)."""
    return recurrent_parameters(c, kind) if kind in RECURRENT_MIXERS else attention_parameters(c)


def _mlp_part(c: GPTConfig, kind: str) -> tuple[int, int, int]:
    """(an MLP's parameters, routed experts included; those TP replicates; its routed experts'). Replicated: the
    dense fc2's bias; a mixture's router, its shared expert's gate and fc2 bias (the routed experts' are theirs)."""
    bias = c.hidden_size if c.add_bias_linear else 0
    dense, mixture = mlp_parameters(c)
    if kind == "dense":
        return dense, bias, 0
    shared = c.moe_shared_expert_intermediate_size
    experts = c.num_experts * _expert(c)
    replicated = _router(c) + (c.hidden_size if c.moe_shared_expert_gate and shared else 0) + (bias if shared else 0)
    return mixture + experts, replicated, experts


def _kinds(c: GPTConfig, number: int) -> LayerKinds:
    """Layer ``number``'s parts; a multi-token prediction depth (``number >= num_layers``) is built as the last
    layer (``mtp.py``)."""
    return c.layer_kinds(min(number, c.num_layers - 1))


def layer_parameters(c: GPTConfig, number: int) -> tuple[int, int, int]:
    """(layer ``number``'s parameters, those TP replicates, its routed experts'): a norm and the mixer, a norm and
    the MLP (a mixture's with every routed expert), for the parts the layer has."""
    return _kinds_parameters(c, _kinds(c, number))


def _decoder_parameters(c: GPTConfig) -> tuple[int, int]:
    """(the decoder layers' parameters, those TP replicates), each kind of layer counted once."""
    counts = Counter(map(c.layer_kinds, range(c.num_layers)))
    per_kind = {kinds: _kinds_parameters(c, kinds) for kinds in counts}
    return (sum(n * per_kind[k][0] for k, n in counts.items()), sum(n * per_kind[k][1] for k, n in counts.items()))


def _kinds_parameters(c: GPTConfig, kinds: LayerKinds) -> tuple[int, int, int]:
    total = replicated = experts = 0
    if kinds.mixer is not None:
        mixer, mixer_replicated = mixer_parameters(c, kinds.mixer)
        total, replicated = _norm(c) + mixer, _norm(c) + mixer_replicated
    if kinds.mlp is not None:
        mlp, mlp_replicated, experts = _mlp_part(c, kinds.mlp)
        total, replicated = total + _norm(c) + mlp, replicated + _norm(c) + mlp_replicated
    return total, replicated, experts


def mtp_parameters(c: GPTConfig) -> tuple[int, int, int]:
    """(the D multi-token prediction depths' parameters, those tensor parallelism replicates, their routed
    experts'). Each depth: two input norms, ``eh_proj`` ``[h, 2h]``, a layer of the last layer's kinds and a
    final norm; the embedding and the head are the main model's (not counted here)."""
    if not c.mtp_num_layers:
        return 0, 0, 0
    layer, replicated, experts = layer_parameters(c, c.num_layers)
    depth = 3 * _norm(c) + 2 * c.hidden_size * c.hidden_size + layer
    return c.mtp_num_layers * depth, c.mtp_num_layers * (3 * _norm(c) + replicated), c.mtp_num_layers * experts


def replicated_parameters(config: GPTConfig) -> int:
    """Parameters that tensor parallelism does not shard, in the whole model: norms, row-parallel biases
    (attention projection, second MLP linear), the learned position table, the routers (and shared-expert
    gates) of a mixture of experts, multi-latent attention's down-projections and their norms, the recurrent
    mixers' small weights (convolution, decays, norm), and the multi-token prediction depths' own."""
    c = config
    total = _decoder_parameters(c)[1] + _norm(c)
    if c.position_embedding_type == "learned":
        total += c.max_position_embeddings * c.hidden_size
    return total + mtp_parameters(c)[1]


def expert_parameters(c: GPTConfig) -> int:
    """The routed experts' parameters of the whole model, multi-token prediction's too (0 for a dense model)."""
    return (moe_layers(c) + _mtp_moe_layers(c)) * c.num_experts * _expert(c) if c.num_experts else 0


def active_parameters(c: GPTConfig) -> int:
    """Parameters one token passes through: all but the routed experts, plus the k it is routed to (in the
    multi-token prediction layers too)."""
    blocks = moe_layers(c) + _mtp_moe_layers(c)
    return num_parameters(c) - expert_parameters(c) + blocks * c.moe_router_topk * _expert(c) if c.num_experts \
        else num_parameters(c)


def _config_parameters(c: GPTConfig) -> int:
    h, v = c.hidden_size, c.padded_vocab_size
    total = v * h + _decoder_parameters(c)[0] + _norm(c)
    if c.position_embedding_type == "learned":
        total += c.max_position_embeddings * h
    if not c.tie_embeddings:
        total += v * h
    return total + mtp_parameters(c)[0]  # the embedding's copy on a last stage is the same parameter


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


def attention_matrices(c: GPTConfig) -> list[tuple[int, int]]:
    """The weight matrices of one layer's attention as ``(rows, columns)``, whole (before TP), Q, K and V
    apart: standard ``[n d, h]`` (and the output gate's ``[n d, h]``), ``[g d, h]`` twice and the projection
    ``[h, n v]``; multi-latent
    attention the query projection ``[n (qk + rope), h]`` (or its up-projection from ``q_lora`` and the
    down-projection ``[q_lora, h]``), the key/value down-projection ``[kv_lora + rope, h]``, its
    up-projection ``[n (qk + v), kv_lora]`` and the projection ``[h, n v]``. Their sizes are the
    attention's multiply-adds per token outside the s x s square."""
    h, n = c.hidden_size, c.num_attention_heads
    out = (h, n * c.v_dim)
    if not c.multi_latent_attention:
        d, g = c.head_dim, c.query_groups
        gate = [(n * d, h)] if c.attention_output_gate else []  # Qwen3-Next's output gate, projected beside Q
        return [(n * d, h)] + gate + [(g * d, h), (g * d, h), out]
    q_out = n * (c.qk_head_dim + c.qk_pos_emb_head_dim)
    queries = [(q_out, h)] if c.q_lora_rank is None else [(q_out, c.q_lora_rank), (c.q_lora_rank, h)]
    return queries + [(c.kv_lora_rank + c.qk_pos_emb_head_dim, h),
                      (n * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank), out]


def _square_keys(window: Optional[int], s: int) -> float:
    """The keys per query of the square convention (twice what a causal query sees on average): s without a
    window; a window of w keys before the query sees w + 1 - w (w + 1) / 2s on average."""
    if window is None or window + 1 >= s:
        return float(s)
    return 2.0 * (window + 1 - window * (window + 1) / (2.0 * s))


def attention_square_flops_per_token(c: GPTConfig, seq_length: Optional[int] = None) -> int:
    """Forward FLOPs of the attention's scores at ``qk_dim`` and context at ``v_dim`` for one token over the
    whole s x s square (a causal kernel computes half of it), averaged over the layers: a sliding layer's
    square is as wide as twice the keys its window shows a query on average; a layer without attention (a
    recurrent or MLP-only layer of a hybrid stack) has none, so ``num_layers`` times this is the model's."""
    s = seq_length or c.seq_length
    keys = sum(_square_keys(c.layer_window(i), s) for i in range(c.num_layers)
               if c.layer_kinds(i).mixer in ("standard", "mla")) / c.num_layers
    return round(2 * keys * c.num_attention_heads * (c.qk_dim + c.v_dim))


def layer_forward_flops_per_token(config: GPTConfig, seq_length: Optional[int] = None) -> int:
    """Forward matmul FLOPs of one (dense) transformer layer for one token of a length-``seq_length``
    sequence: the attention's matrices, the scores at ``qk_dim`` and the context at ``v_dim`` over the
    whole s x s square, and the dense MLP."""
    c = config
    h, f = c.hidden_size, c.ffn_size
    gate = 2 if c.gated_linear_unit else 1
    attention = 2 * sum(r * k for r, k in attention_matrices(c)) + attention_square_flops_per_token(c, seq_length)
    return attention + 2 * h * gate * f + 2 * f * h


def _moe_flops_delta(c: GPTConfig) -> int:
    """What one mixture layer adds to :func:`layer_forward_flops_per_token`: the k experts' MLPs, the shared
    expert and the router (2hE) in place of the dense MLP."""
    gate = 2 if c.gated_linear_unit else 1
    dense = 2 * c.hidden_size * gate * c.ffn_size + 2 * c.ffn_size * c.hidden_size
    return c.moe_router_topk * 2 * _expert(c) + 2 * c.hidden_size * c.num_experts + 2 * _shared(c) - dense


def _mlp_flops_per_token(c: GPTConfig, kind: Optional[str]) -> int:
    """Forward FLOPs of an MLP for one token: the dense one's two linears, or a mixture's k routed experts,
    shared expert and router (2hE)."""
    if kind is None:
        return 0
    if kind == "moe":
        return c.moe_router_topk * 2 * _expert(c) + 2 * c.hidden_size * c.num_experts + 2 * _shared(c)
    gate = 2 if c.gated_linear_unit else 1
    return 2 * c.hidden_size * gate * c.ffn_size + 2 * c.ffn_size * c.hidden_size


def layer_flops_per_token(c: GPTConfig, number: int, seq_length: Optional[int] = None) -> int:
    """Forward matmul FLOPs of layer ``number`` for one token of a length-``seq_length`` sequence, by its parts:
    attention's matrices and its square (the layer's window), or a recurrent mixer's projections, convolution
    and scan (no term in s); and the MLP. A multi-token prediction depth's layer is the last layer's."""
    s = seq_length or c.seq_length
    kinds = _kinds(c, number)
    if kinds.mixer is None:
        mixer = 0
    elif kinds.mixer in RECURRENT_MIXERS:
        mixer = recurrent_flops_per_token(c, kinds.mixer)
    else:
        square = round(2 * _square_keys(c.layer_window(number), s) * c.num_attention_heads * (c.qk_dim + c.v_dim))
        mixer = 2 * sum(r * k for r, k in attention_matrices(c)) + square
    return mixer + _mlp_flops_per_token(c, kinds.mlp)


def _layers_flops_per_token(c: GPTConfig, s: int) -> int:
    """Forward FLOPs of the decoder layers for one token: a uniform model's as Narayanan et al. count them
    (layers x one layer, the square averaged over the layers, the mixtures' difference added), else layer by
    layer."""
    if not uniform_layers(c):
        return sum(layer_flops_per_token(c, i, s) for i in range(c.num_layers))
    layers = c.num_layers * layer_forward_flops_per_token(c, s)
    return layers + moe_layers(c) * _moe_flops_delta(c) if c.num_experts else layers


def _mtp_flops_per_token(c: GPTConfig, s: int) -> int:
    """Forward FLOPs of the multi-token prediction depths per token: each one's ``eh_proj``, its layer (of
    the last layer's kind) and the head's logits."""
    if not c.mtp_num_layers:
        return 0
    if uniform_layers(c):
        layer = layer_forward_flops_per_token(c, s) + (_moe_flops_delta(c) if c.is_moe_layer(c.num_layers - 1) else 0)
    else:
        layer = layer_flops_per_token(c, c.num_layers, s)
    return c.mtp_num_layers * (2 * 2 * c.hidden_size * c.hidden_size + layer + 2 * c.hidden_size * c.padded_vocab_size)


def flops_per_iteration(config: GPTConfig, global_batch_size: int, seq_length: Optional[int] = None,
                        recompute_full: bool = False) -> float:
    """Training FLOPs (forward + backward [+ recompute]) of one iteration of ``global_batch_size`` sequences.
    Full recomputation re-runs the decoder layers, not the multi-token prediction depths nor the head."""
    c = config
    s = seq_length or c.seq_length
    f = 4 if recompute_full else 3
    layers = _layers_flops_per_token(c, s)
    logits = 2 * c.hidden_size * c.padded_vocab_size
    return float(global_batch_size * s * (f * layers + 3 * logits + 3 * _mtp_flops_per_token(c, s)))


def flops_per_token(config: GPTConfig, seq_length: Optional[int] = None, recompute_full: bool = False) -> float:
    """Training FLOPs per token (``flops_per_iteration`` / tokens)."""
    s = seq_length or config.seq_length
    return flops_per_iteration(config, 1, s, recompute_full) / s
