"""Activation memory of the planner: what a layer keeps for backward (Korthikanti et al. 2022,
generalised to GQA, SwiGLU, mixtures of experts and context parallelism's exchanges), and what a
rank holds over its layers under recomputation, and the multi-token prediction depths' (on the last
stage, beside the loss). ``planner.py`` puts it beside the model states.
"""

from __future__ import annotations

import math
from typing import Optional

from megazero.model.config import GPTConfig
from megazero.model.flops import moe_layers

__all__ = ["activation_bytes_per_layer"]


def activation_bytes_per_layer(config: GPTConfig, *, micro_batch_size: int, seq_length: int, tp: int = 1,
                               sequence_parallel: bool = False, keep_attention_scores: bool = True,
                               act_bytes: int = 2, expert_tp: Optional[int] = None) -> float:
    """Saved activations of one transformer layer (Korthikanti et al. 2022, Sec. 4.1).

    Generalised over the paper's 34 s b h + 5 a s^2 b (16-bit, ffn = 4h, MHA; multi-latent attention's
    projections, latents and widths in place of Q, K, V):
      replicated under TP (sharded with SP): 2 norm inputs + QKV and fc1 inputs at
        ``act_bytes`` and 2 dropout masks at 1 byte: s b h (4e + 2) = 10 s b h (RMSNorm without
        apex's kernel keeps an fp32 copy of its input and its normalized output: 4 + e bytes per
        element where LayerNorm keeps e, 8 s b h more per layer);
      sharded by TP: Q, K, V, projection input, fc1 output, activation output:
        e s b (n d + 2 g d + n d + 2 f) = 24 s b h (SwiGLU: 4 f, fc1's gate and up, silu(gate)
        and their product; grouped-query K and V repeated to the query heads, n d each, unless the
        backend is flash-attn, which reads the groups as they are);
      attention scores (dropped by selective recompute / flash attention): softmax
        output, its dropout mask and output: a s^2 b (2e + 1) = 5 a s^2 b, sharded by TP.
    Mixture-of-experts layers (averaged over the layers): the k experts' MLP activations per token in
    place of the dense MLP's (sharded by TP), the shared expert's (sharded by TP; under SP with an expert
    TP other than TP, beside its gathered input), the dispatched and combined token copies ``2 e k s b h``,
    the router's fp32 input and its logits and probabilities (whole on every TP rank). With an expert
    tensor-parallel size ``expert_tp`` other than ``tp`` each rank routes its own s b / tp tokens and
    holds their copies once per etp rank of their experts (the experts' own activations are the same);
    padded to capacity, the copies are the capacity factor times more.
    """
    c, s, b, e, t = config, seq_length, micro_batch_size, act_bytes, tp
    h, n, g, d, f = c.hidden_size, c.num_attention_heads, c.query_groups, c.head_dim, c.ffn_size
    gate = 2 if c.gated_linear_unit else 1
    # Dropout masks (1 byte) and dropout outputs exist only with dropout > 0 (the paper assumes it).
    hidden_masks = 2 if c.hidden_dropout > 0 else 0
    norm_extra = 4 if c.normalization == "rmsnorm" else 0  # torch's RMSNorm: fp32 input and normalized output
    replicated = s * b * h * (4 * e + hidden_masks + 2 * norm_extra)
    # SwiGLU keeps fc1's output (gate, up), silu(gate) and their product (fc2's input): 4 f; GeLU 2 f
    mlp = 4 * f if gate == 2 else 2 * f
    if c.multi_latent_attention:
        # q and k at qk_dim (the shared RoPE key expanded over the heads), the up-projected [k_nope | v]
        # (v is a view of it), the projection's input; beside the layer's input (replicated, sharded
        # under SP with the down-projections' tokens): the latents the norms and up-projections keep
        # and the key/value down-projection's output (the latent is a view of it, the RoPE key beside)
        attention = 2 * n * c.qk_dim + n * (c.qk_head_dim + c.v_head_dim) + n * c.v_dim
        latents = (2 * c.q_lora_rank if c.q_lora_rank else 0) + 2 * c.kv_lora_rank + c.qk_pos_emb_head_dim
        replicated += e * s * b * latents + norm_extra * s * b * ((c.q_lora_rank or 0) + c.kv_lora_rank)
    else:
        kv = g if c.attention_backend == "flash" else n  # sdpa and the math kernel repeat the groups
        attention = n * d + 2 * kv * d + n * d
    sharded = e * s * b * (attention + mlp)
    score_bytes = 2 * e + 1 if c.attention_dropout > 0 else e
    scores = n * s * s * b * score_bytes if keep_attention_scores else 0
    whole = 0.0
    if c.num_experts:
        # SwiGLU keeps gate, up, silu(gate) and their product per token copy; GeLU input and output.
        share, k, fm = moe_layers(c) / c.num_layers, c.moe_router_topk, c.moe_ffn_size
        # padded to capacity, every expert gets capacity rows: the copies times the factor
        pad = c.moe_expert_capacity_factor if c.moe_pad_expert_input_to_capacity else 1.0
        shared = c.moe_shared_expert_intermediate_size or 0  # the shared expert: every token, sharded over TP
        expert_mlp = (2 * gate * fm if gate == 2 else 2 * fm)
        sharded += share * e * s * b * (k * pad * expert_mlp + expert_mlp * shared / fm - mlp)
        own = expert_tp is not None and expert_tp != t  # own tokens: s b / tp of them, sent to etp ranks each
        tokens, copies = (s * b / t, s * b * expert_tp / t * pad) if own else (s * b, s * b * pad)
        whole = share * (2 * e * k * copies * h + 4 * tokens * h + 3 * 4 * tokens * c.num_experts)
        if own and shared and sequence_parallel:  # the shared expert's input: the TP group's tokens, gathered
            whole += share * e * s * b * h
    return replicated / (t if sequence_parallel else 1) + (sharded + scores) / t + whole


