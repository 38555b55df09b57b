"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi-K2 and Moonlight are the same network with
other values) <-> megazero: multi-latent attention, YaRN, a sigmoid router with an expert bias and
group-limited routing, a shared expert, dense first layers and multi-token prediction (hf.py maps the
embeddings, the final norm and the output layer).

Names (HF ``model.layers.i.`` <-> megazero ``layers.i.``):

* attention ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`` <-> ``self_attention.{linear_q_proj |
  linear_q_down_proj, q_layernorm, linear_q_up_proj}``; ``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
  o_proj`` <-> ``linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj``. The rows are laid
  out alike (per head the query's part without position, then its RoPE part; per head key then value;
  the latent, then the shared RoPE key). megazero rotates interleaved pairs (``rope_interleave=True``,
  DeepSeek's own layout); a checkpoint in the rotate-half layout has its RoPE rows permuted on import,
  and exports as interleaved: the same function.
* the first ``first_k_dense_replace`` layers' ``mlp.{gate,up,down}_proj`` <-> ``mlp.linear_fc1 = [gate; up]``,
  ``mlp.linear_fc2``; the mixtures' ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias`` <->
  ``mlp.router.weight`` / ``mlp.router.expert_bias``, ``mlp.experts.e.*`` and ``mlp.shared_experts.*``
  as the dense MLP's.
* multi-token prediction module k is DeepSeek's ``model.layers.{num_hidden_layers + k}.``: ``enorm``,
  ``hnorm``, ``eh_proj``, ``shared_head.norm``, a layer's own names, and copies of the embedding
  (``embed_tokens``) and output layer (``shared_head.head``), written on export and ignored on import.
  megazero's: ``mtp.layers.k.{enorm, hnorm, eh_proj, final_layernorm}`` and ``mtp.layers.k.transformer_layer.``.
  A config whose ``num_nextn_predict_layers`` has no such tensors (transformers saves none) imports
  without them.

Routing: HF scores a group by the sum of its 2 best experts, megazero by its best top-k / group-top-k,
so group-limited routing converts where ``num_experts_per_tok = 2 * topk_group`` (or where every group
is used). megazero renormalises the top-k sigmoid scores exactly when k > 1: ``norm_topk_prob`` must
be ``k > 1``. DeepSeek's latent norms keep eps 1e-6 whatever ``rms_norm_eps`` says: imported as
``latent_layernorm_epsilon``. Also refused, by value and with the fix: quantized checkpoints
(``quantization_config``), scoring other than sigmoid / ``noaux_tc``, RoPE other than default or YaRN,
YaRN with ``truncate=False`` or an ``attention_factor`` of its own, attention biases, no shared expert,
and DeepSeek's ``moe_layer_freq`` other than 1.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from ..config import GPTConfig

__all__ = ["DEEPSEEK_FAMILIES", "DEEPSEEK_IMPORT_FAMILIES", "DEEPSEEK_ARCHITECTURES", "deepseek_mismatches",
           "deepseek_layer_to_hf", "deepseek_layer_from_hf", "deepseek_mtp_to_hf", "deepseek_mtp_from_hf",
           "deepseek_config_kwargs", "deepseek_hf_config_dict", "deepseek_ignored_key", "deepseek_rope_parameters",
           "mtp_layers_present", "streaming_group"]

DEEPSEEK_FAMILIES = ("deepseek_v3",)  # written on export
_LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm eps, whatever rms_norm_eps says
DEEPSEEK_IMPORT_FAMILIES = ("deepseek_v3", "kimi_k2")  # read on import (Kimi-K2's own model_type)
DEEPSEEK_ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}

_HF_ATTN = "self_attn."
_MZ_ATTN = "self_attention."


# ---- what converts --------------------------------------------------------------------------------


def _dense_first(c: GPTConfig) -> Optional[int]:
    """``first_k_dense_replace`` of ``c``'s moe_layer_freq (k dense layers, then mixtures); None if it is
    not of that shape."""
    f = c.moe_layer_freq
    if not isinstance(f, (tuple, list)):
        return 0 if f == 1 else None
    k = list(f).index(1) if 1 in f else len(f)
    return k if list(f) == [0] * k + [1] * (len(f) - k) else None


