"""Hugging Face Nemotron-H (``NemotronHForCausalLM``: NVIDIA's Nemotron-H, Nemotron Nano 2 and Nemotron 3 hybrids)
<-> megazero's hybrid stacks (``hybrid_layer_pattern``).

The network: pre-norm blocks, each one mixer with its own RMSNorm and residual, as the pattern says: ``M`` Mamba-2,
``*`` attention without position embeddings (``position_embedding_type='none'``, GQA, head_dim free), ``-`` a
squared-ReLU MLP, ``E`` squared-ReLU experts routed by sigmoid scores plus a correction bias that only chooses
(DeepSeek-V3's; ``moe_router_enable_expert_bias``), the chosen weights renormalised and times
``routed_scaling_factor``, group-limited when ``n_group > 1``, beside one shared expert; the final RMSNorm.

Config: the layers come from ``layers_block_type`` (transformers' ``linear_attention``, ``full_attention``, ``mlp``,
``moe``, or the older ``mamba`` and ``attention``; ``layer_types`` alike) or the Hub's ``hybrid_override_pattern``
(``M``, ``*``, ``-``, ``E``). The Mamba width is ``mamba_num_heads * mamba_head_dim``, as transformers 5 builds it:
``expand`` is not read (Nemotron 3 Nano's 64 x 64 = 4096 is not 2 x 2688), and the import checks the weights'
shapes against that width. HF's ``chunk_size`` is the scan's block length: megazero scans in blocks of 128
whatever it says, which changes rounding only; the export writes 128. One ``layer_norm_epsilon`` (else
``rms_norm_eps``) serves the block norms, the final norm and the Mamba gated norm, in transformers and in
megazero. ``residual_in_fp32`` <-> ``fp32_residual_connection``. ``use_conv_bias: false`` imports as zero
convolution biases and exports as ``true`` with them. transformers 5 never ties Nemotron-H's head (it loads
``lm_head.weight`` whatever ``tie_word_embeddings`` says): a checkpoint holding one imports untied with it; a
tied megazero model exports its embedding as ``lm_head.weight`` too. Multi-token prediction modules
(``num_nextn_predict_layers``, ``mtp.*`` weights) are left out, as transformers loads the model.

Names (HF ``backbone.layers.i.``, or ``model.layers.i.`` as transformers 5 holds them in memory; both import, the
export writes the Hub's ``backbone.``, which is what ``save_pretrained`` writes): ``norm`` <-> the block's norm
(``norm``, ``input_layernorm`` or ``pre_mlp_layernorm``); Mamba ``mixer.in_proj = [z; x; B; C; dt]`` <->
``mixer.in_proj_zx = [z; x]``, ``in_proj_bc = [B; C]``, ``in_proj_dt``; ``mixer.conv1d.weight [C, 1, K]`` <->
``mixer.conv_weight [C, K]``; ``mixer.norm.weight`` <-> ``mixer.norm_weight``; attention ``mixer.{q,k,v}_proj``
<-> ``self_attention.linear_qkv`` (rows per query group ``[queries; key; value]``), ``o_proj`` <-> ``linear_proj``;
MLP ``mixer.{up,down}_proj`` <-> ``mlp.linear_fc{1,2}``; MoE ``mixer.gate.weight`` and ``e_score_correction_bias``
<-> ``mlp.router.weight`` and ``expert_bias``, ``mixer.experts.e.{up,down}_proj.weight`` (or transformers 5's
stacked ``mixer.experts.{up,down}_proj [E, ...]``) <-> ``mlp.experts.e.linear_fc{1,2}.weight``,
``mixer.shared_experts`` <-> ``mlp.shared_experts``; ``embeddings``, ``norm_f``, ``lm_head`` <-> ``embedding``,
``final_norm``, ``output_layer``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..config import GPTConfig
from ..layer_pattern import hybrid_symbols
from .hf_common import pad_vocabulary, refuse_unused

__all__ = ["NEMOTRON_H_FAMILIES", "NEMOTRON_H_ARCHITECTURES", "nemotron_h_parts", "nemotron_h_mismatches",
           "nemotron_h_to_hf", "nemotron_h_from_hf", "nemotron_h_config_kwargs", "nemotron_h_hf_config_dict"]

NEMOTRON_H_FAMILIES = ("nemotron_h",)
NEMOTRON_H_ARCHITECTURES = {"nemotron_h": "NemotronHForCausalLM"}
log = logging.getLogger(__name__)

# HF layer type (both spellings) -> pattern symbol, and the spelling transformers 5 writes
_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
_HF_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_DEFAULT_TYPES = ["linear_attention", "moe", "full_attention", "mlp"]  # NemotronHConfig's, given none
_NORM = {"M": "norm", "*": "input_layernorm", "-": "pre_mlp_layernorm", "E": "pre_mlp_layernorm"}  # megazero's
_CHUNK = 128  # megazero's Mamba-2 scan block (MambaMixer's default)
# older config.json names NemotronHConfig still reads (and prefers, as here)
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size", "mamba_expand": "expand"}


# ---- what converts --------------------------------------------------------------------------------------


def nemotron_h_parts(c: GPTConfig) -> list[str]:
    """The settings of ``c`` that, among the HF families megazero converts, only Nemotron-H has: a hybrid pattern
    (one block per symbol) without Gated DeltaNet."""
    p = c.hybrid_layer_pattern
    return [f"hybrid_layer_pattern={p!r}"] if p is not None and "G" not in p else []


def nemotron_h_mismatches(c: GPTConfig) -> list[str]:
    """What keeps the hybrid config ``c`` from being a Nemotron-H model (empty: it is one)."""
    need = [("position_embedding_type", "none"), ("normalization", "rmsnorm"), ("activation", "squared_relu"),
            ("qk_layernorm", False), ("multi_latent_attention", False), ("softmax_type", "vanilla"),
            ("window_size", None), ("add_qkv_bias", False), ("attention_output_gate", False),
            ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None), ("moe_router_bias", False),
            ("moe_shared_expert_gate", False)]
    out = [f"{k}={getattr(c, k)!r} (Nemotron-H needs {v!r})" for k, v in need if getattr(c, k) != v]
    kinds = set(hybrid_symbols(c.hybrid_layer_pattern))
    if c.mtp_num_layers:
        out.append(f"mtp_num_layers={c.mtp_num_layers} (Nemotron-H's multi-token prediction blocks, "
                   "mtp_layers_block_type, are not megazero's attention-and-MLP depth: set mtp_num_layers=0 to "
                   "export the model without them)")
    if c.add_bias_linear and kinds & {"*", "E"}:
        out.append("add_bias_linear=True (transformers' Nemotron-H attention and experts have no biases: a "
                   "biased model converts with Mamba and MLP layers only)")
    if "E" in kinds:
        out += _moe_mismatches(c)
    return out


def _moe_mismatches(c: GPTConfig) -> list[str]:
    out = []
    if c.moe_router_score_function != "sigmoid" or c.moe_router_pre_softmax:
        out.append(f"moe_router_score_function={c.moe_router_score_function!r}, moe_router_pre_softmax="
                   f"{c.moe_router_pre_softmax} (Nemotron-H routes by sigmoid scores: needs 'sigmoid', False)")
    if not c.moe_shared_expert_intermediate_size:
        out.append("moe_shared_expert_intermediate_size=None (every Nemotron-H mixture has a shared expert)")
    g, gk, k = c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk
    if g and (c.num_experts % g or c.num_experts // g < 2):
        out.append(f"moe_router_num_groups={g} with {c.num_experts} experts (HF scores a group by its 2 best "
                   "experts: groups of at least 2, dividing the experts)")
    if g and gk < g and k != 2 * gk:
        out.append(f"moe_router_topk={k} with moe_router_group_topk={gk} (HF scores a group by its 2 best experts, "
                   f"megazero by its topk / group_topk best: needs moe_router_topk = 2 x moe_router_group_topk)")
    return out


# ---- weights ----------------------------------------------------------------------------------------------


def _biases(c: GPTConfig) -> tuple[str, ...]:
    return ("weight", "bias") if c.add_bias_linear else ("weight",)


def _renames(c: GPTConfig, kind: str) -> list[tuple[str, str]]:
    """(megazero, HF) names of layer tensors of ``kind`` (a pattern symbol) that map one to one, without the
    layer prefixes; the block's norm first."""
    out = [(_NORM[kind] + ".weight", "norm.weight")]
    if kind == "M":
        out += [("mixer." + n, "mixer." + n) for n in ("A_log", "D", "dt_bias")]
        out.append(("mixer.norm_weight", "mixer.norm.weight"))
        out += [(f"mixer.out_proj.{s}", f"mixer.out_proj.{s}") for s in _biases(c)]
    elif kind == "*":
        out.append(("self_attention.linear_proj.weight", "mixer.o_proj.weight"))
    elif kind == "-":
        out += [(f"mlp.linear_fc{j}.{s}", f"mixer.{n}.{s}") for j, n in ((1, "up_proj"), (2, "down_proj"))
                for s in _biases(c)]
    else:
        out.append(("mlp.router.weight", "mixer.gate.weight"))
        out += [(f"mlp.shared_experts.linear_fc{j}.weight", f"mixer.shared_experts.{n}.weight")
                for j, n in ((1, "up_proj"), (2, "down_proj"))]
    return out


