"""Activation memory of the planner: what a layer keeps for backward (Korthikanti et al. 2022,
generalised to GQA, SwiGLU, mixtures of experts and context parallelism's exchanges), and what a
rank holds over its layers under recomputation, and the multi-token prediction depths' (on the last
stage, beside the loss). ``planner.py`` puts it beside the model states.
"""

from __future__ import annotations

import math
from typing import Optional

from megazero.model.config import GPTConfig
from megazero.model.flops import moe_layers, uniform_layers
from megazero.model.layer_pattern import RECURRENT_MIXERS
from megazero.observe.planner_recurrent import recurrent_activation_bytes, recurrent_state_bytes

__all__ = ["activation_bytes_per_layer", "layer_activation_bytes"]


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
    h = c.hidden_size
    # Dropout masks (1 byte) and dropout outputs exist only with dropout > 0 (the paper assumes it).
    hidden_masks = 2 if c.hidden_dropout > 0 else 0
    norm_extra = 4 if c.normalization == "rmsnorm" else 0  # torch's RMSNorm: fp32 input and normalized output
    replicated = s * b * h * (4 * e + hidden_masks + 2 * norm_extra)
    mlp = _mlp_width(c)
    attention, latents, latent_norms = _attention_widths(c)
    if c.multi_latent_attention:
        replicated += e * s * b * latents + norm_extra * s * b * latent_norms
    sharded = e * s * b * (attention + mlp)
    scores = _scores(c, s, b, e) if keep_attention_scores else 0
    whole = 0.0
    if c.num_experts:
        share = moe_layers(c) / c.num_layers
        experts, routed, gathered = _moe_parts(c, s=s, b=b, e=e, t=t, sequence_parallel=sequence_parallel,
                                               expert_tp=expert_tp)
        sharded += share * e * s * b * (experts - mlp)
        whole = share * routed
        if gathered:
            whole += share * gathered
    return replicated / (t if sequence_parallel else 1) + (sharded + scores) / t + whole


def _mlp_width(c: GPTConfig) -> int:
    """A dense MLP's kept widths per token: SwiGLU keeps fc1's output (gate, up), silu(gate) and their product
    (fc2's input): 4 f; GeLU 2 f."""
    return 4 * c.ffn_size if c.gated_linear_unit else 2 * c.ffn_size


def _attention_widths(c: GPTConfig) -> tuple[int, int, int]:
    """(the attention's TP-sharded widths per token, multi-latent attention's replicated latents and the widths
    of their norms). Standard: Q, K, V (grouped K and V repeated to the query heads unless flash-attn reads
    the groups), the projection's input. Multi-latent: q and k at qk_dim (the shared RoPE key expanded over the
    heads), the up-projected [k_nope | v] (v is a view of it), the projection's input; beside the layer's
    input (replicated, sharded under SP with the down-projections' tokens): the latents the norms and
    up-projections keep and the key/value down-projection's output (the latent is a view of it, the RoPE key
    beside)."""
    n, d = c.num_attention_heads, c.head_dim
    if c.multi_latent_attention:
        attention = 2 * n * c.qk_dim + n * (c.qk_head_dim + c.v_head_dim) + n * c.v_dim
        latents = (2 * c.q_lora_rank if c.q_lora_rank else 0) + 2 * c.kv_lora_rank + c.qk_pos_emb_head_dim
        return attention, latents, (c.q_lora_rank or 0) + c.kv_lora_rank
    kv = c.query_groups if c.attention_backend == "flash" else n  # sdpa and the math kernel repeat the groups
    return n * d + 2 * kv * d + n * d, 0, 0


def _scores(c: GPTConfig, s: int, b: int, e: int) -> float:
    """The s x s scores a math kernel keeps (softmax output, its dropout mask and output), all heads."""
    score_bytes = 2 * e + 1 if c.attention_dropout > 0 else e
    return c.num_attention_heads * s * s * b * score_bytes


def _moe_parts(c: GPTConfig, *, s: int, b: int, e: int, t: int, sequence_parallel: bool,
               expert_tp: Optional[int]) -> tuple[float, float, float]:
    """One mixture layer's (widths per token its experts keep, sharded by TP; bytes whole on every TP rank; the
    shared expert's gathered input): the k experts' MLPs (padded to capacity: the factor times more) and the
    shared expert; the dispatched and combined token copies, the router's fp32 input, logits and probabilities."""
    gate, k, fm = 2 if c.gated_linear_unit else 1, c.moe_router_topk, c.moe_ffn_size
    # padded to capacity, every expert gets capacity rows: the copies times the factor
    pad = c.moe_expert_capacity_factor if c.moe_pad_expert_input_to_capacity else 1.0
    shared = c.moe_shared_expert_intermediate_size or 0  # the shared expert: every token, sharded over TP
    # SwiGLU keeps gate, up, silu(gate) and their product per token copy; GeLU input and output.
    expert_mlp = (2 * gate * fm if gate == 2 else 2 * fm)
    experts = k * pad * expert_mlp + expert_mlp * shared / fm
    own = expert_tp is not None and expert_tp != t  # own tokens: s b / tp of them, sent to etp ranks each
    tokens, copies = (s * b / t, s * b * expert_tp / t * pad) if own else (s * b, s * b * pad)
    whole = 2 * e * k * copies * c.hidden_size + 4 * tokens * c.hidden_size + 3 * 4 * tokens * c.num_experts
    # the shared expert's input: the TP group's tokens, gathered
    gathered = e * s * b * c.hidden_size if own and shared and sequence_parallel else 0.0
    return experts, whole, gathered


