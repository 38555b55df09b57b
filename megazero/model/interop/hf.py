"""Hugging Face interop: full megazero state dicts <-> HF GPT-2 / Llama checkpoints, the dense Llama-shaped
Qwen2, Qwen3 and Mistral (``hf_dense.py``, with Llama 3's RoPE scaling), the Llama-shaped mixtures of experts
Mixtral, Qwen2-MoE and Qwen3-MoE (whose mixture layers ``hf_moe.py`` maps), gpt-oss (``hf_gpt_oss.py``:
sinks, windows, YaRN, a router bias, clamped quick-GEGLU experts, MXFP4 on import) and DeepSeek-V3
(multi-latent attention; ``hf_deepseek.py`` maps its layers, Kimi-K2's ``kimi_k2`` imports as one), Qwen3-Next and
Qwen3.5 dense and MoE (Gated DeltaNet among gated attention layers; ``hf_qwen3_next.py`` maps them whole, the
multimodal Qwen3.5 checkpoints importing as their text model) and Nemotron-H (a hybrid pattern's Mamba-2, attention,
squared-ReLU MLP and mixture blocks; ``hf_nemotron_h.py`` maps them whole) and Kimi Linear (Kimi Delta Attention
among multi-latent attention without RoPE, DeepSeek's mixtures; ``hf_kimi_linear.py`` maps it whole): the families of
``HF_FAMILIES``, the classes of ``HF_ARCHITECTURES``.

* default architecture (learned positions, LayerNorm, tanh-GeLU, biases, tied, MHA)
  <-> ``GPT2LMHeadModel``. HF GPT-2 uses ``Conv1D`` (weights stored ``[in, out]``, i.e.
  transposed) and a fused ``c_attn`` ordered ``[q; k; v]``; ours is ordered per head
  group ``[q_g; k_g; v_g]`` (see ``megazero.model.transformer``), so the rows are permuted.
* rope + rmsnorm + swiglu (+GQA, with or without biases, tied or not)
  <-> ``LlamaForCausalLM``: our fused QKV splits into ``q_proj/k_proj/v_proj`` and
  ``linear_fc1 = [gate; up]`` into ``gate_proj/up_proj``. Our RoPE already uses HF's
  rotate_half convention, so q/k need no permutation.

Vocabulary: HF's ``vocab_size`` is the tokenizer's (``config.vocab_size``). Export drops
the padded embedding rows; import pads them with zeros. Padded ids are never predicted
by GPTModel (their logits are -inf), so logits and losses agree exactly with HF.

Megatron options: ``kv_channels`` maps to Llama's ``head_dim``; ``apply_layernorm_1p`` is
converted (HF stores gamma, megazero gamma - 1); training-only options (init method, fp32
residual, query-key layer scaling, recompute, ...) do not change the network. ``qk_layernorm`` makes a
Llama a Qwen3, ``add_qkv_bias`` a Qwen2 (``hf_dense.py``). Options no family expresses (``rotary_percent``
< 1, ``squared_relu``, no position embedding, ``kv_channels`` != hidden/heads for GPT-2) are refused by
field name.

Any other combination is refused with the list of what does not fit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..config import GPTConfig
from .hf_common import pad_vocabulary, refuse_unused
from .hf_dense import DENSE_ARCHITECTURES, DENSE_FAMILIES, dense_config_kwargs, dense_family, \
    dense_hf_config_dict, dense_mismatches, hf_rope_scaling, qk_norm_from_hf, qk_norm_to_hf, rope_config_kwargs
from .hf_deepseek import DEEPSEEK_ARCHITECTURES, DEEPSEEK_FAMILIES, DEEPSEEK_IMPORT_FAMILIES, deepseek_config_kwargs, \
    deepseek_hf_config_dict, deepseek_ignored_key, deepseek_layer_from_hf, deepseek_layer_to_hf, deepseek_mismatches, \
    deepseek_mtp_from_hf, deepseek_mtp_to_hf, mtp_layers_present
from .hf_gpt_oss import GPT_OSS_ARCHITECTURES, GPT_OSS_FAMILIES, gpt_oss_config_kwargs, gpt_oss_hf_config_dict, \
    gpt_oss_layer_from_hf, gpt_oss_layer_to_hf, gpt_oss_mismatches, gpt_oss_parts
from .hf_moe import MOE_ARCHITECTURES, MOE_FAMILIES, moe_config_kwargs, moe_family, moe_hf_config_dict, \
    moe_layer_from_hf, moe_layer_to_hf, moe_mismatches
from .hf_qwen3_next import QWEN3_NEXT_ARCHITECTURES, QWEN3_NEXT_CONFIG_CLASSES, QWEN3_NEXT_FAMILIES, \
    QWEN3_NEXT_IMPORT_FAMILIES, qwen3_next_config_kwargs, qwen3_next_family, qwen3_next_from_hf, \
    qwen3_next_hf_config_dict, qwen3_next_mismatches, qwen3_next_parts, qwen3_next_to_hf
from .hf_nemotron_h import NEMOTRON_H_ARCHITECTURES, NEMOTRON_H_FAMILIES, nemotron_h_config_kwargs, \
    nemotron_h_from_hf, nemotron_h_hf_config_dict, nemotron_h_mismatches, nemotron_h_parts, nemotron_h_to_hf
from .hf_kimi_linear import KIMI_LINEAR_ARCHITECTURES, KIMI_LINEAR_FAMILIES, kimi_linear_build_config, \
    kimi_linear_config_kwargs, kimi_linear_from_hf, kimi_linear_hf_config_dict, kimi_linear_mismatches, \
    kimi_linear_parts, kimi_linear_to_hf

__all__ = ["HF_FAMILIES", "HF_IMPORT_FAMILIES", "HF_ARCHITECTURES", "hf_architecture", "to_hf_state_dict", "from_hf_state_dict", "hf_config_dict", "config_from_hf",
           "export_to_hf", "build_hf_config", "set_token_ids", "import_from_hf", "load_hf_state_dict"]


# HF model_type values converted both ways
HF_FAMILIES = ("gpt2", "llama") + DENSE_FAMILIES + MOE_FAMILIES + GPT_OSS_FAMILIES + DEEPSEEK_FAMILIES + \
    QWEN3_NEXT_FAMILIES + NEMOTRON_H_FAMILIES + KIMI_LINEAR_FAMILIES
HF_IMPORT_FAMILIES = HF_FAMILIES + tuple(f for f in DEEPSEEK_IMPORT_FAMILIES + QWEN3_NEXT_IMPORT_FAMILIES
                                         if f not in HF_FAMILIES)  # read
HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", **DENSE_ARCHITECTURES, **MOE_ARCHITECTURES,
                    **GPT_OSS_ARCHITECTURES, **DEEPSEEK_ARCHITECTURES, **QWEN3_NEXT_ARCHITECTURES,
                    **NEMOTRON_H_ARCHITECTURES, **KIMI_LINEAR_ARCHITECTURES}


# ---- architecture check ----------------------------------------------------------------------


def _gpt2_mismatches(c: GPTConfig) -> list[str]:
    need = [("position_embedding_type", "learned"), ("normalization", "layernorm"), ("activation", "gelu"),
            ("add_bias_linear", True), ("tie_embeddings", True)]
    out = [f"{k}={getattr(c, k)!r} (needs {v!r})" for k, v in need if getattr(c, k) != v]
    if c.query_groups != c.num_attention_heads:
        out.append(f"num_query_groups={c.query_groups} (GPT-2 has no GQA: needs {c.num_attention_heads})")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        out.append(f"kv_channels={c.kv_channels} (GPT-2's head size is hidden_size/heads="
                   f"{c.hidden_size // c.num_attention_heads})")
    return out + _common_mismatches(c) + _attention_mismatches(c, "GPT-2")


def _llama_mismatches(c: GPTConfig) -> list[str]:
    need = [("position_embedding_type", "rope"), ("normalization", "rmsnorm"), ("activation", "swiglu"),
            ("rotary_percent", 1.0)]
    return [f"{k}={getattr(c, k)!r} (needs {v!r})" for k, v in need if getattr(c, k) != v] + dense_mismatches(c)


def _common_mismatches(c: GPTConfig) -> list[str]:
    return ["qk_layernorm=True (HF GPT-2/Llama have no query/key norm)"] if c.qk_layernorm else []


def _attention_mismatches(c: GPTConfig, family: str) -> list[str]:
    """Sliding windows and sinks, for a family that has neither."""
    out = [f"window_size={c.window_size} (HF {family} has no sliding window)"] if c.window_size is not None else []
    if c.softmax_type != "vanilla":
        out.append(f"softmax_type={c.softmax_type!r} (HF {family} has no attention sinks)")
    return out


def _is_norm_weight(key: str) -> bool:
    return key.endswith(("layernorm.weight", "final_norm.weight", ".enorm.weight", ".hnorm.weight"))


def _shift_norms(sd: dict[str, torch.Tensor], c: GPTConfig, delta: float) -> dict[str, torch.Tensor]:
    """apply_layernorm_1p stores gamma - 1: add 1 going to HF, subtract it coming back."""
    if not c.apply_layernorm_1p:
        return sd
    return {k: (v + delta if _is_norm_weight(k) else v) for k, v in sd.items()}


def hf_architecture(config: GPTConfig) -> str:
    """The HF model family (one of ``HF_FAMILIES``) that represents ``config`` exactly."""
    if kimi_linear_parts(config):  # Kimi Delta Attention: only Kimi Linear has it
        bad = kimi_linear_mismatches(config)
        if bad:
            raise ValueError(f"config has {', '.join(kimi_linear_parts(config))}, which among the HF families only "
                             "Kimi Linear (KimiLinearForCausalLM) has, and is not representable in it: "
                             + ", ".join(bad) + ".")
        return "kimi_linear"
    if nemotron_h_parts(config):  # a hybrid stack of Mamba-2, attention, MLP and mixture blocks
        bad = nemotron_h_mismatches(config)
        if bad:
            raise ValueError(f"config has {', '.join(nemotron_h_parts(config))}, which among the HF families only "
                             "Nemotron-H (NemotronHForCausalLM) has, and is not representable in it: " + ", ".join(bad)
                             + ".")
        return "nemotron_h"
    if gpt_oss_parts(config):  # quick GEGLU, its offset and clamp, a router bias: only gpt-oss has them
        bad = gpt_oss_mismatches(config)
        if bad:
            raise ValueError(f"config has {', '.join(gpt_oss_parts(config))}, which among the HF families only "
                             "gpt-oss (GptOssForCausalLM) has, and is not representable in it: " + ", ".join(bad) + ".")
        return "gpt_oss"
    if qwen3_next_parts(config):  # Gated DeltaNet, the attention output gate: only Qwen3-Next and Qwen3.5 have them
        bad = qwen3_next_mismatches(config)
        if bad:
            raise ValueError(f"config has {', '.join(qwen3_next_parts(config))}, which among the HF families only "
                             f"Qwen3-Next and Qwen3.5 have, and is not representable in "
                             f"{HF_ARCHITECTURES[qwen3_next_family(config)]}: " + ", ".join(bad) + ".")
        return qwen3_next_family(config)
    if config.multi_latent_attention:
        bad = deepseek_mismatches(config) + _attention_mismatches(config, "DeepSeek-V3")
        if bad:
            raise ValueError("config is not representable in HF DeepSeek-V3: " + ", ".join(bad) + ".")
        return "deepseek_v3"
    if config.mtp_num_layers:
        raise ValueError(f"mtp_num_layers={config.mtp_num_layers}: multi-token prediction converts with DeepSeek-V3 "
                         "(multi_latent_attention) only; set mtp_num_layers=0 to export without it.")
    if config.num_experts:
        need = [("position_embedding_type", "rope"), ("normalization", "rmsnorm"), ("activation", "swiglu"),
                ("rotary_percent", 1.0)]
        bad = [f"{k}={getattr(config, k)!r} (needs {v!r})" for k, v in need if getattr(config, k) != v]
        bad += moe_mismatches(config) + _attention_mismatches(config, "Mixtral/Qwen-MoE")
        if bad:
            raise ValueError("config is not representable in HF Mixtral, Qwen2-MoE or Qwen3-MoE: " + ", ".join(bad)
                             + ".")
        return moe_family(config)
    gpt2, llama = _gpt2_mismatches(config), _llama_mismatches(config)
    if not gpt2:
        return "gpt2"
    if not llama:
        return dense_family(config)
    raise ValueError("config is not representable in HF GPT-2 or Llama (nor Qwen2, Qwen3, Mistral). GPT-2 mismatches: " + ", ".join(gpt2)
                     + ". Llama mismatches: " + ", ".join(llama) + ".")


# ---- fused-weight helpers ---------------------------------------------------------------------


def _split_qkv(t: torch.Tensor, c: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our per-group fused QKV (weight ``[(n+2g)d, h]`` or bias) -> full q, k, v."""
    g, d, per = c.query_groups, c.head_dim, c.num_attention_heads // c.query_groups
    rest = t.shape[1:]
    t = t.reshape(g, per + 2, d, *rest)
    return (t[:, :per].reshape(g * per * d, *rest), t[:, per].reshape(g * d, *rest), t[:, per + 1].reshape(g * d, *rest))


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    g, d, per = c.query_groups, c.head_dim, c.num_attention_heads // c.query_groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return fused.reshape(g * (per + 2) * d, *rest)


