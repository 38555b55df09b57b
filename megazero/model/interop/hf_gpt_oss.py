"""Hugging Face gpt-oss (``GptOssForCausalLM``, OpenAI's gpt-oss-20b and -120b) <-> megazero.

The network: GQA with ``head_dim`` free and biases on q, k, v and o, a learned sink logit per head
(``softmax_type='learnable'``), a sliding window in the layers ``layer_types`` marks ``sliding_attention`` (HF's
``sliding_window = W`` is ``window_size = (W - 1, 0)``), YaRN with ``truncate`` (the correction range rounded to
whole dimensions, ``yarn_correction_range_round_to_int``; gpt-oss's is false) and tables scaled by
0.1 ln(factor) + 1, RMSNorm, untied embeddings, and in every layer a mixture of experts: the router's logits with
a bias (``moe_router_bias``), the softmax over the top k, experts ``(up + 1) * quick_gelu(gate)`` after clamping
the gate to at most ``swiglu_limit`` and the up half to ``[-limit, limit]`` (``activation='quick_geglu'``,
``glu_linear_offset=1``, ``activation_func_clamp_value=swiglu_limit``), biases on both expert linears.

Names (HF ``model.layers.i.`` <-> megazero ``layers.i.``; hf.py maps the norms, q/k/v/o, the embedding, the final
norm and the head): ``self_attn.sinks`` <-> ``self_attention.core_attention.softmax_offset``;
``mlp.router.{weight,bias}`` <-> ``mlp.router.{weight,bias}``; the experts stacked,
``mlp.experts.gate_up_proj [E, h, 2f]`` with gate and up interleaved along the last dimension (gate j at 2j, up j
at 2j + 1), ``gate_up_proj_bias [E, 2f]`` alike, ``down_proj [E, f, h]`` and ``down_proj_bias [E, h]`` <->
expert e's ``mlp.experts.e.linear_fc1 = [gate; up]`` (``[2f, h]``) and ``linear_fc2`` (``[h, f]``).

The Hub's checkpoints keep the expert matrices in MXFP4 (``gate_up_proj_blocks`` / ``_scales``,
``down_proj_blocks`` / ``_scales``, ``quantization_config.quant_method: mxfp4``): the import dequantises them as
transformers does (``mxfp4.py``), into the dtype of the layer's expert biases (bf16 on the Hub; every MXFP4 value
is exact there). The export writes plain weights (``gate_up_proj``, ``down_proj``) and no
``quantization_config``: what ``save_pretrained`` writes for a dequantised model.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..config import GPTConfig
from .hf_dense import window_kwargs
from .mxfp4 import dequantize_mxfp4

__all__ = ["GPT_OSS_FAMILIES", "GPT_OSS_ARCHITECTURES", "gpt_oss_parts", "gpt_oss_mismatches", "gpt_oss_layer_to_hf",
           "gpt_oss_layer_from_hf", "gpt_oss_config_kwargs", "gpt_oss_hf_config_dict"]

GPT_OSS_FAMILIES = ("gpt_oss",)
GPT_OSS_ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
_ALPHA = 1.702  # HF's swiglu_alpha: megazero's quick GEGLU is x * sigmoid(1.702 x)
_THETA = 150000.0  # GptOssConfig's default RoPE base


# ---- what converts --------------------------------------------------------------------------------------


def gpt_oss_parts(c: GPTConfig) -> list[str]:
    """The settings of ``c`` that, among the HF families megazero converts, only gpt-oss has."""
    out = ["activation='quick_geglu'"] if c.activation == "quick_geglu" else []
    out += [f"glu_linear_offset={c.glu_linear_offset}"] if c.glu_linear_offset else []
    out += [f"activation_func_clamp_value={c.activation_func_clamp_value}"] if c.activation_func_clamp_value else []
    return out + (["moe_router_bias=True"] if c.moe_router_bias else [])


def gpt_oss_mismatches(c: GPTConfig) -> list[str]:
    """What keeps ``c`` from being a gpt-oss model (empty: it is one)."""
    need = [("position_embedding_type", "rope"), ("normalization", "rmsnorm"), ("activation", "quick_geglu"),
            ("glu_linear_offset", 1.0), ("rotary_percent", 1.0), ("add_bias_linear", True), ("moe_router_bias", True),
            ("softmax_type", "learnable"), ("qk_layernorm", False), ("multi_latent_attention", False),
            ("moe_router_pre_softmax", False), ("moe_router_score_function", "softmax"),
            ("moe_router_enable_expert_bias", False), ("moe_shared_expert_intermediate_size", None),
            ("moe_router_num_groups", None), ("mtp_num_layers", 0)]
    out = [f"{k}={getattr(c, k)!r} (gpt-oss needs {v!r})" for k, v in need if getattr(c, k) != v]
    if c.activation_func_clamp_value is None:
        out.append("activation_func_clamp_value=None (gpt-oss clamps its experts at swiglu_limit: set one)")
    if not c.num_experts or not all(c.is_moe_layer(i) for i in range(c.num_layers)):
        out.append(f"num_experts={c.num_experts}, moe_layer_freq={c.moe_layer_freq!r} (every gpt-oss layer is a "
                   "mixture of experts)")
    if c.moe_router_topk_scaling_factor not in (None, 1.0):
        out.append(f"moe_router_topk_scaling_factor={c.moe_router_topk_scaling_factor} (gpt-oss's weights sum to 1)")
    kind = c.resolved_rope_type
    if kind not in ("rope", "yarn"):
        out.append(f"rope_type={kind!r} (megazero converts gpt-oss's RoPE plain or YaRN)")
    if kind == "yarn" and (c.mscale != 1.0 or c.mscale_all_dim != 0.0):
        out.append(f"YaRN mscale={c.mscale}, mscale_all_dim={c.mscale_all_dim} (gpt-oss scales its tables by "
                   "0.1 ln(factor) + 1 and not its softmax: needs 1 and 0)")
    return out


# ---- one layer ------------------------------------------------------------------------------------------


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` along dim 0 -> gate 0, up 0, gate 1, up 1, ..."""
    gate, up = t.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(t.shape)