def layer_activation_bytes(config: GPTConfig, number: int, *, micro_batch_size: int, seq_length: int, tp: int = 1,
                           cp: int = 1, sequence_parallel: bool = False, keep_attention_scores: bool = True,
                           act_bytes: int = 2, expert_tp: Optional[int] = None) -> float:
    """Saved activations of layer ``number`` by its parts (a hybrid stack's; :func:`activation_bytes_per_layer`'s
    terms for each): per part its norm's and its module's input and the dropout mask (replicated, sharded under
    SP); an attention's widths and scores, a recurrent mixer's
    (:func:`~megazero.observe.planner_recurrent.recurrent_activation_bytes`, ``cp`` the context-parallel size), a
    dense MLP's widths, a mixture's experts and token copies. ``seq_length``: this rank's tokens (s / cp)."""
    c, s, b, e, t = config, seq_length, micro_batch_size, act_bytes, tp
    kinds = c.layer_kinds(min(number, c.num_layers - 1))
    norm_extra = 4 if c.normalization == "rmsnorm" else 0
    per_part = s * b * c.hidden_size * (2 * e + (1 if c.hidden_dropout > 0 else 0) + norm_extra)
    replicated = per_part * ((kinds.mixer is not None) + (kinds.mlp is not None))
    sharded, whole = 0.0, 0.0
    if kinds.mixer in RECURRENT_MIXERS:
        whole += recurrent_activation_bytes(c, kinds.mixer, micro_batch_size=b, seq_length=s, tp=t, cp=cp,
                                            act_bytes=e)
    elif kinds.mixer is not None:
        attention, latents, latent_norms = _attention_widths(c)
        replicated += e * s * b * latents + norm_extra * s * b * latent_norms
        sharded += e * s * b * attention + (_scores(c, s, b, e) if keep_attention_scores else 0)
    if kinds.mlp == "dense":
        sharded += e * s * b * _mlp_width(c)
    elif kinds.mlp == "moe":
        experts, routed, gathered = _moe_parts(c, s=s, b=b, e=e, t=t, sequence_parallel=sequence_parallel,
                                               expert_tp=expert_tp)
        sharded += e * s * b * experts
        whole += routed + gathered
    return replicated / (t if sequence_parallel else 1) + sharded / t + whole


def _activations(config: GPTConfig, *, micro_batch_size: int, seq_length: int, tp: int, sequence_parallel: bool,
                 recompute: Optional[str], flash_attn: bool, act_bytes: int,
                 expert_tp: Optional[int] = None, cp: int = 1) -> dict[str, float]:
    c, s, b, t = config, seq_length, micro_batch_size, tp
    L, h = c.num_layers, c.hidden_size
    sp_div = t if sequence_parallel else 1
    kw = dict(micro_batch_size=b, seq_length=s, tp=t, sequence_parallel=sequence_parallel,
              keep_attention_scores=not flash_attn and recompute != "selective", act_bytes=act_bytes,
              expert_tp=expert_tp)
    layer_input = act_bytes * s * b * h / sp_div
    if not uniform_layers(c):  # a hybrid stack: layer by layer
        act = _hybrid_activations(c, [layer_activation_bytes(c, i, cp=cp, **kw) for i in range(L)],
                                  layer_input=layer_input, recompute=recompute, cp=cp, **kw)
        mixers = [c.layer_kinds(i).mixer for i in range(L)]
        act["recurrent_state"] = sum(recurrent_state_bytes(c, m, micro_batch_size=b, seq_length=s, tp=t, cp=cp)
                                     for m in mixers if m in RECURRENT_MIXERS)
        return act
    per_layer = activation_bytes_per_layer(c, **kw)
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
    mask, outside, mtp = _outside(c, **kw)
    return {"per_layer": per_layer, "layers": layers, "outside_layers": outside, "total": layers + outside,
            "saved_per_layer": saved, "recompute_live": live, "layer_input": layer_input, "embedding_mask": mask,
            "mtp": mtp}