def deepseek_mismatches(c: GPTConfig) -> list[str]:
    """What keeps the multi-latent-attention config ``c`` from being a DeepSeek-V3 model (empty: it is one)."""
    need = [("position_embedding_type", "rope"), ("normalization", "rmsnorm"), ("activation", "swiglu"),
            ("add_bias_linear", False), ("add_qkv_bias", False), ("qk_layernorm", False),
            ("moe_router_score_function", "sigmoid"), ("moe_shared_expert_gate", False)]
    out = [f"{k}={getattr(c, k)!r} (needs {v!r})" for k, v in need if getattr(c, k) != v]
    if c.latent_norm_epsilon != _LATENT_EPS:
        out.append(f"the latent norms' epsilon {c.latent_norm_epsilon} (DeepSeek-V3's q_a_layernorm and kv_a_layernorm "
                   f"keep {_LATENT_EPS}: set latent_layernorm_epsilon={_LATENT_EPS})")
    if not c.num_experts or c.num_experts < 2:
        out.append(f"num_experts={c.num_experts} (DeepSeek-V3's mixtures need at least 2 experts)")
        return out
    if _dense_first(c) is None:
        out.append(f"moe_layer_freq={c.moe_layer_freq!r} (DeepSeek-V3 has dense layers first, then mixtures: "
                   "[0]*k + [1]*(num_layers - k))")
    shared = c.moe_shared_expert_intermediate_size
    if not shared or shared % c.moe_ffn_size:
        out.append(f"moe_shared_expert_intermediate_size={shared} (DeepSeek-V3's shared experts are "
                   f"n_shared_experts x moe_ffn_hidden_size={c.moe_ffn_size} wide)")
    k, g, gk = c.moe_router_topk, c.moe_router_num_groups, c.moe_router_group_topk
    if g and gk < g and k != 2 * gk:
        out.append(f"moe_router_topk={k} with moe_router_group_topk={gk} (HF scores a group by its 2 best experts, "
                   f"megazero by its {k // gk} best: needs moe_router_topk = 2 x moe_router_group_topk)")
    return out


# ---- RoPE row layouts -------------------------------------------------------------------------------


def _half_to_interleaved(d: int) -> torch.Tensor:
    """Rows of a rotate-half RoPE part (pairs i, i + d/2) taken in megazero's interleaved order (2i, 2i + 1)."""
    return torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(-1)


def _interleave_rope_rows(w: torch.Tensor, c: GPTConfig, per_head: bool) -> torch.Tensor:
    """The RoPE rows of a query projection (``per_head``: each head's last qk_pos_emb_head_dim rows) or of the
    key/value down projection (its last rows), from the rotate-half layout into the interleaved one."""
    r = c.qk_pos_emb_head_dim
    index = _half_to_interleaved(r)
    if per_head:
        heads = w.view(c.num_attention_heads, c.qk_head_dim + r, *w.shape[1:])
        return torch.cat([heads[:, :c.qk_head_dim], heads[:, c.qk_head_dim:][:, index]], dim=1).reshape(w.shape)
    return torch.cat([w[:-r], w[-r:][index]])


# ---- one layer ----------------------------------------------------------------------------------------


def _attention_names(c: GPTConfig) -> list[tuple[str, str]]:
    """(megazero, HF) names of an attention's tensors, without the layer prefixes."""
    q = ([("linear_q_proj", "q_proj")] if c.q_lora_rank is None else
         [("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj")])
    return [(mz + ".weight", hf + ".weight") for mz, hf in
            q + [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
                 ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]]


def _mlp_names(mz: str, hf: str) -> list[tuple[str, tuple[str, ...]]]:
    """(megazero, HF) names of one SwiGLU MLP: fc1 = [gate; up], fc2 = down."""
    return [(mz + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight")),
            (mz + "linear_fc2.weight", (hf + "down_proj.weight",))]


def _layer_mlp_names(c: GPTConfig, moe: bool) -> list[tuple[str, tuple[str, ...]]]:
    if not moe:
        return _mlp_names("mlp.", "mlp.")
    names = [("mlp.router.weight", ("mlp.gate.weight",)),
             ("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",))]
    for e in range(c.num_experts):
        names += _mlp_names(f"mlp.experts.{e}.", f"mlp.experts.{e}.")
    return names + _mlp_names("mlp.shared_experts.", "mlp.shared_experts.")


