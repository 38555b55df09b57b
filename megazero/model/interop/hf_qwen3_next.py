"""Hugging Face Qwen3-Next and Qwen3.5 <-> megazero: Gated DeltaNet layers among gated attention layers.

Families (model_type -> class): ``qwen3_next`` -> ``Qwen3NextForCausalLM`` (a mixture of experts with a gated
shared expert, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say); ``qwen3_5_text`` ->
``Qwen3_5ForCausalLM`` (dense); ``qwen3_5_moe_text`` -> ``Qwen3_5MoeForCausalLM`` (every layer a mixture, the top k
always renormalised). The Hub's Qwen3.5 checkpoints are the multimodal ``qwen3_5`` / ``qwen3_5_moe``
(``*ForConditionalGeneration``, the text model's config under ``text_config``, its weights under
``model.language_model.``): they import as the text-only CausalLM, the vision tower (``model.visual.*``) dropped.
Qwen3-Next's and Qwen3.5's multi-token prediction weights (``mtp.*``, which transformers ignores too) are dropped
with a logged note: transformers has no implementation of them to check a mapping against.

The network: ``layer_types`` says which layers are Gated DeltaNet (``linear_attention``) and which attention
(``full_attention``): megazero's ``linear_attention_freq``, the int N where every N-th layer is attention
(``full_attention_interval``), else one 1/0 per layer. Attention has query/key RMSNorms, partial RoPE
(``partial_rotary_factor`` = ``rotary_percent``; Qwen3.5's interleaved M-RoPE is plain RoPE at text positions) and
an output gate (``q_proj`` per head ``[query; gate]``: megazero's ``attention_output_gate`` rows per query group
``[queries, their gates, key, value]``). Every RMSNorm but Gated DeltaNet's applies ``1 + w`` and stores ``w`` (zero
at init): megazero's ``apply_layernorm_1p`` stores the same ``w``, so no shift; a model without it exports
``gamma - 1``. Gated DeltaNet: Qwen3-Next fuses ``in_proj_qkvz`` per key head ``[q, k, v-group, z-group]`` and
``in_proj_ba`` per key head ``[b-group, a-group]``; Qwen3.5 splits ``in_proj_qkv`` (all q, all k, all v),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``; megazero keeps ``[q; k]``, ``[v; z]``, ``[b; a]``. The convolution's
channels are ``[q; k; v]`` in all three. Mixtures: Qwen2-MoE's names (router ``mlp.gate``, experts
``mlp.experts.e.{gate,up,down}_proj``, ``mlp.shared_expert`` and its ``shared_expert_gate``); the import also
reads transformers' in-memory stacked experts (``mlp.experts.gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ..config import GPTConfig
from .hf_common import pad_vocabulary, refuse_unused

__all__ = ["QWEN3_NEXT_FAMILIES", "QWEN3_NEXT_IMPORT_FAMILIES", "QWEN3_NEXT_ARCHITECTURES", "QWEN3_NEXT_CONFIG_CLASSES",
           "qwen3_next_parts", "qwen3_next_family", "qwen3_next_mismatches", "qwen3_next_to_hf", "qwen3_next_from_hf",
           "qwen3_next_config_kwargs", "qwen3_next_hf_config_dict"]

log = logging.getLogger(__name__)

QWEN3_NEXT_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # multimodal -> its text model
QWEN3_NEXT_IMPORT_FAMILIES = QWEN3_NEXT_FAMILIES + tuple(_WRAPPERS)
QWEN3_NEXT_ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                            "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
QWEN3_NEXT_CONFIG_CLASSES = {"qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig",
                             "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}
_DROPPED = ("mtp.", "model.visual.")  # weights of parts a text-only GPT does not have


# ---- what converts --------------------------------------------------------------------------------------


def qwen3_next_parts(c: GPTConfig) -> list[str]:
    """The settings of ``c`` that, among the HF families megazero converts, only Qwen3-Next and Qwen3.5 have."""
    out = ["Gated DeltaNet layers"] if any(c.layer_kinds(i).mixer == "gdn" for i in range(c.num_layers)) else []
    return out + (["attention_output_gate=True"] if c.attention_output_gate else [])


def qwen3_next_family(c: GPTConfig) -> str:
    """The import's family (``hf_model_type``); else Qwen3-Next for a mixture of experts, Qwen3.5 for a dense model."""
    if c.hf_model_type in QWEN3_NEXT_FAMILIES:
        return c.hf_model_type
    return "qwen3_next" if c.num_experts else "qwen3_5_text"


