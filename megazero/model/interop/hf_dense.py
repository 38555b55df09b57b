"""The dense Hugging Face families beside Llama (``hf.py`` maps their shared Llama layout), and the Llama 3
RoPE scaling any Llama-shaped family may carry.

* ``qwen2`` (Qwen2, Qwen2.5) <-> ``Qwen2ForCausalLM``: a Llama with biases on q, k and v alone
  (``add_qkv_bias`` without ``add_bias_linear``).
* ``qwen3`` <-> ``Qwen3ForCausalLM``: a Llama with an RMSNorm over ``head_dim`` on every query and key head
  before RoPE (``qk_layernorm``; ``self_attn.q_norm`` / ``k_norm``), no biases.
* ``mistral`` <-> ``MistralForCausalLM``: a Llama (v0.3 and later: no sliding window). Nothing in the network
  tells it from Llama, so the import records ``hf_model_type='mistral'`` for the export.
* ``rope_type: llama3`` (Llama 3.1 and later): ``rope_type='llama3'`` with ``rotary_scaling_factor`` (``factor``),
  ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``; read from transformers 5's
  ``rope_parameters`` or 4.x's ``rope_scaling``, written back as both understand.

Sliding-window attention (Mistral v0.1, Qwen's ``use_sliding_window``) does not exist in megazero: a window
shorter than the model's context is refused.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..config import GPTConfig

__all__ = ["DENSE_FAMILIES", "DENSE_ARCHITECTURES", "dense_family", "dense_mismatches", "dense_config_kwargs",
           "rope_config_kwargs", "hf_rope_scaling", "dense_hf_config_dict", "qk_norm_to_hf", "qk_norm_from_hf"]

DENSE_FAMILIES = ("qwen2", "qwen3", "mistral")
DENSE_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def dense_family(c: GPTConfig) -> str:
    """The family of a dense Llama-shaped ``c`` (``dense_mismatches`` empty): 'qwen3' (q/k norms), 'qwen2'
    (q/k/v biases alone), 'mistral' (recorded by the import) or 'llama'."""
    if c.qk_layernorm:
        return "qwen3"
    if c.add_qkv_bias and not c.add_bias_linear:
        return "qwen2"
    return "mistral" if c.hf_model_type == "mistral" else "llama"


def dense_mismatches(c: GPTConfig) -> list[str]:
    """What keeps a rope/rmsnorm/swiglu ``c`` from being one of Llama, Qwen2, Qwen3 or Mistral (empty: it is)."""
    out = []
    if c.qk_layernorm and (c.add_bias_linear or c.add_qkv_bias):
        out.append("qk_layernorm=True with biases (Qwen3, the family with q/k norms, has none in megazero's "
                   "layout: its attention_bias spares the MLP)")
    if c.hf_model_type == "mistral" and (c.add_bias_linear or c.add_qkv_bias or c.qk_layernorm):
        out.append("hf_model_type='mistral' with biases or q/k norms (Mistral has neither)")
    return out


def _sliding_window_problem(hf: dict[str, Any], mt: str) -> Optional[str]:
    """The refusal of a sliding window shorter than the context (None: no window bites)."""
    window, max_pos = hf.get("sliding_window"), hf.get("max_position_embeddings", 2048)
    if mt == "mistral":
        if window is not None and window < max_pos:
            return (f"sliding-window attention is not supported yet; sliding_window={window} is shorter than "
                    f"max_position_embeddings={max_pos} (megazero attends over the whole causal context)")
        return None
    sliding_layers = any(t == "sliding_attention" for t in hf.get("layer_types") or ()) or (
        hf.get("use_sliding_window", False) and hf.get("max_window_layers", 0) < hf["num_hidden_layers"])
    if hf.get("use_sliding_window", False) and window is not None and window < max_pos and sliding_layers:
        return (f"use_sliding_window=True with sliding_window={window} < max_position_embeddings={max_pos}: "
                "sliding windows are not supported yet (megazero attends over the whole causal context)")
    return None


def dense_config_kwargs(hf: dict[str, Any], mt: str) -> tuple[dict[str, Any], list[str]]:
    """The GPTConfig fields of an HF Qwen2 / Qwen3 / Mistral config beyond Llama's, and what megazero cannot
    represent of it."""
    problems = [p for p in (_sliding_window_problem(hf, mt),) if p]
    if mt == "qwen2":
        return dict(add_qkv_bias=True), problems
    if mt == "qwen3":
        if hf.get("attention_bias", False):
            problems.append("attention_bias=True (Qwen3's biases on the attention alone do not exist in megazero)")
        head_dim = hf.get("head_dim") or 128  # Qwen3Config's default, unlike Llama's hidden / heads
        same = head_dim * hf["num_attention_heads"] == hf["hidden_size"]
        return dict(qk_layernorm=True, kv_channels=None if same else head_dim), problems
    return dict(hf_model_type="mistral"), problems


def rope_config_kwargs(hf: dict[str, Any], mt: str) -> tuple[dict[str, Any], list[str]]:
    """``rotary_base`` and, for ``rope_type: llama3``, the scaling fields of a Llama-shaped HF config (transformers
    5's ``rope_parameters`` or 4.x's ``rope_scaling``), and what megazero cannot represent of its RoPE."""
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    params = rope if "rope_type" in rope or "type" in rope else scaling
    rope_type = params.get("rope_type", params.get("type", "default"))
    kw: dict[str, Any] = dict(rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))))
    if rope_type == "default":
        return kw, []
    if rope_type != "llama3":
        return kw, [f"rope type {rope_type!r} (megazero's RoPE is plain or 'llama3')"]
    missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
    if missing:
        return kw, [f"rope type 'llama3' without {', '.join(missing)} (its {'rope_parameters' if params is rope else 'rope_scaling'} "
                    f"must give factor, low_freq_factor and high_freq_factor)"]
    # transformers' fallback for the original context: the config's top-level value, else max_position_embeddings
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or \
        hf.get("max_position_embeddings", 2048)
    kw.update(rope_type="llama3", rotary_scaling_factor=float(params["factor"]),
              low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
              original_max_position_embeddings=int(original))
    return kw, []


def hf_rope_scaling(c: GPTConfig) -> Optional[dict[str, Any]]:
    """The HF ``rope_scaling`` of ``c`` (4.x's form, ``rope_type`` in it); None for plain RoPE."""
    if c.resolved_rope_type != "llama3":
        return None
    return dict(rope_type="llama3", factor=c.rotary_scaling_factor, low_freq_factor=c.low_freq_factor,
                high_freq_factor=c.high_freq_factor, original_max_position_embeddings=c.original_max_position_embeddings)


def dense_hf_config_dict(c: GPTConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """The HF config keywords of a dense ``c``: Llama's (``llama``) as its family (``dense_family``) spells them."""
    family = dense_family(c)
    if family == "llama":
        return llama
    kw = {k: v for k, v in llama.items() if k not in ("mlp_bias", "attention_bias")}
    kw.update(model_type=family, architectures=[DENSE_ARCHITECTURES[family]])
    if family == "mistral":
        kw.update(sliding_window=None)
    else:  # Qwen: full attention in every layer
        kw.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
        if family == "qwen3":
            kw.update(attention_bias=False)
    return kw


def qk_norm_to_hf(sd: dict[str, torch.Tensor], p: str, h: str) -> dict[str, torch.Tensor]:
    """A layer's query/key norms (megazero prefix ``p``) under Qwen3's names (HF prefix ``h``)."""
    return {h + "self_attn.q_norm.weight": sd[p + "self_attention.q_layernorm.weight"],
            h + "self_attn.k_norm.weight": sd[p + "self_attention.k_layernorm.weight"]}


def qk_norm_from_hf(take: Callable[[str], torch.Tensor], p: str, h: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`qk_norm_to_hf`; ``take`` reads (and marks used) an HF tensor."""
    return {p + "self_attention.q_layernorm.weight": take(h + "self_attn.q_norm.weight"),
            p + "self_attention.k_layernorm.weight": take(h + "self_attn.k_norm.weight")}