def deepseek_layer_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, mz: str, hf: str, moe: bool
                         ) -> dict[str, torch.Tensor]:
    """One layer of a full megazero state dict (names under ``mz``, e.g. ``layers.3.``) by HF name (under
    ``hf``, e.g. ``model.layers.3.``); ``moe``: its MLP is a mixture."""
    out = {hf + "input_layernorm.weight": sd[mz + "input_layernorm.weight"],
           hf + "post_attention_layernorm.weight": sd[mz + "pre_mlp_layernorm.weight"]}
    for m, h in _attention_names(c):
        out[hf + _HF_ATTN + h] = sd[mz + _MZ_ATTN + m]
    for m, hs in _layer_mlp_names(c, moe):
        if m == "mlp.router.expert_bias" and not c.moe_router_enable_expert_bias:
            out[hf + hs[0]] = torch.zeros(c.num_experts)  # HF's router always has one: no bias is zeros
            continue
        if m == "mlp.router.expert_bias" and mz + m not in sd:
            raise KeyError(f"{mz + m} (the router's expert bias: moe_router_enable_expert_bias is on) is not among the "
                           "checkpoint's tensors; the export needs the model's persistent buffers with its parameters")
        for h, t in zip(hs, sd[mz + m].chunk(len(hs), dim=0)):
            out[hf + h] = t
    return out


