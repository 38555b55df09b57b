"""Hugging Face Kimi Linear (``KimiLinearForCausalLM``, model_type ``kimi_linear``) <-> megazero: Kimi Delta Attention
layers among multi-latent attention layers without RoPE, dense MLPs first, then mixtures of experts.

The network: ``layer_types`` says which layers are KDA (``linear_attention``) and which multi-latent attention
(``full_attention``): megazero's ``experimental_attention_variant='kda'`` with ``linear_attention_freq`` (the int N
where every N-th layer is attention, else one 1/0 per layer). KDA's heads all have ``linear_head_dim`` channels,
keys and values; its decay (``f_a_proj`` -> ``f_b_proj``) and output gate (``g_a_proj`` -> ``g_b_proj``) go through
a rank of ``linear_head_dim`` (``kda_f_lora_rank``, ``kda_gate_lora_rank``). The attention is DeepSeek's
multi-latent attention with its RoPE parts never rotated (NoPE: ``position_embedding_type='none'``), its latent
norms at eps 1e-6. ``mlp_layer_types`` says which MLPs are dense and which mixtures (``moe_layer_freq``): DeepSeek-V3's
routing (sigmoid scores, an expert bias, the top k renormalised and scaled, group-limited routing where
``num_experts_per_tok = 2 x topk_group``) and shared experts.

Names: the export writes the Hub's layout, which transformers' ``save_pretrained`` writes and its
``from_pretrained`` reads: a KDA layer's ``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d`` (``[C, 1, K]`` each;
megazero's one ``conv1d_weight`` over ``[q; k; v]``), ``f_a_proj``, ``f_b_proj``, ``A_log`` (``[1, 1, H, 1]``),
``dt_bias``, ``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj``; megazero's ``in_proj_qk = [q; k]``,
``in_proj_v``, ``in_proj_b``, ``norm_weight``, ``out_proj``. The attention's names are DeepSeek-V3's
(``hf_deepseek.py``). A dense MLP is ``mlp.{gate,up,down}_proj``; a mixture ``block_sparse_moe.gate.weight``,
``gate.e_score_correction_bias``, ``experts.e.w1`` (gate) / ``w3`` (up) / ``w2`` (down) and ``shared_experts``.
The import also reads transformers' in-memory names (``self_attn.forget_gate.*``, one fused ``conv1d``,
``mlp.experts.gate_up_proj`` / ``down_proj`` stacked over the experts, mixtures under ``mlp.``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import GPTConfig
from .hf_common import pad_vocabulary, refuse_unused

__all__ = ["KIMI_LINEAR_FAMILIES", "KIMI_LINEAR_ARCHITECTURES", "kimi_linear_parts", "kimi_linear_mismatches",
           "kimi_linear_to_hf", "kimi_linear_from_hf", "kimi_linear_config_kwargs", "kimi_linear_hf_config_dict",
           "kimi_linear_build_config"]

KIMI_LINEAR_FAMILIES = ("kimi_linear",)
KIMI_LINEAR_ARCHITECTURES = {"kimi_linear": "KimiLinearForCausalLM"}
_LATENT_EPS = 1e-6  # KimiLinearRMSNorm's default, which its latent norms keep
_MLA = [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
        ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]
_KDA_SAME = ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj")  # the same names on both sides


# ---- what converts ------------------------------------------------------------------------------------


def kimi_linear_parts(c: GPTConfig) -> list[str]:
    """The settings of ``c`` that, among the HF families megazero converts, only Kimi Linear has."""
    return ["Kimi Delta Attention layers"] if any(c.layer_kinds(i).mixer == "kda" for i in range(c.num_layers)) else []


def kimi_linear_mismatches(c: GPTConfig) -> list[str]:
    """What keeps ``c`` from being a Kimi Linear model (empty: it is one)."""
    need = [("normalization", "rmsnorm"), ("activation", "swiglu"), ("add_bias_linear", False), ("add_qkv_bias", False),
            ("qk_layernorm", False), ("apply_layernorm_1p", False), ("attention_output_gate", False),
            ("multi_latent_attention", True), ("position_embedding_type", "none"), ("softmax_type", "vanilla"),
            ("window_size", None), ("hybrid_layer_pattern", None), ("mtp_num_layers", 0),
            ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)]
    out = [f"{k}={getattr(c, k)!r} (Kimi Linear needs {v!r})" for k, v in need if getattr(c, k) != v]
    d = c.linear_key_head_dim
    for name, want in (("linear_value_head_dim", d), ("kda_f_lora_rank", d), ("kda_gate_lora_rank", d)):
        if getattr(c, name) != want:
            out.append(f"{name}={getattr(c, name)} (Kimi Linear's KDA has linear_head_dim everywhere: needs {want})")
    if c.multi_latent_attention and c.latent_norm_epsilon != _LATENT_EPS:
        out.append(f"the latent norms' epsilon {c.latent_norm_epsilon} (Kimi Linear's keep {_LATENT_EPS}: set "
                   f"latent_layernorm_epsilon={_LATENT_EPS})")
    if c.num_experts:
        need = [("moe_router_score_function", "sigmoid"), ("moe_shared_expert_gate", False)]
        out += [f"{k}={getattr(c, k)!r} (Kimi Linear needs {v!r})" for k, v in need if getattr(c, k) != v]
        shared = c.moe_shared_expert_intermediate_size
        if not shared or shared % c.moe_ffn_size:
            out.append(f"moe_shared_expert_intermediate_size={shared} (Kimi Linear's shared experts are "
                       f"num_shared_experts x moe_ffn_hidden_size={c.moe_ffn_size} wide)")
        k, g, gk = c.moe_router_topk, c.moe_router_num_groups, c.moe_router_group_topk
        if g and gk < g and k != 2 * gk:
            out.append(f"moe_router_topk={k} with moe_router_group_topk={gk} (HF scores a group by its 2 best "
                       "experts: needs moe_router_topk = 2 x moe_router_group_topk)")
    return out


# ---- weights ------------------------------------------------------------------------------------------


def _mlp_hf(c: GPTConfig, i: int) -> str:
    return "block_sparse_moe." if c.is_moe_layer(i) else "mlp."


def _kda_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, p: str, h: str) -> dict[str, torch.Tensor]:
    q, k = sd[p + "in_proj_qk.weight"].chunk(2)
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    conv = sd[p + "conv1d_weight"].unsqueeze(1)
    out = {h + "q_proj.weight": q, h + "k_proj.weight": k, h + "v_proj.weight": sd[p + "in_proj_v.weight"],
           h + "b_proj.weight": sd[p + "in_proj_b.weight"], h + "q_conv1d.weight": conv[:key_dim],
           h + "k_conv1d.weight": conv[key_dim:2 * key_dim], h + "v_conv1d.weight": conv[2 * key_dim:],
           h + "A_log": sd[p + "A_log"].view(1, 1, -1, 1), h + "dt_bias": sd[p + "dt_bias"],
           h + "o_norm.weight": sd[p + "norm_weight"], h + "o_proj.weight": sd[p + "out_proj.weight"]}
    out.update({f"{h}{name}.weight": sd[f"{p}{name}.weight"] for name in _KDA_SAME})
    return out


def _kda_from_hf(take: Callable[..., torch.Tensor], has: Callable[[str], bool], p: str, h: str
                 ) -> dict[str, torch.Tensor]:
    if has(h + "conv1d.weight"):  # transformers' in-memory form: one convolution over [q; k; v]
        conv = take(h + "conv1d.weight")
    else:
        conv = torch.cat([take(f"{h}{x}_conv1d.weight") for x in "qkv"])
    out = {p + "in_proj_qk.weight": torch.cat([take(h + "q_proj.weight"), take(h + "k_proj.weight")]),
           p + "in_proj_v.weight": take(h + "v_proj.weight"), p + "in_proj_b.weight": take(h + "b_proj.weight"),
           p + "conv1d_weight": conv.squeeze(1), p + "A_log": take(h + "A_log", h + "forget_gate.A_log").reshape(-1),
           p + "dt_bias": take(h + "dt_bias", h + "forget_gate.dt_bias"), p + "norm_weight": take(h + "o_norm.weight"),
           p + "out_proj.weight": take(h + "o_proj.weight")}
    for name in _KDA_SAME:
        alt = (h + "forget_gate." + name + ".weight",) if name.startswith("f_") else ()
        out[f"{p}{name}.weight"] = take(f"{h}{name}.weight", *alt)
    return out


def _mla_names(c: GPTConfig) -> list[tuple[str, str]]:
    q = ([("linear_q_proj", "q_proj")] if c.q_lora_rank is None else
         [("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj")])
    return [(mz + ".weight", hf + ".weight") for mz, hf in q + _MLA]


def _mlp_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig, i: int) -> dict[str, torch.Tensor]:
    p, h = f"layers.{i}.mlp.", f"model.layers.{i}.{_mlp_hf(c, i)}"

    def glu(src: str, dst: str, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
        gate, up = sd[p + src + "linear_fc1.weight"].chunk(2)
        return {f"{h}{dst}{names[0]}.weight": gate, f"{h}{dst}{names[1]}.weight": up,
                f"{h}{dst}{names[2]}.weight": sd[p + src + "linear_fc2.weight"]}

    if not c.is_moe_layer(i):
        return glu("", "")
    bias = sd[p + "router.expert_bias"] if c.moe_router_enable_expert_bias else torch.zeros(c.num_experts)
    out = {h + "gate.weight": sd[p + "router.weight"], h + "gate.e_score_correction_bias": bias,
           **glu("shared_experts.", "shared_experts.")}
    for e in range(c.num_experts):
        out.update(glu(f"experts.{e}.", f"experts.{e}.", ("w1", "w3", "w2")))
    return out


def _mlp_from_hf(take: Callable[..., torch.Tensor], has: Callable[[str], bool], c: GPTConfig, i: int
                 ) -> dict[str, torch.Tensor]:
    p = f"layers.{i}.mlp."
    hs = [f"model.layers.{i}.{prefix}" for prefix in ("mlp.", "block_sparse_moe.")]  # either, as transformers reads

    def glu(src: str, dst: str, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
        gate, up, down = (take(*(f"{h}{src}{n}.weight" for h in hs)) for n in names)
        return {p + dst + "linear_fc1.weight": torch.cat([gate, up]), p + dst + "linear_fc2.weight": down}

    if not c.is_moe_layer(i):
        return glu("", "")
    out = {p + "router.weight": take(*(h + "gate.weight" for h in hs)),
           **glu("shared_experts.", "shared_experts.")}
    bias = take(*(h + "gate.e_score_correction_bias" for h in hs))
    if c.moe_router_enable_expert_bias:
        out[p + "router.expert_bias"] = bias
    stacked = [h for h in hs if has(h + "experts.gate_up_proj")]
    if stacked:  # transformers' in-memory layout: gate_up [E, 2f, h] (gate rows first), down [E, h, f]
        gate_up, down = take(stacked[0] + "experts.gate_up_proj"), take(stacked[0] + "experts.down_proj")
        for e in range(c.num_experts):
            out[f"{p}experts.{e}.linear_fc1.weight"], out[f"{p}experts.{e}.linear_fc2.weight"] = gate_up[e], down[e]
        return out
    for e in range(c.num_experts):
        out.update(glu(f"experts.{e}.", f"experts.{e}.", ("w1", "w3", "w2")))
    return out


def kimi_linear_to_hf(sd: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """A full megazero state dict of a Kimi Linear ``c`` -> the HF state dict in the Hub's layout."""
    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
        if c.layer_kinds(i).mixer == "kda":
            out.update(_kda_to_hf(sd, c, p + "self_attention.", h + "self_attn."))
        else:
            out.update({h + "self_attn." + hf: sd[p + "self_attention." + mz] for mz, hf in _mla_names(c)})
        out.update(_mlp_to_hf(sd, c, i))
    out["model.embed_tokens.weight"] = sd["embedding.weight"][:c.vocab_size]
    out["model.norm.weight"] = sd["final_norm.weight"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"][:c.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


def kimi_linear_from_hf(hf_sd: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`kimi_linear_to_hf`, from the Hub's layout or transformers' in-memory one. Strict about
    keys: every weight of the checkpoint is used."""
    sd = dict(hf_sd)
    if c.tie_embeddings:
        sd.pop("lm_head.weight", None)  # the tied copy, if the checkpoint stores it
    used: set[str] = set()

    def take(*names: str) -> torch.Tensor:
        for key in names:
            if key in sd:
                used.add(key)
                return sd[key]
        raise KeyError(f"HF checkpoint lacks {names[0]!r} (needed for a Kimi Linear model with {c.num_layers} layers)")

    out: dict[str, torch.Tensor] = {}
    for i in range(c.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = take(h + "input_layernorm.weight")
        out[p + "pre_mlp_layernorm.weight"] = take(h + "post_attention_layernorm.weight")
        if c.layer_kinds(i).mixer == "kda":
            out.update(_kda_from_hf(take, sd.__contains__, p + "self_attention.", h + "self_attn."))
        else:
            out.update({p + "self_attention." + mz: take(h + "self_attn." + hf) for mz, hf in _mla_names(c)})
        out.update(_mlp_from_hf(take, sd.__contains__, c, i))
    out["embedding.weight"] = pad_vocabulary(take("model.embed_tokens.weight"), c)
    out["final_norm.weight"] = take("model.norm.weight")
    if not c.tie_embeddings:
        out["output_layer.weight"] = pad_vocabulary(take("lm_head.weight"), c)
    refuse_unused(set(sd) - used, "kimi_linear")
    return {k: v.contiguous() for k, v in out.items()}


# ---- configs ------------------------------------------------------------------------------------------


def _get(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config sets (transformers' attribute names and the Hub's differ)."""
    return next((hf[n] for n in names if hf.get(n) is not None), default)


def _layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    """transformers' rule: ``layer_types``, else the Hub's 1-based ``kda_layers`` / ``full_attn_layers``, else
    every 4th layer from layer 4 (0-based) attention."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    linear = hf.get("linear_attn_config") or {}
    if "kda_layers" in linear and "full_attn_layers" in linear:
        types = ["?"] * layers
        for n in linear["full_attn_layers"]:
            types[n - 1] = "full_attention"
        for n in linear["kda_layers"]:
            types[n - 1] = "linear_attention"
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def _frequency(kda: tuple[int, ...]) -> Any:
    """``linear_attention_freq``: the int N where every N-th layer (1-based) is attention, else the 1/0 tuple."""
    n = next((i + 1 for i, x in enumerate(kda) if not x), None)
    if n is not None and kda == tuple(int((i + 1) % n != 0) for i in range(len(kda))):
        return n
    return kda


def _moe_kwargs(hf: dict[str, Any], layers: int, problems: list[str]) -> dict[str, Any]:
    experts = _get(hf, "num_experts", "num_local_experts")
    first, every = hf.get("first_k_dense_replace", 1), hf.get("moe_layer_freq", 1)  # the Hub's (transformers': 1, 1)
    types = hf.get("mlp_layer_types") or ["sparse" if experts and i >= first and i % every == 0 else "dense"
                                          for i in range(layers)]
    pattern = tuple(int(t == "sparse") for t in types)
    if set(types) - {"dense", "sparse"} or len(types) != layers:
        problems.append(f"mlp_layer_types {types} (one dense or sparse per layer: {layers})")
    if not any(pattern):
        return {}
    k = _get(hf, "num_experts_per_token", "num_experts_per_tok")
    g, gk = _get(hf, "num_expert_group", "n_group", default=1), _get(hf, "topk_group", default=1)
    shared = _get(hf, "num_shared_experts", "n_shared_experts", default=0)
    if g > 1 and gk < g and k != 2 * gk:
        problems.append(f"num_experts_per_token={k} with topk_group={gk} (HF scores a group by its 2 best experts, "
                        "megazero by its num_experts_per_token/topk_group best: needs num_experts_per_token = 2 x "
                        "topk_group)")
    norm = _get(hf, "moe_renormalize", "norm_topk_prob", default=True)
    if bool(norm) != (k > 1):
        problems.append(f"moe_renormalize={norm} with num_experts_per_token={k} (megazero renormalises the sigmoid "
                        "weights exactly when more than one expert is chosen)")
    if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        problems.append(f"moe_router_activation_func={hf['moe_router_activation_func']!r} (Kimi Linear's is sigmoid)")
    if not shared:
        problems.append(f"num_shared_experts={shared} (megazero maps Kimi Linear with its shared experts)")
    kw = dict(num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=hf["moe_intermediate_size"],
              moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"],
              moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
              moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), moe_aux_loss_coeff=0.0,
              moe_layer_freq=1 if all(pattern) else pattern)
    if g > 1 and gk < g:
        kw.update(moe_router_num_groups=g, moe_router_group_topk=gk)
    return kw


def kimi_linear_config_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig fields of an HF Kimi Linear ``config.json`` dict (transformers' or the Hub's); ValueError naming each
    value megazero cannot represent."""
    problems: list[str] = []
    if hf.get("quantization_config"):
        problems.append("quantization_config (quantized weights: convert the checkpoint to bf16 first)")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mla_use_nope", True)):
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]!r} (Kimi Linear in megazero needs {want!r})")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) not in (None, heads):
        problems.append(f"num_key_value_heads={hf['num_key_value_heads']} (multi-latent attention has one key per "
                        f"head: needs {heads})")
    types = _layer_types(hf, layers)
    if set(types) - {"linear_attention", "full_attention"} or len(types) != layers:
        problems.append(f"layer_types {types} (one linear_attention or full_attention per layer: {layers})")
    linear = hf.get("linear_attn_config") or {}
    head_dim = linear.get("head_dim", hf.get("linear_head_dim", 128))
    moe = _moe_kwargs(hf, layers, problems)
    if problems:
        raise ValueError("HF kimi_linear config not representable in megazero: " + "; ".join(problems))
    kda = tuple(int(t == "linear_attention") for t in types)
    max_pos = _get(hf, "model_max_length", "max_position_embeddings", default=4096)
    return dict(num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
                vocab_size=hf["vocab_size"], ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=max_pos,
                seq_length=max_pos, position_embedding_type="none", normalization="rmsnorm", activation="swiglu",
                add_bias_linear=False, tie_embeddings=hf.get("tie_word_embeddings", False), hidden_dropout=0.0,
                attention_dropout=hf.get("attention_dropout", 0.0), layernorm_epsilon=hf.get("rms_norm_eps", 1e-5),
                init_method_std=hf.get("initializer_range", 0.02), multi_latent_attention=True,
                q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
                v_head_dim=hf["v_head_dim"], latent_layernorm_epsilon=_LATENT_EPS,
                experimental_attention_variant="kda" if any(kda) else None,
                linear_attention_freq=_frequency(kda) if any(kda) else None,
                linear_conv_kernel_dim=linear.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                linear_num_key_heads=linear.get("num_heads", hf.get("linear_num_heads", 32)),
                linear_num_value_heads=linear.get("num_heads", hf.get("linear_num_heads", 32)),
                kda_f_lora_rank=head_dim, kda_gate_lora_rank=head_dim, hf_model_type="kimi_linear", **moe)


