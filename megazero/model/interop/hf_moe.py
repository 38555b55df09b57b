"""Hugging Face mixture-of-experts families <-> megazero: Mixtral, Qwen2-MoE and Qwen3-MoE.

All three are Llama-shaped (RoPE, RMSNorm, SwiGLU, GQA) with every layer's MLP a mixture
(hf.py maps the rest). The names are those on disk, one tensor per expert, as the Hub's checkpoints
and ``save_pretrained`` store them:

* Mixtral: ``model.layers.i.block_sparse_moe.gate.weight`` (router ``[E, h]``) and
  ``...block_sparse_moe.experts.e.{w1, w3, w2}.weight`` (gate, up, down).
* Qwen3-MoE: ``model.layers.i.mlp.gate.weight`` and ``...mlp.experts.e.{gate,up,down}_proj.weight``,
  plus the query/key norms ``self_attn.{q,k}_norm.weight``.
* Qwen2-MoE: Qwen3-MoE's expert names, a shared expert ``...mlp.shared_expert.{gate,up,down}_proj`` and
  its gate ``...mlp.shared_expert_gate.weight`` (``[1, h]``), biases on q/k/v (hf.py maps those).

megazero's expert ``e`` keeps ``linear_fc1 = [gate; up]`` and ``linear_fc2 = down`` under
``layers.i.mlp.experts.e``, its router ``layers.i.mlp.router.weight``. Routing: Mixtral and Qwen3-MoE
with ``norm_topk_prob`` take the softmax over all experts, the top k, renormalised: the softmax over
the k chosen logits (megazero's default); Qwen3-MoE without it keeps the full softmax's values
(``moe_router_pre_softmax``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import GPTConfig

__all__ = ["MOE_FAMILIES", "MOE_ARCHITECTURES", "moe_mismatches", "moe_family", "moe_layer_to_hf", "moe_layer_from_hf",
           "moe_config_kwargs", "moe_hf_config_dict"]

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}


def moe_family(c: GPTConfig) -> str:
    """'qwen2_moe' (a shared expert), 'qwen3_moe' (query/key norms) or 'mixtral'."""
    if c.moe_shared_expert_intermediate_size:
        return "qwen2_moe"
    return "qwen3_moe" if c.qk_layernorm else "mixtral"


def moe_mismatches(c: GPTConfig) -> list[str]:
    """What keeps ``c`` from being a Mixtral, Qwen2-MoE or Qwen3-MoE model (empty: it is one)."""
    out = []
    if c.moe_layer_freq != 1:
        out.append(f"moe_layer_freq={c.moe_layer_freq} (every layer is a mixture in Mixtral/Qwen-MoE: needs 1)")
    if moe_family(c) == "mixtral" and c.moe_router_pre_softmax:
        out.append("moe_router_pre_softmax=True (Mixtral renormalises its top k; Qwen3-MoE, with q/k norms, can not)")
    if moe_family(c) == "mixtral" and c.moe_ffn_size != c.ffn_size:
        out.append(f"moe_ffn_hidden_size={c.moe_ffn_size} != ffn_hidden_size={c.ffn_size} (Mixtral has one)")
    if moe_family(c) == "qwen2_moe":
        if not c.moe_shared_expert_gate:
            out.append("a shared expert without its gate (Qwen2-MoE's shared expert is gated)")
        if c.qk_layernorm:
            out.append("qk_layernorm=True with a shared expert (Qwen2-MoE has no q/k norms)")
    elif c.add_qkv_bias:
        out.append("add_qkv_bias=True (Mixtral and Qwen3-MoE have no QKV biases)")
    return out


def _expert_names(family: str, i: int, e: int) -> tuple[str, str, str]:
    if family == "mixtral":
        p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{i}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _shared_names(i: int) -> tuple[str, str, str, str]:
    p = f"model.layers.{i}.mlp.shared_expert"
    return p + ".gate_proj.weight", p + ".up_proj.weight", p + ".down_proj.weight", p + "_gate.weight"


def _router_name(family: str, i: int) -> str:
    return f"model.layers.{i}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.gate.weight"


def moe_layer_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s router, experts (and q/k norms) of a full megazero state dict, by HF name."""
    family, p = moe_family(c), f"layers.{i}."
    out = {_router_name(family, i): sd[p + "mlp.router.weight"]}
    for e in range(c.num_experts):
        gate, up, down = _expert_names(family, i, e)
        out[gate], out[up] = sd[f"{p}mlp.experts.{e}.linear_fc1.weight"].chunk(2, dim=0)
        out[down] = sd[f"{p}mlp.experts.{e}.linear_fc2.weight"]
    if family == "qwen3_moe":
        out[f"model.layers.{i}.self_attn.q_norm.weight"] = sd[p + "self_attention.q_layernorm.weight"]
        out[f"model.layers.{i}.self_attn.k_norm.weight"] = sd[p + "self_attention.k_layernorm.weight"]
    if family == "qwen2_moe":
        gate, up, down, shared_gate = _shared_names(i)
        out[gate], out[up] = sd[p + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        out[down] = sd[p + "mlp.shared_experts.linear_fc2.weight"]
        out[shared_gate] = sd[p + "mlp.shared_gate.weight"]
    return out


def moe_layer_from_hf(take: Callable[[str], torch.Tensor], c: GPTConfig, i: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`moe_layer_to_hf`: megazero names of layer ``i``'s mixture, from HF's."""
    family, p = moe_family(c), f"layers.{i}."
    out = {p + "mlp.router.weight": take(_router_name(family, i))}
    for e in range(c.num_experts):
        gate, up, down = (take(n) for n in _expert_names(family, i, e))
        out[f"{p}mlp.experts.{e}.linear_fc1.weight"] = torch.cat([gate, up])
        out[f"{p}mlp.experts.{e}.linear_fc2.weight"] = down
    if family == "qwen3_moe":
        out[p + "self_attention.q_layernorm.weight"] = take(f"model.layers.{i}.self_attn.q_norm.weight")
        out[p + "self_attention.k_layernorm.weight"] = take(f"model.layers.{i}.self_attn.k_norm.weight")
    if family == "qwen2_moe":
        gate, up, down, shared_gate = (take(n) for n in _shared_names(i))
        out[p + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up])
        out[p + "mlp.shared_experts.linear_fc2.weight"] = down
        out[p + "mlp.shared_gate.weight"] = shared_gate
    return out


def moe_config_kwargs(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The GPTConfig fields of an HF Mixtral / Qwen2-MoE / Qwen3-MoE config beyond Llama's, and what megazero
    cannot represent of it."""
    problems = []
    if hf["model_type"] == "mixtral":
        kw = dict(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                  moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0))
        if hf.get("sliding_window"):
            problems.append(f"sliding_window={hf['sliding_window']} (megazero's attention is full causal)")
        return kw, problems
    kw = dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")), moe_router_topk=hf["num_experts_per_tok"],
              moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0),
              moe_router_pre_softmax=not hf.get("norm_topk_prob", False))
    if hf["model_type"] == "qwen3_moe":
        kw["qk_layernorm"] = True
    else:  # qwen2_moe: a gated shared expert, QKV biases
        kw.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"], moe_shared_expert_gate=True,
                  add_qkv_bias=hf.get("qkv_bias", True))
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        problems.append("dense layers among the mixtures (decoder_sparse_step != 1 or mlp_only_layers): megazero "
                        "makes layer i a mixture when i % moe_layer_freq == 0")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=True (megazero's attention is full causal)")
    return kw, problems


def moe_hf_config_dict(c: GPTConfig, llama: dict[str, Any]) -> dict[str, Any]:
    """The HF config keywords of a Mixtral / Qwen2-MoE / Qwen3-MoE model: Llama's (``llama``) and the mixture's."""
    family = moe_family(c)
    kw = {k: v for k, v in llama.items() if k not in ("mlp_bias", "model_type", "architectures")}
    kw.update(model_type=family, architectures=[MOE_ARCHITECTURES[family]], num_experts_per_tok=c.moe_router_topk,
              router_aux_loss_coef=c.moe_aux_loss_coeff, output_router_logits=False)
    if family == "mixtral":
        kw.update(num_local_experts=c.num_experts, sliding_window=None)
    elif family == "qwen2_moe":
        kw.pop("head_dim", None)
        kw.update(num_experts=c.num_experts, moe_intermediate_size=c.moe_ffn_size, norm_topk_prob=not c.moe_router_pre_softmax,
                  shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size, qkv_bias=c.add_qkv_bias,
                  decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    else:
        kw.update(num_experts=c.num_experts, moe_intermediate_size=c.moe_ffn_size, norm_topk_prob=not c.moe_router_pre_softmax,
                  decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    return kw