def deepseek_layer_from_hf(take: Callable[[str], torch.Tensor], c: GPTConfig, mz: str, hf: str, moe: bool,
                           rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of :func:`deepseek_layer_to_hf`; ``rope_interleave=False``: the checkpoint's RoPE rows are in
    the rotate-half layout (permuted into megazero's interleaved one)."""
    out = {mz + "input_layernorm.weight": take(hf + "input_layernorm.weight"),
           mz + "pre_mlp_layernorm.weight": take(hf + "post_attention_layernorm.weight")}
    for m, h in _attention_names(c):
        t = take(hf + _HF_ATTN + h)
        if not rope_interleave and h in ("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight"):
            t = _interleave_rope_rows(t, c, per_head=h != "kv_a_proj_with_mqa.weight")
        out[mz + _MZ_ATTN + m] = t
    for m, hs in _layer_mlp_names(c, moe):
        parts = [take(hf + h) for h in hs]
        out[mz + m] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


# ---- multi-token prediction ---------------------------------------------------------------------------

_MTP_OWN = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
            ("final_layernorm.weight", "shared_head.norm.weight")]


def deepseek_mtp_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """The multi-token prediction modules of a full megazero state dict as DeepSeek's extra layers, with their
    copies of the embedding and the output layer (unpadded: ``vocab_size`` rows)."""
    out: dict[str, torch.Tensor] = {}
    head = sd["embedding.weight" if c.tie_embeddings else "output_layer.weight"]
    for k in range(c.mtp_num_layers):
        mz, hf = f"mtp.layers.{k}.", f"model.layers.{c.num_layers + k}."
        for m, h in _MTP_OWN:
            out[hf + h] = sd[mz + m]
        moe = mz + "transformer_layer.mlp.router.weight" in sd
        out.update(deepseek_layer_to_hf(sd, c, mz + "transformer_layer.", hf, moe))
        # copies of their own: safetensors refuses tensors that share memory
        out[hf + "embed_tokens.weight"] = sd["embedding.weight"][:c.vocab_size].clone()
        out[hf + "shared_head.head.weight"] = head[:c.vocab_size].clone()
    return out


def deepseek_mtp_from_hf(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], c: GPTConfig,
                         rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of :func:`deepseek_mtp_to_hf` (``has``: whether the checkpoint holds a name); the
    embedding and output-layer copies are not read."""
    out: dict[str, torch.Tensor] = {}
    for k in range(c.mtp_num_layers):
        mz, hf = f"mtp.layers.{k}.", f"model.layers.{c.num_layers + k}."
        for m, h in _MTP_OWN:
            out[mz + m] = take(hf + h)
        out.update(deepseek_layer_from_hf(take, c, mz + "transformer_layer.", hf, has(hf + "mlp.gate.weight"),
                                          rope_interleave))
    return out


def mtp_layers_present(hf: dict[str, Any], names) -> int:
    """How many of the config's ``num_nextn_predict_layers`` modules the checkpoint (tensor ``names``) holds."""
    n, want = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    present = {name.split(".")[2] for name in names if name.startswith("model.layers.")}
    k = 0
    while k < want and str(n + k) in present:
        k += 1
    return k


def streaming_group(name: str, c: GPTConfig) -> int:
    """The layer a (megazero or HF) tensor name belongs to when converting one layer at a time: module k of
    multi-token prediction is layer ``num_layers + k`` on both sides, and its copies of the embedding and
    output layer go with those; -1 for the rest."""
    parts = name.split(".")
    if parts[0] == "mtp" and len(parts) > 2:
        return c.num_layers + int(parts[2])
    if parts[:2] == ["model", "layers"] and len(parts) > 3:
        if parts[3] in ("embed_tokens", "shared_head") and parts[4] != "norm":
            return -1
        return int(parts[2])
    if parts[0] == "layers" and len(parts) > 1:
        return int(parts[1])
    return -1


def deepseek_ignored_key(key: str, c: GPTConfig) -> bool:
    """DeepSeek's multi-token prediction modules' copies of the embedding and output layer, and the modules
    beyond ``mtp_num_layers`` (an import without them, as transformers loads the model)."""
    parts = key.split(".")
    if parts[:2] != ["model", "layers"] or int(parts[2]) < c.num_layers:
        return False
    return int(parts[2]) >= c.num_layers + c.mtp_num_layers or parts[3] == "embed_tokens" or \
        parts[3:5] == ["shared_head", "head"]


# ---- configs ------------------------------------------------------------------------------------------


def _rope_settings(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The RoPE parameters of an HF config (``rope_parameters``, transformers >= 5, or ``rope_scaling`` and
    ``rope_theta``) and its base."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope, float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _attention_factor(factor: float, m: float, m_all: float) -> float:
    """YaRN's factor on the RoPE tables, megazero's and transformers' rule alike."""
    return _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor, 1.0)


def _yarn_kwargs(hf: dict[str, Any], rope: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """GPTConfig's YaRN fields for HF's YaRN parameters (transformers' ``_compute_yarn_parameters``)."""
    orig = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if orig is None:
        problems.append("YaRN without original_max_position_embeddings (add it to rope_parameters)")
        orig = hf.get("max_position_embeddings", 4096)
    factor = rope.get("factor") or hf.get("max_position_embeddings", orig) / orig
    m_all = float(rope.get("mscale_all_dim") or 0.0)
    m = float(rope["mscale"]) if rope.get("mscale") is not None else (0.0 if m_all else 1.0)  # absent: not used
    given = rope.get("attention_factor")
    if given is not None and abs(given - _attention_factor(factor, m, m_all)) > 1e-12:
        problems.append(f"YaRN attention_factor={given} (megazero derives it from factor, mscale and mscale_all_dim"
                        f": {_attention_factor(factor, m, m_all)}; remove it)")
    if rope.get("truncate", True) is not True:
        problems.append("YaRN truncate=False (megazero rounds the correction range outwards: remove it)")
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor), original_max_position_embeddings=int(orig),
                beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=m, mscale_all_dim=m_all)


def _routing_kwargs(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    k, g, gk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if g > 1 and gk < g and k != 2 * gk:
        problems.append(f"num_experts_per_tok={k} with topk_group={gk} (HF scores a group by its 2 best experts, "
                        f"megazero by its num_experts_per_tok/topk_group best: representable when num_experts_per_tok"
                        f" = 2 x topk_group)")
    norm = hf.get("norm_topk_prob", True)
    if bool(norm) != (k > 1):
        problems.append(f"norm_topk_prob={norm} with num_experts_per_tok={k} (megazero renormalises the sigmoid "
                        "weights exactly when more than one expert is chosen)")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]!r} (DeepSeek-V3's routing needs {want!r})")
    kw = dict(num_experts=hf["n_routed_experts"], moe_router_topk=k, moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True,
              moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
              moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 0.0)),
              moe_router_load_balancing_type="seq_aux_loss" if hf.get("seq_aux", True) else "aux_loss")
    if g > 1 and gk < g:
        kw.update(moe_router_num_groups=g, moe_router_group_topk=gk)
    return kw


