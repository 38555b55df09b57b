"""The dense Hugging Face families beside Llama (``hf.py`` maps their shared Llama layout), and the Llama 3
RoPE scaling any Llama-shaped family may carry.

* ``qwen2`` (Qwen2, Qwen2.5) <-> ``Qwen2ForCausalLM``: a Llama with biases on q, k and v alone
  (``add_qkv_bias`` without ``add_bias_linear``).
* ``qwen3`` <-> ``Qwen3ForCausalLM``: a Llama with an RMSNorm over ``head_dim`` on every query and key head
  before RoPE (``qk_layernorm``; ``self_attn.q_norm`` / ``k_norm``), no biases.
* ``mistral`` <-> ``MistralForCausalLM``: a Llama whose every layer may slide (v0.1's ``sliding_window``). Nothing
  else in the network tells it from Llama, so the import records ``hf_model_type='mistral'`` for the export.
* ``rope_type: llama3`` (Llama 3.1 and later): ``rope_type='llama3'`` with ``rotary_scaling_factor`` (``factor``),
  ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``; read from transformers 5's
  ``rope_parameters`` or 4.x's ``rope_scaling``, written back as both understand.

Sliding windows: HF's ``sliding_window = W`` (a query sees W keys, itself included) is megazero's
``window_size = (W - 1, 0)``; which layers slide comes from ``layer_types`` (Qwen's default: the layers from
``max_window_layers`` on, and only with ``use_sliding_window``), written as ``window_attn_skip_freq``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..config import GPTConfig

__all__ = ["DENSE_FAMILIES", "DENSE_ARCHITECTURES", "dense_family", "dense_mismatches", "dense_config_kwargs",
           "window_kwargs",
           "rope_config_kwargs", "hf_rope_scaling", "dense_hf_config_dict", "qk_norm_to_hf", "qk_norm_from_hf"]

DENSE_FAMILIES = ("qwen2", "qwen3", "mistral")
DENSE_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def dense_family(c: GPTConfig) -> str:
    """The family of a dense Llama-shaped ``c`` (``dense_mismatches`` empty): 'qwen3' (q/k norms), 'qwen2'
    (q/k/v biases alone), 'mistral' (recorded by the import, or a window in every layer) or 'llama'."""
    if c.qk_layernorm:
        return "qwen3"
    if c.add_qkv_bias and not c.add_bias_linear:
        return "qwen2"
    return "mistral" if c.hf_model_type == "mistral" or c.window_size is not None else "llama"


def _sliding(c: GPTConfig) -> list[bool]:
    return [c.layer_window(i) is not None for i in range(c.num_layers)]


def dense_mismatches(c: GPTConfig) -> list[str]:
    """What keeps a rope/rmsnorm/swiglu ``c`` from being one of Llama, Qwen2, Qwen3 or Mistral (empty: it is)."""
    out = []
    if c.qk_layernorm and (c.add_bias_linear or c.add_qkv_bias):
        out.append("qk_layernorm=True with biases (Qwen3, the family with q/k norms, has none in megazero's "
                   "layout: its attention_bias spares the MLP)")
    if c.hf_model_type == "mistral" and (c.add_bias_linear or c.add_qkv_bias or c.qk_layernorm):
        out.append("hf_model_type='mistral' with biases or q/k norms (Mistral has neither)")
    if c.softmax_type != "vanilla":
        out.append(f"softmax_type={c.softmax_type!r} (attention sinks: HF's Llama, Qwen and Mistral have none; "
                   "gpt-oss has them)")
    if c.window_size is not None and dense_family(c) == "mistral" and not all(_sliding(c)):
        out.append("a sliding window in some layers only (HF Mistral slides in every layer; Qwen2/Qwen3, whose "
                   "layer_types say which slide, need their q/k biases or norms)")
    if c.window_size is not None and dense_family(c) == "mistral" and (c.add_bias_linear or c.add_qkv_bias):
        out.append("a sliding window with biases (HF Mistral, the Llama that slides, has none)")
    return out


def window_kwargs(hf: dict[str, Any], mt: str) -> tuple[dict[str, Any], list[str]]:
    """``window_size`` and ``window_attn_skip_freq`` of an HF config's sliding window, as transformers applies
    it (Mistral: every layer; Qwen: the ``layer_types`` that slide, with ``use_sliding_window``)."""
    window = hf.get("sliding_window")
    if mt in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None  # transformers drops the window without use_sliding_window
    if window is None:
        return {}, []
    if window < 1:
        return {}, [f"sliding_window={window} (a query sees at least itself: needs >= 1)"]
    layers = hf["num_hidden_layers"]
    if mt == "mistral":
        return dict(window_size=(window - 1, 0)), []
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", layers) else
                                      "full_attention" for i in range(layers)]
    unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        return {}, [f"layer_types {unknown or types} (megazero reads sliding_attention and full_attention, one per "
                    "layer)"]
    pattern = tuple(int(t == "sliding_attention") for t in types)
    if not any(pattern):
        return {}, []
    return dict(window_size=(window - 1, 0), window_attn_skip_freq=None if all(pattern) else pattern), []


def dense_config_kwargs(hf: dict[str, Any], mt: str) -> tuple[dict[str, Any], list[str]]:
    """The GPTConfig fields of an HF Qwen2 / Qwen3 / Mistral config beyond Llama's, and what megazero cannot
    represent of it."""
    kw, problems = window_kwargs(hf, mt)
    if mt == "qwen2":
        return dict(add_qkv_bias=True, **kw), problems
    if mt == "qwen3":
        if hf.get("attention_bias", False):
            problems.append("attention_bias=True (Qwen3's biases on the attention alone do not exist in megazero)")
        head_dim = hf.get("head_dim") or 128  # Qwen3Config's default, unlike Llama's hidden / heads
        same = head_dim * hf["num_attention_heads"] == hf["hidden_size"]
        return dict(qk_layernorm=True, kv_channels=None if same else head_dim, **kw), problems
    return dict(hf_model_type="mistral", **kw), problems


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
    window = None if c.window_size is None else c.window_size[0] + 1  # HF counts the query itself
    if family == "mistral":
        kw.update(sliding_window=window)
    else:  # Qwen: layer_types say which layers slide
        sliding = _sliding(c)
        first = next((i for i, s in enumerate(sliding) if s), c.num_layers)
        kw.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=first,
                  layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
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