def _outside(c: GPTConfig, *, micro_batch_size: int, seq_length: int, tp: int, sequence_parallel: bool,
             keep_attention_scores: bool, act_bytes: int, expert_tp: Optional[int],
             cp: int = 1) -> tuple[float, float, float]:
    """(the embedding's dropout mask, everything outside the decoder layers, the multi-token prediction depths'):
    the mask (1 byte), the final norm's and the output layer's inputs, and the loss's peak: the output layer's
    logits in the compute dtype alive beside the cross-entropy's fp32 working copy; the depths."""
    s, b, t, h = seq_length, micro_batch_size, tp, c.hidden_size
    sp_div = t if sequence_parallel else 1
    mask = s * b * h / sp_div if c.hidden_dropout > 0 else 0
    norm = act_bytes + (4 if c.normalization == "rmsnorm" else 0)  # torch's RMSNorm keeps its fp32 input too
    outside = mask + (norm + act_bytes) * s * b * h / sp_div + (4 + act_bytes) * s * b * c.padded_vocab_size / t
    mtp = _mtp_activations(c, micro_batch_size=b, seq_length=s, tp=t, sequence_parallel=sequence_parallel,
                           keep_attention_scores=keep_attention_scores, act_bytes=act_bytes, expert_tp=expert_tp,
                           cp=cp)
    return mask, outside + mtp, mtp


def _hybrid_activations(c: GPTConfig, by_layer: list[float], *, layer_input: float, recompute: Optional[str],
                        cp: int, **kw) -> dict:
    """:func:`_activations` of a hybrid stack from its layers' own bytes ``by_layer``: kept layer by layer
    (``saved_by_layer``, which a pipeline stage sums over its layers); under full recomputation a chunk of n
    layers keeps its input, and the largest chunk is live while it is re-run ('block': the first n layers
    keep their input, one of them live)."""
    L = c.num_layers
    saved, live = list(by_layer), 0.0
    if recompute == "full":
        n = min(max(c.recompute_num_layers, 1), L)
        if c.recompute_method == "block":
            saved = [layer_input] * n + by_layer[n:]
            live = max(by_layer[:n]) if n else 0.0
        else:
            chunks = [by_layer[i:i + n] for i in range(0, L, n)]
            saved = [layer_input / len(ch) for ch in chunks for _ in ch]
            live = max(sum(ch) for ch in chunks)
    layers = sum(saved) + live
    mask, outside, mtp = _outside(c, cp=cp, **kw)
    return {"per_layer": sum(by_layer) / L, "layers": layers, "outside_layers": outside, "total": layers + outside,
            "saved_per_layer": sum(saved) / L, "saved_by_layer": saved, "by_layer": list(by_layer),
            "recompute_live": live, "layer_input": layer_input, "embedding_mask": mask, "mtp": mtp}


def _mtp_activations(c: GPTConfig, *, micro_batch_size: int, seq_length: int, tp: int, sequence_parallel: bool,
                     keep_attention_scores: bool, act_bytes: int, expert_tp: Optional[int], cp: int = 1) -> float:
    """What the multi-token prediction depths keep for backward, on the last stage, one micro-batch: each
    depth's layer (of the last layer's kind; not recomputed), its embedding, the two norms' concatenation
    (``eh_proj``'s input), its final norm's and the head's inputs, and the head's fp32 softmax (the
    depth's loss is taken in forward, its backward runs with the main loss's)."""
    if not c.mtp_num_layers:
        return 0.0
    s, b, t = seq_length, micro_batch_size, tp
    kw = dict(micro_batch_size=b, seq_length=s, tp=t, sequence_parallel=sequence_parallel,
              keep_attention_scores=keep_attention_scores, act_bytes=act_bytes, expert_tp=expert_tp)
    if uniform_layers(c):
        kind = c.replace(moe_layer_freq=1) if c.is_moe_layer(c.num_layers - 1) else c.replace(num_experts=None)
        layer = activation_bytes_per_layer(kind, **kw)
    else:  # built as the last layer
        layer = layer_activation_bytes(c, c.num_layers, cp=cp, **kw)
    # three norms (torch's RMSNorm keeps its fp32 input too), the concatenation and the head's input
    norm = act_bytes + (4 if c.normalization == "rmsnorm" else 0)
    hidden = (3 * norm + 2 * act_bytes) * s * b * c.hidden_size / (t if sequence_parallel else 1)
    return c.mtp_num_layers * (layer + hidden + 4 * s * b * c.padded_vocab_size / t)


def _gathered_kv(act: dict, config: GPTConfig, *, seq_length: int, micro_batch_size: int, tp: int, cp: int,
                 recompute: Optional[str], act_bytes: int, layers: int,
                 numbers: Optional[list[int]] = None) -> dict:
    """The all-gather exchange's extra (``layers`` of the model use it): each layer keeps the whole
    sequence's K/V for backward (the other ranks' (cp-1)/cp of it beside its own), and backward holds
    their fp32 gradients and the cast of them while it reduce-scatters, in place of the loss's logits
    at the peak. ``numbers``: which layers (a hybrid stack's, for its ``saved_by_layer``)."""
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
        if "saved_by_layer" in act:  # a hybrid stack: the all-gather's attention layers ``numbers``
            out["saved_by_layer"] = [v + (extra if i in (numbers or ()) else 0.0)
                                     for i, v in enumerate(act["saved_by_layer"])]
        out["total"] = act["total"] + layers * extra
    backward = kv * (4 + act_bytes)
    out["total"] += max(0.0, backward - act["outside_layers"])
    return out