def deepseek_config_kwargs(hf: dict[str, Any], mtp_layers: int) -> dict[str, Any]:
    """GPTConfig fields of an HF DeepSeek-V3 / Kimi-K2 ``config.json`` dict with ``mtp_layers`` multi-token
    prediction modules; ValueError naming each value megazero cannot represent, and the fix."""
    problems: list[str] = []
    if hf.get("quantization_config"):
        problems.append(f"quantization_config={hf['quantization_config'].get('quant_method', '?')!r} (quantized "
                        "weights: convert the checkpoint to bf16 first, e.g. DeepSeek's fp8_cast_bf16.py)")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("moe_layer_freq", 1)):
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]!r} (DeepSeek-V3 in megazero needs {want!r})")
    if not hf.get("n_shared_experts"):
        problems.append(f"n_shared_experts={hf.get('n_shared_experts')} (megazero maps DeepSeek-V3 with its shared "
                        "experts)")
    rope, theta = _rope_settings(hf)
    kind = rope.get("rope_type", "default")
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0) or 0
    kw = dict(num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
              vocab_size=hf["vocab_size"], ffn_hidden_size=hf["intermediate_size"],
              moe_ffn_hidden_size=hf["moe_intermediate_size"],
              moe_shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
              moe_layer_freq=tuple([0] * min(dense, layers) + [1] * max(layers - dense, 0)) if dense else 1,
              multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
              qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
              v_head_dim=hf["v_head_dim"], max_position_embeddings=hf.get("max_position_embeddings", 4096),
              seq_length=hf.get("max_position_embeddings", 4096), position_embedding_type="rope", rotary_base=theta,
              normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
              tie_embeddings=hf.get("tie_word_embeddings", False), hidden_dropout=0.0,
              attention_dropout=hf.get("attention_dropout", 0.0), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
              latent_layernorm_epsilon=_LATENT_EPS,
              init_method_std=hf.get("initializer_range", 0.02), mtp_num_layers=mtp_layers,
              **_routing_kwargs(hf, problems))
    if kind == "yarn":
        kw.update(_yarn_kwargs(hf, rope, problems))
    elif kind == "default":
        kw.update(rope_type="rope")
    else:
        problems.append(f"rope type {kind!r} (megazero's DeepSeek-V3 RoPE is 'default' or 'yarn')")
    if problems:
        raise ValueError(f"HF {hf.get('model_type')} config not representable in megazero: " + "; ".join(problems))
    return kw


def deepseek_rope_parameters(c: GPTConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for ``c``."""
    if c.resolved_rope_type != "yarn":
        return {"rope_type": "default", "rope_theta": c.rotary_base}
    return {"rope_type": "yarn", "rope_theta": c.rotary_base, "factor": c.rotary_scaling_factor,
            "original_max_position_embeddings": c.original_max_position_embeddings, "beta_fast": c.beta_fast,
            "beta_slow": c.beta_slow, "mscale": c.mscale, "mscale_all_dim": c.mscale_all_dim}


def deepseek_hf_config_dict(c: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformers.DeepseekV3Config`` for ``c`` (``rope_parameters`` included)."""
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, intermediate_size=c.ffn_size, moe_intermediate_size=c.moe_ffn_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_attention_heads,
                n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_size,
                n_routed_experts=c.num_experts,
                routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0, kv_lora_rank=c.kv_lora_rank,
                q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                qk_nope_head_dim=c.qk_head_dim, n_group=c.moe_router_num_groups or 1,
                topk_group=c.moe_router_group_topk or 1, num_experts_per_tok=c.moe_router_topk,
                first_k_dense_replace=_dense_first(c), norm_topk_prob=c.moe_router_topk > 1, hidden_act="silu",
                max_position_embeddings=c.max_position_embeddings, initializer_range=c.init_method_std,
                rms_norm_eps=c.layernorm_epsilon, tie_word_embeddings=c.tie_embeddings,
                rope_parameters=deepseek_rope_parameters(c), rope_interleave=True, attention_bias=False,
                attention_dropout=c.attention_dropout, num_nextn_predict_layers=c.mtp_num_layers)