def _unpad(t: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    return t[: c.vocab_size].contiguous()


# ---- state dict mapping -------------------------------------------------------------------------


def to_hf_state_dict(full_sd: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Full megazero state dict -> HF state dict (the keys of its ``HF_ARCHITECTURES`` class)."""
    c = config
    arch = hf_architecture(c)
    if arch in QWEN3_NEXT_FAMILIES:
        return qwen3_next_to_hf(full_sd, c)
    if arch in NEMOTRON_H_FAMILIES:
        return nemotron_h_to_hf(full_sd, c)
    if arch in KIMI_LINEAR_FAMILIES:
        return kimi_linear_to_hf(full_sd, c)
    sd = _shift_norms(full_sd, c, 1.0)
    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        if arch == "deepseek_v3":
            out.update(deepseek_layer_to_hf(sd, c, p, f"model.layers.{i}.", c.is_moe_layer(i)))
            continue
        qkv_w = sd[p + "self_attention.linear_qkv.weight"]
        if arch == "gpt2":
            h = f"transformer.h.{i}."
            out[h + "ln_1.weight"], out[h + "ln_1.bias"] = sd[p + "input_layernorm.weight"], sd[p + "input_layernorm.bias"]
            out[h + "attn.c_attn.weight"] = torch.cat(_split_qkv(qkv_w, c)).t()
            out[h + "attn.c_attn.bias"] = torch.cat(_split_qkv(sd[p + "self_attention.linear_qkv.bias"], c))
            out[h + "attn.c_proj.weight"] = sd[p + "self_attention.linear_proj.weight"].t()
            out[h + "attn.c_proj.bias"] = sd[p + "self_attention.linear_proj.bias"]
            out[h + "ln_2.weight"], out[h + "ln_2.bias"] = sd[p + "pre_mlp_layernorm.weight"], sd[p + "pre_mlp_layernorm.bias"]
            out[h + "mlp.c_fc.weight"] = sd[p + "mlp.linear_fc1.weight"].t()
            out[h + "mlp.c_fc.bias"] = sd[p + "mlp.linear_fc1.bias"]
            out[h + "mlp.c_proj.weight"] = sd[p + "mlp.linear_fc2.weight"].t()
            out[h + "mlp.c_proj.bias"] = sd[p + "mlp.linear_fc2.bias"]
        else:
            h = f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
            out[h + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
            names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            for suffix in ("weight", "bias") if c.add_bias_linear else ("weight",):
                for name, t in zip(names, _split_qkv(sd[p + "self_attention.linear_qkv." + suffix], c)):
                    out[f"{h}{name}.{suffix}"] = t
                out[f"{h}self_attn.o_proj.{suffix}"] = sd[p + "self_attention.linear_proj." + suffix]
                if c.num_experts:
                    continue
                gate, up = sd[p + "mlp.linear_fc1." + suffix].chunk(2, dim=0)
                out[f"{h}mlp.gate_proj.{suffix}"], out[f"{h}mlp.up_proj.{suffix}"] = gate, up
                out[f"{h}mlp.down_proj.{suffix}"] = sd[p + "mlp.linear_fc2." + suffix]
            if c.add_qkv_bias and not c.add_bias_linear:  # Qwen2's biases on q, k and v alone
                for name, t in zip(names, _split_qkv(sd[p + "self_attention.linear_qkv.bias"], c)):
                    out[f"{h}{name}.bias"] = t
            if c.qk_layernorm and not c.num_experts:  # Qwen3's (the mixtures map theirs)
                out.update(qk_norm_to_hf(sd, p, h))
            if c.num_experts:
                out.update(gpt_oss_layer_to_hf(sd, c, i) if arch == "gpt_oss" else moe_layer_to_hf(sd, c, i))
    if arch == "gpt2":
        out["transformer.wte.weight"] = _unpad(sd["embedding.weight"], c)
        out["transformer.wpe.weight"] = sd["position_embeddings.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["final_norm.weight"], sd["final_norm.bias"]
    else:
        out["model.embed_tokens.weight"] = _unpad(sd["embedding.weight"], c)
        out["model.norm.weight"] = sd["final_norm.weight"]
        if not c.tie_embeddings:
            out["lm_head.weight"] = _unpad(sd["output_layer.weight"], c)
    if arch == "deepseek_v3":
        out.update(deepseek_mtp_to_hf(sd, c))
    return {k: v.contiguous() for k, v in out.items()}


# Keys some HF checkpoints carry that hold no weights of their own.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], config: GPTConfig, hf_config: dict[str, Any] | None = None
                       ) -> dict[str, torch.Tensor]:
    """HF state dict (any of ``HF_IMPORT_FAMILIES``) -> full megazero state dict for ``config``. Strict about
    keys. ``hf_config``: the HF ``config.json`` dict, for the layouts a GPTConfig does not record (DeepSeek's
    ``rope_interleave``)."""
    c = config
    interleave = (hf_config or {}).get("rope_interleave", True)
    arch = hf_architecture(c)
    if arch in QWEN3_NEXT_FAMILIES:
        return qwen3_next_from_hf(hf_sd, c)
    if arch in NEMOTRON_H_FAMILIES:
        return nemotron_h_from_hf(hf_sd, c)
    if arch in KIMI_LINEAR_FAMILIES:
        return kimi_linear_from_hf(hf_sd, c)
    sd = dict(hf_sd)
    if arch == "gpt2" and not any(k.startswith("transformer.") for k in sd):
        sd = {("lm_head.weight" if k == "lm_head.weight" else "transformer." + k): v for k, v in sd.items()}
    if c.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the tied copy, if the checkpoint stores it
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"HF checkpoint lacks {key!r} (needed for a {arch} model with {c.num_layers} layers)")
        used.add(key)
        return sd[key]

    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        if arch == "deepseek_v3":
            out.update(deepseek_layer_from_hf(take, c, p, f"model.layers.{i}.", c.is_moe_layer(i), interleave))
            continue
        if arch == "gpt2":
            h = f"transformer.h.{i}."
            out[p + "input_layernorm.weight"] = take(h + "ln_1.weight")
            out[p + "input_layernorm.bias"] = take(h + "ln_1.bias")
            q, k, v = take(h + "attn.c_attn.weight").t().chunk(3, dim=0)
            out[p + "self_attention.linear_qkv.weight"] = _merge_qkv(q, k, v, c)
            out[p + "self_attention.linear_qkv.bias"] = _merge_qkv(*take(h + "attn.c_attn.bias").chunk(3), c)
            out[p + "self_attention.linear_proj.weight"] = take(h + "attn.c_proj.weight").t()
            out[p + "self_attention.linear_proj.bias"] = take(h + "attn.c_proj.bias")
            out[p + "pre_mlp_layernorm.weight"] = take(h + "ln_2.weight")
            out[p + "pre_mlp_layernorm.bias"] = take(h + "ln_2.bias")
            out[p + "mlp.linear_fc1.weight"] = take(h + "mlp.c_fc.weight").t()
            out[p + "mlp.linear_fc1.bias"] = take(h + "mlp.c_fc.bias")
            out[p + "mlp.linear_fc2.weight"] = take(h + "mlp.c_proj.weight").t()
            out[p + "mlp.linear_fc2.bias"] = take(h + "mlp.c_proj.bias")
        else:
            h = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = take(h + "input_layernorm.weight")
            out[p + "pre_mlp_layernorm.weight"] = take(h + "post_attention_layernorm.weight")
            for suffix in ("weight", "bias") if c.add_bias_linear else ("weight",):
                q, k, v = (take(f"{h}self_attn.{n}_proj.{suffix}") for n in "qkv")
                out[p + "self_attention.linear_qkv." + suffix] = _merge_qkv(q, k, v, c)
                out[p + "self_attention.linear_proj." + suffix] = take(f"{h}self_attn.o_proj.{suffix}")
                if c.num_experts:
                    continue
                gate, up = take(f"{h}mlp.gate_proj.{suffix}"), take(f"{h}mlp.up_proj.{suffix}")
                out[p + "mlp.linear_fc1." + suffix] = torch.cat([gate, up])
                out[p + "mlp.linear_fc2." + suffix] = take(f"{h}mlp.down_proj.{suffix}")
            if c.add_qkv_bias and not c.add_bias_linear:
                out[p + "self_attention.linear_qkv.bias"] = _merge_qkv(*(take(f"{h}self_attn.{n}_proj.bias") for n in "qkv"),
                                                                       c)
            if c.qk_layernorm and not c.num_experts:
                out.update(qk_norm_from_hf(take, p, h))
            if c.num_experts:
                out.update(gpt_oss_layer_from_hf(take, sd.__contains__, c, i) if arch == "gpt_oss" else
                           moe_layer_from_hf(take, c, i))
    if arch == "gpt2":
        out["embedding.weight"] = pad_vocabulary(take("transformer.wte.weight"), c)
        out["position_embeddings.weight"] = take("transformer.wpe.weight")
        out["final_norm.weight"], out["final_norm.bias"] = take("transformer.ln_f.weight"), take("transformer.ln_f.bias")
    else:
        out["embedding.weight"] = pad_vocabulary(take("model.embed_tokens.weight"), c)
        out["final_norm.weight"] = take("model.norm.weight")
        if not c.tie_embeddings:
            out["output_layer.weight"] = pad_vocabulary(take("lm_head.weight"), c)
    if arch == "deepseek_v3":
        out.update(deepseek_mtp_from_hf(take, sd.__contains__, c, interleave))
        used.update(k for k in sd if deepseek_ignored_key(k, c))
    refuse_unused((k for k in set(sd) - used if not k.endswith(_IGNORED_SUFFIXES)), arch)
    return {k: v.contiguous() for k, v in _shift_norms(out, c, -1.0).items()}


# ---- configs ---------------------------------------------------------------------------------------


def hf_config_dict(config: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of the HF config class (``GPT2Config``, ``LlamaConfig``, ``MixtralConfig``, ...) for
    ``config``."""
    c = config
    if hf_architecture(c) in QWEN3_NEXT_FAMILIES:
        return qwen3_next_hf_config_dict(c)
    if hf_architecture(c) in NEMOTRON_H_FAMILIES:
        return nemotron_h_hf_config_dict(c)
    if hf_architecture(c) in KIMI_LINEAR_FAMILIES:
        return kimi_linear_hf_config_dict(c)
    if hf_architecture(c) == "deepseek_v3":
        return deepseek_hf_config_dict(c)
    if hf_architecture(c) == "gpt_oss":
        return gpt_oss_hf_config_dict(c)
    if hf_architecture(c) == "gpt2":
        gpt2_tokens = c.vocab_size == 50257
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=c.vocab_size,
                    n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
                    n_head=c.num_attention_heads, n_inner=None if c.ffn_size == 4 * c.hidden_size else c.ffn_size,
                    activation_function="gelu_new", resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout,
                    attn_pdrop=c.attention_dropout, layer_norm_epsilon=c.layernorm_epsilon,
                    initializer_range=c.init_method_std, tie_word_embeddings=True,
                    bos_token_id=50256 if gpt2_tokens else None, eos_token_id=50256 if gpt2_tokens else None)
    llama = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size,
                 hidden_size=c.hidden_size, intermediate_size=c.ffn_size, num_hidden_layers=c.num_layers,
                 num_attention_heads=c.num_attention_heads, num_key_value_heads=c.query_groups, head_dim=c.head_dim,
                 max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
                 rope_theta=c.rotary_base, attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear,
                 tie_word_embeddings=c.tie_embeddings, attention_dropout=c.attention_dropout, hidden_act="silu",
                 initializer_range=c.init_method_std)
    if hf_rope_scaling(c) is not None:
        llama["rope_scaling"] = hf_rope_scaling(c)
    return moe_hf_config_dict(c, llama) if c.num_experts else dense_hf_config_dict(c, llama)