def _activations(config: GPTConfig, *, micro_batch_size: int, seq_length: int, tp: int, sequence_parallel: bool,
                 recompute: Optional[str], flash_attn: bool, act_bytes: int,
                 expert_tp: Optional[int] = None) -> dict[str, float]:
    c, s, b, t = config, seq_length, micro_batch_size, tp
    L, h = c.num_layers, c.hidden_size
    sp_div = t if sequence_parallel else 1
    per_layer = activation_bytes_per_layer(
        c, micro_batch_size=b, seq_length=s, tp=t, sequence_parallel=sequence_parallel,
        keep_attention_scores=not flash_attn and recompute != "selective", act_bytes=act_bytes, expert_tp=expert_tp)
    layer_input = act_bytes * s * b * h / sp_div
    # Per layer and micro-batch, what is kept until backward; and what is live once per stage
    # (the chunk being recomputed): a pipeline stage holds the first for each micro-batch in flight.
    saved, live = per_layer, 0.0
    if recompute == "full":
        n = min(max(c.recompute_num_layers, 1), L)
        if c.recompute_method == "block":
            # The first n layers keep only their input; the rest keep everything.
            layers = n * layer_input + (L - n) * per_layer + (per_layer if n else 0)
            saved = layers / L
        else:
            # Chunks of n layers keep their input; one chunk is live while it is recomputed.
            layers = math.ceil(L / n) * layer_input + n * per_layer
            saved, live = layer_input / n, n * per_layer
    else:
        layers = L * per_layer
    # Embedding dropout mask (1 byte), final norm and output-layer inputs, and the loss's peak: the
    # output layer's logits in the compute dtype alive beside the cross-entropy's fp32 working copy.
    mask = s * b * h / sp_div if c.hidden_dropout > 0 else 0
    norm = act_bytes + (4 if c.normalization == "rmsnorm" else 0)  # torch's RMSNorm keeps its fp32 input too
    outside = mask + (norm + act_bytes) * s * b * h / sp_div + (4 + act_bytes) * s * b * c.padded_vocab_size / t
    mtp = _mtp_activations(c, micro_batch_size=b, seq_length=s, tp=t, sequence_parallel=sequence_parallel,
                           keep_attention_scores=not flash_attn and recompute != "selective", act_bytes=act_bytes,
                           expert_tp=expert_tp)
    outside += mtp
    return {"per_layer": per_layer, "layers": layers, "outside_layers": outside, "total": layers + outside,
            "saved_per_layer": saved, "recompute_live": live, "layer_input": layer_input, "embedding_mask": mask,
            "mtp": mtp}


def _mtp_activations(c: GPTConfig, *, micro_batch_size: int, seq_length: int, tp: int, sequence_parallel: bool,
                     keep_attention_scores: bool, act_bytes: int, expert_tp: Optional[int]) -> float:
    """What the multi-token prediction depths keep for backward, on the last stage, one micro-batch: each
    depth's layer (of the last layer's kind; not recomputed), its embedding, the two norms' concatenation
    (``eh_proj``'s input), its final norm's and the head's inputs, and the head's fp32 softmax (the
    depth's loss is taken in forward, its backward runs with the main loss's)."""
    if not c.mtp_num_layers:
        return 0.0
    s, b, t = seq_length, micro_batch_size, tp
    kind = c.replace(moe_layer_freq=1) if c.is_moe_layer(c.num_layers - 1) else c.replace(num_experts=None)
    layer = activation_bytes_per_layer(kind, micro_batch_size=b, seq_length=s, tp=t, sequence_parallel=sequence_parallel,
                                       keep_attention_scores=keep_attention_scores, act_bytes=act_bytes,
                                       expert_tp=expert_tp)
    # three norms (torch's RMSNorm keeps its fp32 input too), the concatenation and the head's input
    norm = act_bytes + (4 if c.normalization == "rmsnorm" else 0)
    hidden = (3 * norm + 2 * act_bytes) * s * b * c.hidden_size / (t if sequence_parallel else 1)
    return c.mtp_num_layers * (layer + hidden + 4 * s * b * c.padded_vocab_size / t)


def _gathered_kv(act: dict, config: GPTConfig, *, seq_length: int, micro_batch_size: int, tp: int, cp: int,
                 recompute: Optional[str], act_bytes: int, layers: int) -> dict:
    """The all-gather exchange's extra (``layers`` of the model use it): each layer keeps the whole
    sequence's K/V for backward (the other ranks' (cp-1)/cp of it beside its own), and backward holds
    their fp32 gradients and the cast of them while it reduce-scatters, in place of the loss's logits
    at the peak."""
    c = config
    kv = seq_length * micro_batch_size * (c.query_groups / tp) * (c.qk_dim + c.v_dim)  # K and V, each its width
    extra = kv * act_bytes * (cp - 1) / cp
    out = dict(act, per_layer=act["per_layer"] + extra * layers / c.num_layers)
    if recompute == "full":
        out["recompute_live"] = act["recompute_live"] + extra * max(c.recompute_num_layers, 1)
        out["total"] = act["total"] + extra * max(c.recompute_num_layers, 1)
    else:
        out["saved_per_layer"] = act["saved_per_layer"] + extra * layers / c.num_layers
        out["layers"] = act["layers"] + layers * extra
        out["total"] = act["total"] + layers * extra
    backward = kv * (4 + act_bytes)
    out["total"] += max(0.0, backward - act["outside_layers"])
    return out