def _split(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_interleave`."""
    return torch.cat([t[0::2], t[1::2]])


def gpt_oss_layer_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s sinks, router and experts of a full megazero state dict, by HF name."""
    p, h = f"layers.{i}.", f"model.layers.{i}."
    expert = [f"{p}mlp.experts.{e}." for e in range(c.num_experts)]
    return {
        h + "self_attn.sinks": sd[p + "self_attention.core_attention.softmax_offset"],
        h + "mlp.router.weight": sd[p + "mlp.router.weight"],
        h + "mlp.router.bias": sd[p + "mlp.router.bias"],
        h + "mlp.experts.gate_up_proj": torch.stack([_interleave(sd[e + "linear_fc1.weight"]).t() for e in expert]),
        h + "mlp.experts.gate_up_proj_bias": torch.stack([_interleave(sd[e + "linear_fc1.bias"]) for e in expert]),
        h + "mlp.experts.down_proj": torch.stack([sd[e + "linear_fc2.weight"].t() for e in expert]),
        h + "mlp.experts.down_proj_bias": torch.stack([sd[e + "linear_fc2.bias"] for e in expert]),
    }


def _experts_matrix(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], name: str,
                    dtype: torch.dtype) -> torch.Tensor:
    """``name`` (``...gate_up_proj`` or ``...down_proj``), plain or as MXFP4 blocks and scales."""
    if has(name + "_blocks"):
        return dequantize_mxfp4(take(name + "_blocks"), take(name + "_scales"), dtype)
    return take(name)


def gpt_oss_layer_from_hf(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], c: GPTConfig,
                          i: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`gpt_oss_layer_to_hf`; ``take`` reads (and marks used) an HF tensor, ``has`` says
    whether the checkpoint holds one (the MXFP4 pairs in place of a matrix)."""
    p, h = f"layers.{i}.", f"model.layers.{i}.mlp.experts."
    gate_up_bias, down_bias = take(h + "gate_up_proj_bias"), take(h + "down_proj_bias")
    gate_up = _experts_matrix(take, has, h + "gate_up_proj", gate_up_bias.dtype)
    down = _experts_matrix(take, has, h + "down_proj", down_bias.dtype)
    out = {p + "self_attention.core_attention.softmax_offset": take(f"model.layers.{i}.self_attn.sinks"),
           p + "mlp.router.weight": take(f"model.layers.{i}.mlp.router.weight"),
           p + "mlp.router.bias": take(f"model.layers.{i}.mlp.router.bias")}
    for e in range(c.num_experts):
        q = f"{p}mlp.experts.{e}."
        out[q + "linear_fc1.weight"] = _split(gate_up[e].t())
        out[q + "linear_fc1.bias"] = _split(gate_up_bias[e])
        out[q + "linear_fc2.weight"] = down[e].t()
        out[q + "linear_fc2.bias"] = down_bias[e]
    return out


# ---- configs ------------------------------------------------------------------------------------------


def _yarn_factor(factor: float) -> float:
    """transformers' YaRN attention factor without mscale: 0.1 ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _rope_kwargs(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """GPTConfig's RoPE fields of a gpt-oss config: ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` and
    ``rope_theta`` (the Hub's config.json)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    kw: dict[str, Any] = dict(rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", _THETA))))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={rope['partial_rotary_factor']} (gpt-oss rotates whole heads)")
    if kind == "default":
        return dict(kw, rope_type="rope")
    if kind != "yarn":
        problems.append(f"rope type {kind!r} (megazero converts gpt-oss's RoPE plain or YaRN)")
        return kw
    orig = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if orig is None:
        problems.append("YaRN without original_max_position_embeddings (add it to rope_parameters)")
        orig = 4096
    factor = float(rope.get("factor") or hf.get("max_position_embeddings", orig) / orig)
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        problems.append(f"YaRN mscale={rope['mscale']}, mscale_all_dim={rope['mscale_all_dim']} (megazero's gpt-oss "
                        "scales the tables by 0.1 ln(factor) + 1: remove them)")
    given = rope.get("attention_factor")
    if given is not None and abs(given - _yarn_factor(factor)) > 1e-12:
        problems.append(f"YaRN attention_factor={given} (gpt-oss's is 0.1 ln(factor) + 1 = {_yarn_factor(factor)}: "
                        "remove it)")
    return dict(kw, rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=int(orig),
                beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=1.0, mscale_all_dim=0.0, yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


def gpt_oss_config_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig fields of an HF gpt-oss ``config.json`` dict; ValueError naming each value megazero cannot
    represent, and the fix."""
    problems: list[str] = []
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        problems.append(f"quantization_config {quant.get('quant_method')!r} (megazero dequantises mxfp4 experts "
                        "only: dequantise the checkpoint first)")
    if float(hf.get("swiglu_alpha", _ALPHA)) != _ALPHA:
        problems.append(f"swiglu_alpha={hf['swiglu_alpha']} (megazero's quick GEGLU is x * sigmoid({_ALPHA} x))")
    if hf.get("swiglu_limit", 7.0) is None:
        problems.append("swiglu_limit=None (transformers' gpt-oss clamps: give it a number)")
    if not hf.get("attention_bias", True):
        problems.append("attention_bias=False (gpt-oss's experts and router keep their biases, and megazero has "
                        "one add_bias_linear for every linear)")
    layers, heads, hidden = hf["num_hidden_layers"], hf["num_attention_heads"], hf["hidden_size"]
    # GptOssConfig's default pattern: even layers slide, odd ones see everything
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        problems.append(f"layer_types {unknown or types} (megazero's gpt-oss layers are sliding_attention or "
                        f"full_attention, one per layer: {layers})")
        window = {}
    else:
        window, more = window_kwargs({**hf, "layer_types": types}, "gpt_oss")
        problems += more
    rope = _rope_kwargs(hf, problems)
    if problems:
        raise ValueError("HF gpt_oss config not representable in megazero: " + "; ".join(problems))
    head_dim, max_pos = hf.get("head_dim") or 64, hf.get("max_position_embeddings", 131072)
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=hf["vocab_size"],
                num_query_groups=hf.get("num_key_value_heads") or heads,
                kv_channels=None if head_dim * heads == hidden else head_dim, ffn_hidden_size=hf["intermediate_size"],
                num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"], moe_router_bias=True,
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)), max_position_embeddings=max_pos,
                seq_length=max_pos, position_embedding_type="rope", normalization="rmsnorm", activation="quick_geglu",
                glu_linear_offset=1.0, activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
                add_bias_linear=True, softmax_type="learnable", tie_embeddings=hf.get("tie_word_embeddings", False),
                hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
                layernorm_epsilon=hf.get("rms_norm_eps", 1e-5), init_method_std=hf.get("initializer_range", 0.02),
                **window, **rope)


def _rope_parameters(c: GPTConfig) -> dict[str, Any]:
    if c.resolved_rope_type != "yarn":
        return {"rope_type": "default", "rope_theta": c.rotary_base}
    return {"rope_type": "yarn", "rope_theta": c.rotary_base, "factor": c.rotary_scaling_factor,
            "original_max_position_embeddings": c.original_max_position_embeddings, "beta_fast": c.beta_fast,
            "beta_slow": c.beta_slow, "truncate": c.yarn_correction_range_round_to_int}


def gpt_oss_hf_config_dict(c: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformers.GptOssConfig`` for ``c`` (``rope_parameters`` included). A model
    without a window writes every layer ``full_attention`` and a window as long as its context (transformers
    builds the sliding mask whether a layer uses it or not)."""
    sliding = [c.layer_window(i) is not None for i in range(c.num_layers)]
    window = c.max_position_embeddings if c.window_size is None else c.window_size[0] + 1  # HF counts the query
    return dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, intermediate_size=c.moe_ffn_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.query_groups, head_dim=c.head_dim,
                num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                router_aux_loss_coef=c.moe_aux_loss_coeff, output_router_logits=False,
                max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
                initializer_range=c.init_method_std, tie_word_embeddings=c.tie_embeddings,
                attention_dropout=c.attention_dropout, attention_bias=True, swiglu_alpha=_ALPHA,
                swiglu_limit=c.activation_func_clamp_value, sliding_window=window,
                layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                rope_parameters=_rope_parameters(c))