def config_from_hf(hf: dict[str, Any], weight_names=None, **overrides: Any) -> GPTConfig:
    """GPTConfig from an HF ``config.json`` dict (a model_type of ``HF_IMPORT_FAMILIES``); ``overrides`` set other
    fields (e.g. ``seq_length``, ``make_vocab_size_divisible_by``, ``sequence_parallel``). ``weight_names``: the
    checkpoint's tensor names, where a config may promise more than it holds (DeepSeek's
    ``num_nextn_predict_layers``: the modules present are imported); None trusts the config."""
    mt = hf.get("model_type")
    if mt in DEEPSEEK_IMPORT_FAMILIES:
        mtp = (mtp_layers_present(hf, weight_names) if weight_names is not None else
               hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)
        kw = deepseek_config_kwargs(hf, mtp)
    elif mt in GPT_OSS_FAMILIES:
        kw = gpt_oss_config_kwargs(hf)
    elif mt in QWEN3_NEXT_IMPORT_FAMILIES:
        kw = qwen3_next_config_kwargs(hf, weight_names)
    elif mt in NEMOTRON_H_FAMILIES:
        kw = nemotron_h_config_kwargs(hf, weight_names)
    elif mt in KIMI_LINEAR_FAMILIES:
        kw = kimi_linear_config_kwargs(hf)
    elif mt == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        problems = []
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            problems.append(f"activation_function={act!r} (megazero's gelu is the tanh approximation)")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False), ("tie_word_embeddings", True)):
            if hf.get(key, want) != want:
                problems.append(f"{key}={hf[key]!r} (needs {want!r})")
        if problems:
            raise ValueError("HF GPT-2 config not representable in megazero: " + ", ".join(problems))
        kw = dict(num_layers=hf.get("n_layer", 12), hidden_size=hf.get("n_embd", 768), num_attention_heads=hf.get("n_head", 12),
                  vocab_size=hf.get("vocab_size", 50257), ffn_hidden_size=hf.get("n_inner"),
                  max_position_embeddings=hf.get("n_positions", 1024), seq_length=hf.get("n_positions", 1024),
                  hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                  layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), init_method_std=hf.get("initializer_range", 0.02))
    elif mt == "llama" or mt in DENSE_FAMILIES or mt in MOE_FAMILIES:
        h, n = hf["hidden_size"], hf["num_attention_heads"]
        rope, problems = rope_config_kwargs(hf, mt)
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={hf['hidden_act']!r} (needs 'silu')")
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            problems.append("attention_bias != mlp_bias (megazero has one add_bias_linear)")
        moe, more = moe_config_kwargs(hf) if mt in MOE_FAMILIES else dense_config_kwargs(hf, mt) if \
            mt in DENSE_FAMILIES else ({}, [])
        problems += more
        if problems:
            raise ValueError(f"HF {mt} config not representable in megazero: " + ", ".join(problems))
        max_pos = hf.get("max_position_embeddings", 2048)
        kw = dict(num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=n, vocab_size=hf["vocab_size"],
                  ffn_hidden_size=hf["intermediate_size"], num_query_groups=hf.get("num_key_value_heads") or n,
                  kv_channels=None if hf.get("head_dim") in (None, h // n) else hf["head_dim"],
                  max_position_embeddings=max_pos, seq_length=max_pos, position_embedding_type="rope",
                  normalization="rmsnorm",
                  activation="swiglu", add_bias_linear=hf.get("attention_bias", False),
                  tie_embeddings=hf.get("tie_word_embeddings", False), hidden_dropout=0.0,
                  attention_dropout=hf.get("attention_dropout", 0.0), layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
                  init_method_std=hf.get("initializer_range", 0.02), **rope)
        kw.update(moe)
    else:
        raise ValueError(f"HF model_type {mt!r} is not supported; megazero converts {', '.join(HF_IMPORT_FAMILIES)}")
    return GPTConfig(**{**kw, **overrides}).validate()


# ---- files -------------------------------------------------------------------------------------------


def export_to_hf(full_state_dict: dict[str, torch.Tensor], config: GPTConfig, out_dir: str,
                 token_ids: tuple[int | None, int] | None = None) -> str:
    """Write a transformers directory (``config.json`` + ``model.safetensors``) loadable with
    ``AutoModelForCausalLM.from_pretrained(out_dir)``. Returns the HF architecture name.

    ``token_ids``: ``(bos, eos)`` of the tokenizer exported beside the model (as
    ``megazero.data.hf_tokenizer.export_tokenizer_to_hf`` returns them, eos = its EOD): they go into
    the config and the generation config, so ``generate()`` stops at the document end instead of
    transformers' defaults."""
    from safetensors.torch import save_file

    hf_config = build_hf_config(config)
    hf_sd = to_hf_state_dict(full_state_dict, config)
    os.makedirs(out_dir, exist_ok=True)
    set_token_ids(hf_config, token_ids, out_dir)
    hf_config.save_pretrained(out_dir)
    save_file({k: v.detach().cpu().contiguous() for k, v in hf_sd.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return hf_config.architectures[0]


def build_hf_config(config: GPTConfig):
    """The transformers config object (``GPT2Config``, ``LlamaConfig``, ``MixtralConfig``, ...) for ``config``."""
    import transformers

    kw = hf_config_dict(config)
    if kw["model_type"] in QWEN3_NEXT_FAMILIES:  # transformers >= 5 only
        cls = getattr(transformers, QWEN3_NEXT_CONFIG_CLASSES[kw["model_type"]])
        return cls(**{k: v for k, v in kw.items() if k != "model_type"})
    if kw["model_type"] in NEMOTRON_H_FAMILIES:  # transformers >= 5 (its layers_block_type spelling)
        return transformers.NemotronHConfig(**{k: v for k, v in kw.items() if k != "model_type"})
    if kw["model_type"] in KIMI_LINEAR_FAMILIES:  # transformers >= 5
        return kimi_linear_build_config(config)
    if kw["model_type"] in ("deepseek_v3", "gpt_oss"):
        cls = getattr(transformers, {"deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig"}[kw["model_type"]])
        kw = {k: v for k, v in kw.items() if k != "model_type"}
        rope = kw.pop("rope_parameters")
        if int(transformers.__version__.split(".")[0]) >= 5:
            return cls(**kw, rope_parameters=rope)
        theta = rope.pop("rope_theta")  # 4.x: the base apart, rope_scaling None for plain RoPE
        scaling = None if rope["rope_type"] == "default" else {"type": rope.pop("rope_type"), **rope}
        return cls(**kw, rope_theta=theta, rope_scaling=scaling)
    if kw["model_type"] == "gpt2":
        hf_config = transformers.GPT2Config(**{k: v for k, v in kw.items() if k != "model_type"})
    else:
        kw = {k: v for k, v in kw.items() if k != "model_type"}
        theta, scaling = kw.pop("rope_theta"), kw.pop("rope_scaling", None)
        cls = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
               "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}.get(
            hf_architecture(config), "LlamaConfig")
        # transformers >= 5 keeps RoPE settings in rope_parameters, 4.x in rope_theta and rope_scaling.
        rope = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
        hf_config = getattr(transformers, cls)(**kw, rope_parameters=rope)
        if getattr(hf_config, "rope_theta", None) is not None:
            hf_config.rope_theta, hf_config.rope_scaling = theta, scaling
    return hf_config


def set_token_ids(hf_config, token_ids: tuple[int | None, int] | None, out_dir: str) -> None:
    """Set ``(bos, eos)`` in ``hf_config`` and write the generation config with them into ``out_dir``
    (no-op for ``None``: no tokenizer exported)."""
    if token_ids is None:
        return
    import transformers

    bos, eos = token_ids
    hf_config.bos_token_id, hf_config.eos_token_id = bos, eos
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(out_dir)


def load_hf_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (safetensors or .bin, single or sharded)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index, path = os.path.join(hf_dir, index_name), os.path.join(hf_dir, single)
        files = []
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(path):
            files = [single]
        if files:
            sd: dict[str, torch.Tensor] = {}
            for name in files:
                full = os.path.join(hf_dir, name)
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    sd.update(load_file(full))
                else:
                    sd.update(torch.load(full, map_location="cpu", weights_only=True))
            return sd
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or sharded index) in {hf_dir}")


def import_from_hf(hf_dir: str, **overrides: Any) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Read a local HF directory (any of ``HF_FAMILIES``) -> ``(GPTConfig, full megazero state dict)``.

    Needs only safetensors (not transformers). ``overrides`` set GPTConfig fields.
    """
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    sd = load_hf_state_dict(hf_dir)
    config = config_from_hf(hf, list(sd), **overrides)
    return config, from_hf_state_dict(sd, config, hf)