def _qkv_rows(c: GPTConfig) -> tuple[int, int, int]:
    return c.query_groups, c.num_attention_heads // c.query_groups, c.head_dim


def _split_qkv(t: torch.Tensor, c: GPTConfig) -> list[torch.Tensor]:
    """Our per-group ``[q_g; k_g; v_g]`` rows -> q, k, v."""
    g, per, d = _qkv_rows(c)
    t = t.reshape(g, per + 2, d, -1)
    return [t[:, :per].reshape(g * per * d, -1), t[:, per].reshape(g * d, -1), t[:, per + 1].reshape(g * d, -1)]


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    g, per, d = _qkv_rows(c)
    return torch.cat([q.reshape(g, per, d, -1), k.reshape(g, 1, d, -1), v.reshape(g, 1, d, -1)], dim=1).reshape(
        g * (per + 2) * d, -1)


def _shift(t: torch.Tensor, c: GPTConfig, delta: float) -> torch.Tensor:
    """apply_layernorm_1p keeps gamma - 1 in the block and final norms (not the Mamba gated norm)."""
    return t + delta if c.apply_layernorm_1p else t


def _layer_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, i: int, kind: str) -> dict[str, torch.Tensor]:
    p, h = f"layers.{i}.", f"backbone.layers.{i}."
    out = {h + hf: sd[p + mz] for mz, hf in _renames(c, kind)}
    out[h + "norm.weight"] = _shift(out[h + "norm.weight"], c, 1.0)
    m, q = h + "mixer.", p + "mixer."
    if kind == "M":
        for s in _biases(c):
            out[f"{m}in_proj.{s}"] = torch.cat([sd[f"{q}in_proj_{n}.{s}"] for n in ("zx", "bc", "dt")])
        out[m + "conv1d.weight"], out[m + "conv1d.bias"] = sd[q + "conv_weight"].unsqueeze(1), sd[q + "conv_bias"]
    elif kind == "*":
        for n, t in zip("qkv", _split_qkv(sd[p + "self_attention.linear_qkv.weight"], c)):
            out[f"{m}{n}_proj.weight"] = t
    elif kind == "E":
        bias = p + "mlp.router.expert_bias"
        if c.moe_router_enable_expert_bias and bias not in sd:
            raise KeyError(f"{bias} (the router's expert bias: moe_router_enable_expert_bias is on) is not among the "
                           "checkpoint's tensors; the export needs the model's persistent buffers with its parameters")
        # HF's router always has one: none is zeros (fp32, as transformers keeps it)
        out[m + "gate.e_score_correction_bias"] = sd[bias] if c.moe_router_enable_expert_bias else \
            torch.zeros(c.num_experts, dtype=torch.float32)
        for e in range(c.num_experts):
            out[f"{m}experts.{e}.up_proj.weight"] = sd[f"{p}mlp.experts.{e}.linear_fc1.weight"]
            out[f"{m}experts.{e}.down_proj.weight"] = sd[f"{p}mlp.experts.{e}.linear_fc2.weight"]
    return out