def kimi_linear_hf_config_dict(c: GPTConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformers.KimiLinearConfig`` for ``c`` (``model_type`` and ``architectures``
    included; the token ids None, which the exported tokenizer's replace)."""
    kw: dict[str, Any] = dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, intermediate_size=c.ffn_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_pos_emb_head_dim,
        qk_nope_head_dim=c.qk_head_dim, v_head_dim=c.v_head_dim, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.init_method_std,
        rms_norm_eps=c.layernorm_epsilon, tie_word_embeddings=c.tie_embeddings, attention_bias=False,
        attention_dropout=c.attention_dropout, linear_head_dim=c.linear_key_head_dim,
        linear_num_heads=c.linear_num_key_heads, linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        layer_types=["linear_attention" if c.layer_kinds(i).mixer == "kda" else "full_attention"
                     for i in range(c.num_layers)],
        mlp_layer_types=["sparse" if c.is_moe_layer(i) else "dense" for i in range(c.num_layers)],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if c.num_experts:
        kw.update(num_experts=c.num_experts, num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                  moe_intermediate_size=c.moe_ffn_size,
                  n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_size,
                  routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=c.moe_router_topk > 1,
                  n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1)
    return kw


def kimi_linear_build_config(c: GPTConfig):
    """The ``transformers.KimiLinearConfig`` of ``c`` (transformers >= 5)."""
    import transformers

    return transformers.KimiLinearConfig(**{k: v for k, v in kimi_linear_hf_config_dict(c).items()
                                            if k != "model_type"})