def qwen3_next_mismatches(c: GPTConfig) -> list[str]:
    """What keeps ``c`` from being a model of its ``qwen3_next_family`` (empty: it is one)."""
    family = qwen3_next_family(c)
    need = [("position_embedding_type", "rope"), ("normalization", "rmsnorm"), ("activation", "swiglu"),
            ("resolved_rope_type", "rope"), ("add_bias_linear", False), ("add_qkv_bias", False), ("qk_layernorm", True),
            ("attention_output_gate", True), ("softmax_type", "vanilla"), ("window_size", None),
            ("multi_latent_attention", False), ("hybrid_layer_pattern", None), ("mtp_num_layers", 0),
            ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)]
    out = [f"{k}={getattr(c, k)!r} ({family} needs {v!r})" for k, v in need if getattr(c, k) != v]
    if c.num_experts:
        need = [("moe_router_score_function", "softmax"), ("moe_router_num_groups", None),
                ("moe_router_enable_expert_bias", False), ("moe_router_bias", False), ("moe_shared_expert_gate", True)]
        out += [f"{k}={getattr(c, k)!r} ({family} needs {v!r})" for k, v in need if getattr(c, k) != v]
        if c.moe_shared_expert_intermediate_size is None:
            out.append(f"no shared expert ({family}'s mixtures have a gated one: moe_shared_expert_intermediate_size)")
        if c.moe_router_topk_scaling_factor not in (None, 1.0):
            out.append(f"moe_router_topk_scaling_factor={c.moe_router_topk_scaling_factor} ({family} scales nothing)")
    if family == "qwen3_5_text" and c.num_experts:
        out.append(f"num_experts={c.num_experts} (Qwen3.5 dense has no experts: hf_model_type 'qwen3_5_moe_text' or "
                   "'qwen3_next')")
    if family == "qwen3_5_moe_text":
        if not c.num_experts or not all(c.is_moe_layer(i) for i in range(c.num_layers)):
            out.append(f"num_experts={c.num_experts}, moe_layer_freq={c.moe_layer_freq!r} (every Qwen3.5-MoE layer "
                       "is a mixture: hf_model_type 'qwen3_next' has dense layers)")
        if c.moe_router_pre_softmax:
            out.append("moe_router_pre_softmax=True (Qwen3.5-MoE renormalises its top k: hf_model_type 'qwen3_next' "
                       "has norm_topk_prob)")
    return out


# ---- weights ----------------------------------------------------------------------------------------