def nemotron_h_to_hf(full_sd: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """Full megazero state dict -> the Hub's Nemotron-H state dict (``backbone.`` names, one tensor per expert)."""
    out: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(hybrid_symbols(c.hybrid_layer_pattern)):
        out.update(_layer_to_hf(full_sd, c, i, kind))
    out["backbone.embeddings.weight"] = full_sd["embedding.weight"][:c.vocab_size]
    out["backbone.norm_f.weight"] = _shift(full_sd["final_norm.weight"], c, 1.0)
    head = full_sd["embedding.weight" if c.tie_embeddings else "output_layer.weight"][:c.vocab_size]
    out["lm_head.weight"] = head.clone() if c.tie_embeddings else head  # safetensors refuses shared memory
    return {k: v.contiguous() for k, v in out.items()}


def _check_mamba(in_proj: torch.Tensor, conv: torch.Tensor, c: GPTConfig, name: str) -> None:
    """The Mamba width the config implies against the checkpoint's (the trap: ``expand * hidden_size``)."""
    heads, gn = c.mamba_heads, c.mamba_num_groups * c.mamba_state_dim
    d = heads * c.mamba_head_dim
    if in_proj.shape[0] != 2 * d + 2 * gn + heads or conv.shape[0] != d + 2 * gn:
        found = conv.shape[0] - 2 * gn
        raise ValueError(
            f"{name}: in_proj has {in_proj.shape[0]} rows and conv1d {conv.shape[0]} channels, but mamba_num_heads "
            f"{heads} x mamba_head_dim {c.mamba_head_dim} = {d} wide with n_groups {c.mamba_num_groups} x "
            f"ssm_state_size {c.mamba_state_dim} needs {2 * d + 2 * gn + heads} and {d + 2 * gn}: the weights are "
            f"{found} wide (channels - 2 n_groups ssm_state_size); fix mamba_num_heads and mamba_head_dim in "
            "config.json to give that width (transformers builds mamba_num_heads * mamba_head_dim, not expand * "
            "hidden_size)")


def _layer_from_hf(take: Callable[[str], torch.Tensor], has: Callable[[str], bool], c: GPTConfig, h: str, i: int,
                   kind: str) -> dict[str, torch.Tensor]:
    p, m, q = f"layers.{i}.", h + "mixer.", f"layers.{i}.mixer."
    out = {p + mz: take(h + hf) for mz, hf in _renames(c, kind)}
    out[p + _NORM[kind] + ".weight"] = _shift(out[p + _NORM[kind] + ".weight"], c, -1.0)
    if kind == "M":
        in_proj, conv = take(m + "in_proj.weight"), take(m + "conv1d.weight")
        _check_mamba(in_proj, conv, c, f"{h}mixer")
        d, gn = c.mamba_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
        for s in _biases(c):
            t = in_proj if s == "weight" else take(m + "in_proj.bias")
            out[f"{q}in_proj_zx.{s}"], out[f"{q}in_proj_bc.{s}"], out[f"{q}in_proj_dt.{s}"] = t.split(
                [2 * d, 2 * gn, c.mamba_heads])
        out[q + "conv_weight"] = conv.squeeze(1)  # use_conv_bias false: no bias is zeros
        out[q + "conv_bias"] = take(m + "conv1d.bias") if has(m + "conv1d.bias") else conv.new_zeros(conv.shape[0])
    elif kind == "*":
        out[p + "self_attention.linear_qkv.weight"] = _merge_qkv(*(take(f"{m}{n}_proj.weight") for n in "qkv"), c)
    elif kind == "E":
        out[p + "mlp.router.expert_bias"] = take(m + "gate.e_score_correction_bias")
        stacked = has(m + "experts.up_proj")  # transformers 5's in-memory layout
        ups = take(m + "experts.up_proj") if stacked else None
        downs = take(m + "experts.down_proj") if stacked else None
        for e in range(c.num_experts):
            x = f"{p}mlp.experts.{e}."
            out[x + "linear_fc1.weight"] = ups[e] if stacked else take(f"{m}experts.{e}.up_proj.weight")
            out[x + "linear_fc2.weight"] = downs[e] if stacked else take(f"{m}experts.{e}.down_proj.weight")
    return out


def nemotron_h_from_hf(hf_sd: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """An HF Nemotron-H state dict (``backbone.`` or ``model.`` names) -> full megazero state dict for ``c``; strict
    about keys, the multi-token prediction modules (``mtp.*``) left out as transformers leaves them."""
    sd = {k: v for k, v in hf_sd.items() if not k.startswith("mtp.")}
    base = "model." if "model.embeddings.weight" in sd else "backbone."
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"HF checkpoint lacks {key!r} (needed for a Nemotron-H model with pattern "
                           f"{c.hybrid_layer_pattern!r})")
        used.add(key)
        return sd[key]

    out: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(hybrid_symbols(c.hybrid_layer_pattern)):
        out.update(_layer_from_hf(take, sd.__contains__, c, f"{base}layers.{i}.", i, kind))
    out["embedding.weight"] = pad_vocabulary(take(base + "embeddings.weight"), c)
    out["final_norm.weight"] = _shift(take(base + "norm_f.weight"), c, -1.0)
    if c.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the tied copy, if the checkpoint stores it
    else:
        out["output_layer.weight"] = pad_vocabulary(take("lm_head.weight"), c)
    refuse_unused(set(sd) - used, "Nemotron-H")
    return {k: v.contiguous() for k, v in out.items()}


# ---- configs ------------------------------------------------------------------------------------------


def _pattern(hf: dict[str, Any], problems: list[str]) -> str:
    """The layers of an HF config as a megazero pattern."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None and hf.get("hybrid_override_pattern") is not None:
        pattern = hf["hybrid_override_pattern"]
        if "/" in pattern:
            problems.append(f"hybrid_override_pattern={pattern!r} has a '/' (Megatron's multi-token prediction "
                            "depths after the stack; transformers' Nemotron-H takes them as num_nextn_predict_layers"
                            " and mtp_layers_block_type): keep the part before the first '/' and megazero imports the"
                            " model without them, as transformers loads it")
        unknown = sorted(set(pattern) - set(_HF_TYPE) - {"/"})
        if unknown:
            problems.append(f"hybrid_override_pattern symbols {unknown} (Nemotron-H's are M, *, -, E)")
        return "".join(s for s in pattern.split("/")[0] if s in _HF_TYPE)
    types = types or _DEFAULT_TYPES
    unknown = sorted(set(types) - set(_SYMBOL))
    if unknown:
        problems.append(f"layers_block_type values {unknown} (Nemotron-H's are {', '.join(_SYMBOL)})")
    return "".join(_SYMBOL.get(t, "") for t in types)


def _number(v: Any) -> float:
    """A float as config.json holds it (transformers 5 writes infinity as ``{"__float__": "Infinity"}``)."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def _mismatch_problems(hf: dict[str, Any], kinds: set[str]) -> list[str]:
    """What in an HF Nemotron-H config megazero cannot represent, and the fix."""
    problems = []
    for key, want, why in (
            ("mamba_hidden_act", "silu", "Mamba-2's activation"), ("mlp_hidden_act", "relu2", "squared ReLU"),
            ("sliding_window", None, "transformers' Nemotron-H attends to every earlier token"),
            ("moe_latent_size", None, "megazero's experts have no latent projections"),
            ("quantization_config", None, "dequantise the checkpoint first")):
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]!r} (megazero's Nemotron-H needs {want!r}: {why})")
    limit = [_number(v) for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        problems.append(f"time_step_limit={limit} (megazero does not clamp the Mamba step: needs [0, inf])")
    use_bias, mlp_bias = bool(hf.get("use_bias", False)), bool(hf.get("mlp_bias", False))
    if "M" in kinds and kinds & {"-", "E"} and use_bias != mlp_bias:
        problems.append(f"use_bias={use_bias} with mlp_bias={mlp_bias} (megazero has one add_bias_linear)")
    if (use_bias and "M" in kinds or mlp_bias and kinds & {"-", "E"}) and kinds & {"*", "E"}:
        problems.append("use_bias/mlp_bias true beside attention or expert layers (transformers' Nemotron-H "
                        "attention and experts have no biases, and megazero has one add_bias_linear)")
    if hf.get("attention_bias") and "*" in kinds:
        problems.append("attention_bias=True (transformers' Nemotron-H attention builds no biases)")
    heads, groups = hf.get("mamba_num_heads", 128), hf.get("n_groups", 8)
    if "M" in kinds and heads % groups:
        problems.append(f"mamba_num_heads={heads} with n_groups={groups} (the groups must divide the heads)")
    return problems


def _routing_kwargs(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """GPTConfig's mixture fields of an HF Nemotron-H config (DeepSeek-V3's sigmoid router, non-gated experts)."""
    n, k = hf.get("n_routed_experts", 8), hf.get("num_experts_per_tok", 2)
    g, gk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if g > 1 and (n % g or n // g < 2):
        problems.append(f"n_group={g} with {n} experts (groups of at least 2 experts, dividing them)")
    if g > 1 and gk < g and k != 2 * gk:
        problems.append(f"num_experts_per_tok={k} with topk_group={gk} (HF scores a group by its 2 best experts, "
                        "megazero by its num_experts_per_tok/topk_group best: representable when num_experts_per_tok"
                        " = 2 x topk_group)")
    norm = hf.get("norm_topk_prob", True)
    if bool(norm) != (k > 1):
        problems.append(f"norm_topk_prob={norm} with num_experts_per_tok={k} (megazero renormalises the sigmoid "
                        "weights exactly when more than one expert is chosen)")
    kw = dict(num_experts=n, moe_router_topk=k, moe_ffn_hidden_size=hf.get("moe_intermediate_size", 7688),
              moe_shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size", 7688),
              moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
              moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    if g > 1 and gk < g:
        kw.update(moe_router_num_groups=g, moe_router_group_topk=gk)
    return kw


def nemotron_h_config_kwargs(hf: dict[str, Any], weight_names=None) -> dict[str, Any]:
    """GPTConfig fields of an HF Nemotron-H ``config.json`` dict; ``weight_names``: the checkpoint's tensor names
    (a ``lm_head.weight`` among them keeps the head untied, as transformers runs it; None trusts the config).
    ValueError naming each value megazero cannot represent, and the fix."""
    hf = {**hf, **{new: hf[old] for old, new in _LEGACY.items() if old in hf}}
    problems: list[str] = []
    pattern = _pattern(hf, problems)
    kinds = set(pattern)
    problems += _mismatch_problems(hf, kinds)
    kw = _routing_kwargs(hf, problems) if "E" in kinds else {}
    if problems:
        raise ValueError("HF nemotron_h config not representable in megazero: " + "; ".join(problems))
    if hf.get("num_nextn_predict_layers") or any(n.startswith("mtp.") for n in weight_names or ()):
        log.warning("the checkpoint's multi-token prediction modules (mtp.*) are left out, as transformers leaves "
                    "them; megazero's MTP depth is another block")
    hidden, heads = hf["hidden_size"], hf.get("num_attention_heads", 32)
    head_dim = hf.get("head_dim") or hf.get("attention_head_dim") or 128  # NemotronHConfig's default
    tied = bool(hf.get("tie_word_embeddings", False)) and (weight_names is None or "lm_head.weight" not in weight_names)
    max_pos = hf.get("max_position_embeddings", 4096)
    eps = hf.get("layer_norm_epsilon", hf.get("rms_norm_eps", 1e-5))
    return dict(num_layers=len(pattern), hybrid_layer_pattern=pattern, hidden_size=hidden,
                num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
                kv_channels=None if head_dim * heads == hidden else head_dim, vocab_size=hf["vocab_size"],
                ffn_hidden_size=hf.get("intermediate_size", 21504), mamba_num_heads=hf.get("mamba_num_heads", 128),
                mamba_head_dim=hf.get("mamba_head_dim", 64), mamba_state_dim=hf.get("ssm_state_size", 128),
                mamba_num_groups=hf.get("n_groups", 8), linear_conv_kernel_dim=hf.get("conv_kernel", 4),
                max_position_embeddings=max_pos, seq_length=max_pos, position_embedding_type="none",
                normalization="rmsnorm", activation="squared_relu",
                add_bias_linear=bool(hf.get("use_bias" if "M" in kinds else "mlp_bias", False)),
                tie_embeddings=tied, hidden_dropout=float(hf.get("hidden_dropout", 0.0)),
                attention_dropout=float(hf.get("attention_dropout", 0.0)), layernorm_epsilon=float(eps),
                init_method_std=hf.get("initializer_range", 0.02),
                fp32_residual_connection=bool(hf.get("residual_in_fp32", False)), **kw)


def nemotron_h_hf_config_dict(c: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformers.NemotronHConfig`` for ``c``."""
    symbols = hybrid_symbols(c.hybrid_layer_pattern)
    d = c.mamba_heads * c.mamba_head_dim
    kw = dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=c.vocab_size,
              hidden_size=c.hidden_size, layers_block_type=[_HF_TYPE[s] for s in symbols],
              tie_word_embeddings=c.tie_embeddings, num_attention_heads=c.num_attention_heads,
              num_key_value_heads=c.query_groups, head_dim=c.head_dim,
              max_position_embeddings=c.max_position_embeddings, attention_bias=False,
              attention_dropout=c.attention_dropout, intermediate_size=c.ffn_size, mlp_hidden_act="relu2",
              mlp_bias=c.add_bias_linear, use_bias=c.add_bias_linear, ssm_state_size=c.mamba_state_dim,
              mamba_num_heads=c.mamba_heads, mamba_head_dim=c.mamba_head_dim, mamba_hidden_act="silu",
              n_groups=c.mamba_num_groups, conv_kernel=c.linear_conv_kernel_dim,
              # not read by transformers 5 (the width is heads x head_dim); right for readers that take it
              expand=d // c.hidden_size if d % c.hidden_size == 0 else 2,
              use_conv_bias=True, chunk_size=_CHUNK, layer_norm_epsilon=c.layernorm_epsilon,
              residual_in_fp32=c.fp32_residual_connection, hidden_dropout=c.hidden_dropout,
              initializer_range=c.init_method_std, num_nextn_predict_layers=0)
    if "E" in symbols:
        g, gk = c.moe_router_num_groups, c.moe_router_group_topk
        kw.update(n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                  moe_intermediate_size=c.moe_ffn_size, n_shared_experts=1,
                  moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
                  routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0, n_group=g or 1,
                  topk_group=gk if g else 1, norm_topk_prob=c.moe_router_topk > 1)
    return kw