def _norm_keys(c: GPTConfig, i: int) -> list[tuple[str, str]]:
    """(megazero, HF) names of layer ``i``'s (1 + w) norms."""
    p, h = f"layers.{i}.", f"model.layers.{i}."
    out = [(p + "input_layernorm.weight", h + "input_layernorm.weight"),
           (p + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight")]
    if c.layer_kinds(i).mixer != "gdn":
        out += [(p + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight"),
                (p + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight")]
    return out


def _gdn_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, family: str, p: str, h: str) -> dict[str, torch.Tensor]:
    nk, r, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, \
        c.linear_key_head_dim, c.linear_value_head_dim
    q, k = sd[p + "in_proj_qk.weight"].chunk(2)
    v, z = sd[p + "in_proj_vz.weight"].chunk(2)
    b, a = sd[p + "in_proj_ba.weight"].chunk(2)
    out = {h + "conv1d.weight": sd[p + "conv1d_weight"].unsqueeze(1), h + "A_log": sd[p + "A_log"],
           h + "dt_bias": sd[p + "dt_bias"], h + "norm.weight": sd[p + "norm_weight"],
           h + "out_proj.weight": sd[p + "out_proj.weight"]}
    if family == "qwen3_next":  # per key head: q, k, its value heads' v, their z; its b, its a
        per_head = lambda t, n: t.reshape(nk, n, t.shape[-1])  # noqa: E731
        out[h + "in_proj_qkvz.weight"] = torch.cat([per_head(q, dk), per_head(k, dk), per_head(v, r * dv),
                                                    per_head(z, r * dv)], dim=1).reshape(-1, q.shape[-1])
        out[h + "in_proj_ba.weight"] = torch.cat([per_head(b, r), per_head(a, r)], dim=1).reshape(-1, q.shape[-1])
    else:
        out.update({h + "in_proj_qkv.weight": torch.cat([q, k, v]), h + "in_proj_z.weight": z,
                    h + "in_proj_b.weight": b, h + "in_proj_a.weight": a})
    return out


def _gdn_from_hf(take: Callable[[str], torch.Tensor], c: GPTConfig, family: str, p: str, h: str
                 ) -> dict[str, torch.Tensor]:
    nk, r, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, \
        c.linear_key_head_dim, c.linear_value_head_dim
    out = {p + "conv1d_weight": take(h + "conv1d.weight").squeeze(1), p + "A_log": take(h + "A_log"),
           p + "dt_bias": take(h + "dt_bias"), p + "norm_weight": take(h + "norm.weight"),
           p + "out_proj.weight": take(h + "out_proj.weight")}
    if family == "qwen3_next":
        qkvz = take(h + "in_proj_qkvz.weight")
        hidden = qkvz.shape[-1]
        q, k, v, z = qkvz.reshape(nk, -1, hidden).split([dk, dk, r * dv, r * dv], dim=1)
        b, a = take(h + "in_proj_ba.weight").reshape(nk, 2 * r, hidden).split([r, r], dim=1)
        q, k, v, z, b, a = (t.reshape(-1, hidden) for t in (q, k, v, z, b, a))
    else:
        q, k, v = take(h + "in_proj_qkv.weight").split([nk * dk, nk * dk, nk * r * dv])
        z, b, a = take(h + "in_proj_z.weight"), take(h + "in_proj_b.weight"), take(h + "in_proj_a.weight")
    out.update({p + "in_proj_qk.weight": torch.cat([q, k]), p + "in_proj_vz.weight": torch.cat([v, z]),
                p + "in_proj_ba.weight": torch.cat([b, a])})
    return out


def _attention_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, p: str, h: str) -> dict[str, torch.Tensor]:
    """Rows per query group [queries, their gates, key, value] -> q_proj per head [query; gate], k_proj, v_proj."""
    g, d, per = c.query_groups, c.head_dim, c.num_attention_heads // c.query_groups
    w = sd[p + "linear_qkv.weight"]
    t = w.reshape(g, 2 * per + 2, d, w.shape[-1])
    q = torch.stack([t[:, :per], t[:, per:2 * per]], dim=2)  # [g, per, 2, d, h]
    return {h + "q_proj.weight": q.reshape(-1, w.shape[-1]), h + "k_proj.weight": t[:, 2 * per].reshape(-1, w.shape[-1]),
            h + "v_proj.weight": t[:, 2 * per + 1].reshape(-1, w.shape[-1]),
            h + "o_proj.weight": sd[p + "linear_proj.weight"]}


def _attention_from_hf(take: Callable[[str], torch.Tensor], c: GPTConfig, p: str, h: str) -> dict[str, torch.Tensor]:
    g, d, per = c.query_groups, c.head_dim, c.num_attention_heads // c.query_groups
    qg = take(h + "q_proj.weight")
    hidden = qg.shape[-1]
    qg = qg.reshape(g, per, 2, d, hidden)
    k, v = take(h + "k_proj.weight").reshape(g, 1, d, hidden), take(h + "v_proj.weight").reshape(g, 1, d, hidden)
    rows = torch.cat([qg[:, :, 0], qg[:, :, 1], k, v], dim=1).reshape(-1, hidden)
    return {p + "linear_qkv.weight": rows, p + "linear_proj.weight": take(h + "o_proj.weight")}


def _mlp_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, i: int) -> dict[str, torch.Tensor]:
    p, h = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    if not c.is_moe_layer(i):
        gate, up = sd[p + "linear_fc1.weight"].chunk(2)
        return {h + "gate_proj.weight": gate, h + "up_proj.weight": up, h + "down_proj.weight": sd[p + "linear_fc2.weight"]}
    out = {h + "gate.weight": sd[p + "router.weight"], h + "shared_expert_gate.weight": sd[p + "shared_gate.weight"]}
    for src, dst in [(f"experts.{e}.", f"experts.{e}.") for e in range(c.num_experts)] + [("shared_experts.",
                                                                                           "shared_expert.")]:
        out[h + dst + "gate_proj.weight"], out[h + dst + "up_proj.weight"] = sd[p + src + "linear_fc1.weight"].chunk(2)
        out[h + dst + "down_proj.weight"] = sd[p + src + "linear_fc2.weight"]
    return out


def _mlp_from_hf(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], c: GPTConfig, i: int
                 ) -> dict[str, torch.Tensor]:
    p, h = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."

    def glu(src: str, dst: str) -> dict[str, torch.Tensor]:
        return {p + dst + "linear_fc1.weight": torch.cat([take(h + src + "gate_proj.weight"),
                                                          take(h + src + "up_proj.weight")]),
                p + dst + "linear_fc2.weight": take(h + src + "down_proj.weight")}

    if not c.is_moe_layer(i):
        return glu("", "")
    out = {p + "router.weight": take(h + "gate.weight"), p + "shared_gate.weight": take(h + "shared_expert_gate.weight"),
           **glu("shared_expert.", "shared_experts.")}
    if has(h + "experts.gate_up_proj"):  # transformers' in-memory layout: [E, 2f, h] and [E, h, f]
        gate_up, down = take(h + "experts.gate_up_proj"), take(h + "experts.down_proj")
        for e in range(c.num_experts):
            out[f"{p}experts.{e}.linear_fc1.weight"], out[f"{p}experts.{e}.linear_fc2.weight"] = gate_up[e], down[e]
        return out
    for e in range(c.num_experts):
        out.update(glu(f"experts.{e}.", f"experts.{e}."))
    return out


def qwen3_next_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """A full megazero state dict of a Qwen3-Next / Qwen3.5 ``c`` -> the HF state dict save_pretrained writes."""
    family, shift = qwen3_next_family(c), 0.0 if c.apply_layernorm_1p else -1.0
    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out.update({hf: sd[mz] + shift if shift else sd[mz] for mz, hf in _norm_keys(c, i)})
        if c.layer_kinds(i).mixer == "gdn":
            out.update(_gdn_to_hf(sd, c, family, p + "self_attention.", h + "linear_attn."))
        else:
            out.update(_attention_to_hf(sd, c, p + "self_attention.", h + "self_attn."))
        out.update(_mlp_to_hf(sd, c, i))
    out["model.embed_tokens.weight"] = sd["embedding.weight"][:c.vocab_size]
    out["model.norm.weight"] = sd["final_norm.weight"] + shift if shift else sd["final_norm.weight"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"][:c.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def _text_name(key: str) -> Optional[str]:
    """The text-only CausalLM's name of a checkpoint key; None for a weight the import drops."""
    if key.startswith(_DROPPED):
        return None
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


def qwen3_next_from_hf(hf_sd, c: GPTConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`qwen3_next_to_hf`, from a CausalLM's or a multimodal wrapper's state dict (its vision
    tower and multi-token prediction weights dropped). Strict about the rest."""
    family = qwen3_next_family(c)
    sd = {n: hf_sd[k] for k in hf_sd if (n := _text_name(k)) is not None}
    if c.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the tied copy, if the checkpoint stores it
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"HF checkpoint lacks {key!r} (needed for a {family} model with {c.num_layers} layers)")
        used.add(key)
        return sd[key]

    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out.update({mz: take(hf) for mz, hf in _norm_keys(c, i)})
        if c.layer_kinds(i).mixer == "gdn":
            out.update(_gdn_from_hf(take, c, family, p + "self_attention.", h + "linear_attn."))
        else:
            out.update(_attention_from_hf(take, c, p + "self_attention.", h + "self_attn."))
        out.update(_mlp_from_hf(take, sd.__contains__, c, i))
    out["embedding.weight"] = pad_vocabulary(take("model.embed_tokens.weight"), c)
    out["final_norm.weight"] = take("model.norm.weight")
    if not c.tie_embeddings:
        out["output_layer.weight"] = pad_vocabulary(take("lm_head.weight"), c)
    refuse_unused(set(sd) - used, family)
    if not c.apply_layernorm_1p:  # the import sets it; a config overriding it stores gamma itself
        norms = {mz for i in range(c.num_layers) for mz, _ in _norm_keys(c, i)} | {"final_norm.weight"}
        out = {k: v + 1.0 if k in norms else v for k, v in out.items()}
    return {k: v.contiguous() for k, v in out.items()}


# ---- configs ------------------------------------------------------------------------------------------


def _text_config(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(family, the text model's config) of a CausalLM's config or a multimodal wrapper's."""
    mt = hf.get("model_type")
    if mt not in _WRAPPERS:
        return mt, hf
    text = dict(hf.get("text_config") or {})
    if "tie_word_embeddings" in hf:  # the wrapper's, which transformers ties by
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return _WRAPPERS[mt], text


def _linear_attention_freq(types: list[str], interval: Optional[int]) -> Any:
    """``linear_attention_freq`` of ``layer_types``: the int N where every N-th layer is attention, else a 1/0 tuple."""
    pattern = tuple(int(t == "linear_attention") for t in types)
    if interval is not None:
        return interval
    n = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), None)
    if n is not None and pattern == tuple(int((i + 1) % n != 0) for i in range(len(types))):
        return n
    return pattern


def _rope_kwargs(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        problems.append(f"rope type {kind!r} (megazero converts Qwen3-Next's and Qwen3.5's plain RoPE)")
    # the configs' default (Qwen3NextConfig sets 0.25 where neither place gives one)
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    return dict(rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_percent=factor)


def _moe_kwargs(hf: dict[str, Any], family: str, problems: list[str]) -> dict[str, Any]:
    layers, experts = hf["num_hidden_layers"], hf.get("num_experts") or 0
    if family == "qwen3_5_text" or not experts:
        return {}
    if family == "qwen3_next":
        dense, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1)
        pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
        norm_topk = hf.get("norm_topk_prob", True)
    else:  # Qwen3.5-MoE: every layer, the top k renormalised
        pattern, norm_topk = (1,) * layers, True
    if not any(pattern):
        return {}
    shared = hf.get("shared_expert_intermediate_size", 512)
    if not shared:
        problems.append(f"shared_expert_intermediate_size={shared} (megazero's {family} mixtures have a shared expert)")
    return dict(num_experts=experts, moe_router_topk=hf.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=hf.get("moe_intermediate_size", 512), moe_shared_expert_intermediate_size=shared,
                moe_shared_expert_gate=True, moe_router_pre_softmax=not norm_topk,
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                moe_layer_freq=1 if all(pattern) else pattern)


def qwen3_next_config_kwargs(hf: dict[str, Any], weight_names: Optional[list[str]] = None) -> dict[str, Any]:
    """GPTConfig fields of an HF Qwen3-Next / Qwen3.5 ``config.json`` dict (a CausalLM's or a multimodal wrapper's);
    ValueError naming each value megazero cannot represent. ``weight_names``: the checkpoint's, to log what the
    import drops."""
    family, t = _text_config(hf)
    problems: list[str] = []
    if t.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={t['hidden_act']!r} (needs 'silu')")
    if t.get("attention_bias", False):
        problems.append("attention_bias=True (megazero's add_bias_linear would put biases on every linear)")
    layers, heads, hidden = t["num_hidden_layers"], t["num_attention_heads"], t["hidden_size"]
    interval = t.get("full_attention_interval", 4) if t.get("layer_types") is None else None
    types = t.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                     for i in range(layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != layers:
        problems.append(f"layer_types {unknown or types} (one linear_attention or full_attention per layer: {layers})")
    rope, moe = _rope_kwargs(t, problems), _moe_kwargs(t, family, problems)
    if problems:
        raise ValueError(f"HF {family} config not representable in megazero: " + "; ".join(problems))
    dropped = [f"{p}* ({why})" for p, why in zip(_DROPPED, ("multi-token prediction", "vision tower"))
               if any(k.startswith(p) for k in weight_names or [])]
    if dropped:
        log.info("importing the %s text model alone: dropped %s", family, ", ".join(dropped))
    freq = _linear_attention_freq(types, interval) if "linear_attention" in types else None
    head_dim, max_pos = t.get("head_dim") or 256, t.get("max_position_embeddings", 32768)
    ffn = t.get("intermediate_size") if family != "qwen3_5_moe_text" else moe.get("moe_ffn_hidden_size")
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=t["vocab_size"],
                num_query_groups=t.get("num_key_value_heads") or heads,
                kv_channels=None if head_dim * heads == hidden else head_dim, ffn_hidden_size=ffn,
                max_position_embeddings=max_pos, seq_length=max_pos, position_embedding_type="rope",
                normalization="rmsnorm", apply_layernorm_1p=True, activation="swiglu", add_bias_linear=False,
                qk_layernorm=True, attention_output_gate=True, tie_embeddings=t.get("tie_word_embeddings", False),
                hidden_dropout=0.0, attention_dropout=t.get("attention_dropout", 0.0),
                layernorm_epsilon=t.get("rms_norm_eps", 1e-6), init_method_std=t.get("initializer_range", 0.02),
                experimental_attention_variant="gated_delta_net" if freq is not None else None,
                linear_attention_freq=freq, linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
                linear_key_head_dim=t.get("linear_key_head_dim", 128),
                linear_value_head_dim=t.get("linear_value_head_dim", 128),
                linear_num_key_heads=t.get("linear_num_key_heads", 16),
                linear_num_value_heads=t.get("linear_num_value_heads", 32), hf_model_type=family, **rope, **moe)


def qwen3_next_hf_config_dict(c: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformers.Qwen3NextConfig`` / ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig`` for
    ``c`` (``model_type``, ``architectures`` and ``rope_parameters`` included)."""
    family = qwen3_next_family(c)
    kw: dict[str, Any] = dict(
        model_type=family, architectures=[QWEN3_NEXT_ARCHITECTURES[family]], vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.query_groups, head_dim=c.head_dim, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.init_method_std,
        rms_norm_eps=c.layernorm_epsilon, tie_word_embeddings=c.tie_embeddings, attention_bias=False,
        attention_dropout=c.attention_dropout, linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_num_key_heads=c.linear_num_key_heads, linear_num_value_heads=c.linear_num_value_heads,
        layer_types=["linear_attention" if c.layer_kinds(i).mixer == "gdn" else "full_attention"
                     for i in range(c.num_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base, "partial_rotary_factor": c.rotary_percent})
    if family != "qwen3_5_moe_text":
        kw["intermediate_size"] = c.ffn_size
    if family == "qwen3_5_text":
        return kw
    kw.update(num_experts=c.num_experts or 0, router_aux_loss_coef=c.moe_aux_loss_coeff, output_router_logits=False)
    if c.num_experts:
        kw.update(num_experts_per_tok=c.moe_router_topk, moe_intermediate_size=c.moe_ffn_size,
                  shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size)
    if family == "qwen3_next":
        kw.update(norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
                  mlp_only_layers=[i for i in range(c.num_layers) if not c.is_moe_layer(i)] if c.num_experts else [])
    return kw
