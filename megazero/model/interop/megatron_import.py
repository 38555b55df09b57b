"""Megatron-LM / Megatron-DeepSpeed GPT weights -> megazero names, shapes and ``GPTConfig``.

The pure tensor mapping; reading the checkpoint files (tracker files, ``mp_rank_XX`` and
``layer_XX`` layouts, safe unpickling) is ``megazero.checkpoint.megatron_legacy.import_megatron``.

* ``config_from_megatron_args``: a Megatron ``args`` Namespace -> ``GPTConfig``.
* ``megatron_names``: one (tp, pp) shard, flattened, Megatron names (legacy ``language_model``
  or flat mcore names) -> megazero names with global layer numbers.
* ``deepspeed_layer_names``: the ``layer_XX`` files of one tp rank of a Megatron-DeepSpeed
  pipeline checkpoint (embedding, transformer layers, final norm, in order) -> megazero names.
* ``megatron_to_megazero``: the per-tp-rank shards + ``args`` -> ``(GPTConfig, full state dict)``.

Tensor-parallel shards are joined as Megatron split them: the fused QKV per rank is whole
query groups, ``[group, (heads/group + 2), head_dim]`` (for multi-head attention
``[heads, 3, head_dim]``: the q, k, v of each head), which is megazero's order, so the
shards concatenate; SwiGLU's ``dense_h_to_4h`` shard is ``[gate_r; up_r]`` (stride 2).
Checkpoints older than checkpoint_version 2 (another QKV order) are refused.

Megatron's GeLU is the tanh approximation with bias-gelu fusion (its default) and
``erf`` with ``--no-bias-gelu-fusion``/``--openai-gelu`` off; megazero's is tanh, so the
latter imports with a ~1e-3 activation difference (reported by the tool).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import torch

from megazero.mpu.sharding import full_from_shards

from ..config import GPTConfig
from .megatron_hybrid import hybrid_fields

__all__ = ["config_from_megatron_args", "flatten", "megatron_names", "deepspeed_layer_names",
           "merge_tp_shards", "megatron_to_megazero"]

# Megatron local-layer parameter names -> megazero names (within a layer).
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.linear_qkv": "self_attention.linear_qkv",
    "self_attention.dense": "self_attention.linear_proj",
    "self_attention.linear_proj": "self_attention.linear_proj",
    "self_attention.q_layernorm": "self_attention.q_layernorm",
    "self_attention.k_layernorm": "self_attention.k_layernorm",
    "post_attention_layernorm": "pre_mlp_layernorm",
    "pre_mlp_layernorm": "pre_mlp_layernorm",
    "mlp.dense_h_to_4h": "mlp.linear_fc1",
    "mlp.linear_fc1": "mlp.linear_fc1",
    "mlp.dense_4h_to_h": "mlp.linear_fc2",
    "mlp.linear_fc2": "mlp.linear_fc2",
}
# (partition dim, stride) of the TP-sharded megazero weights; everything else is replicated.
_COLUMN = {"self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc1.bias"}
_ROW = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}


def _get(args: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(args, n, None)
        if v is not None:
            return v
    return default


def config_from_megatron_args(args: Any, vocab_size: Optional[int] = None) -> GPTConfig:
    """GPTConfig for a Megatron ``args`` Namespace. ``vocab_size``: the tokenizer's (default: the
    checkpoint's padded vocabulary, so every row is kept and nothing is masked, as in Megatron)."""
    tp = int(_get(args, "tensor_model_parallel_size", default=1))
    pos = _get(args, "position_embedding_type", default="learned_absolute")
    if _get(args, "use_rotary_position_embeddings", default=False):
        pos = "rope"
    pos = {"learned_absolute": "learned", "yarn": "rope"}.get(pos, pos)
    norm = str(_get(args, "normalization", default="LayerNorm")).lower()
    act = next((a for a in ("swiglu", "squared_relu", "quick_geglu") if _get(args, a, default=False)), "gelu")
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention", default=False) else None
    groups = groups or _get(args, "num_key_value_heads")
    heads = args.num_attention_heads
    kv = _get(args, "kv_channels")
    padded = int(_get(args, "padded_vocab_size"))
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        vocab_size=vocab_size or padded, ffn_hidden_size=_get(args, "ffn_hidden_size"),
        num_query_groups=groups if groups not in (None, heads) else None,
        kv_channels=kv if kv not in (None, args.hidden_size // heads) else None,
        max_position_embeddings=_get(args, "max_position_embeddings", default=args.seq_length),
        seq_length=args.seq_length, position_embedding_type=pos,
        rotary_base=float(_get(args, "rotary_base", "rope_theta", default=10000.0)),
        rotary_percent=float(_get(args, "rotary_percent", default=1.0)) if pos == "rope" else 1.0,
        normalization="rmsnorm" if norm == "rmsnorm" else "layernorm", activation=act,
        glu_linear_offset=float(_get(args, "glu_linear_offset", default=0.0)),
        activation_func_clamp_value=_get(args, "activation_func_clamp_value"),
        qk_layernorm=bool(_get(args, "qk_layernorm", default=False)),
        apply_layernorm_1p=bool(_get(args, "apply_layernorm_1p", default=False)),
        add_bias_linear=bool(_get(args, "add_bias_linear", default=True)),
        tie_embeddings=not _get(args, "untie_embeddings_and_output_weights", default=False),
        hidden_dropout=float(_get(args, "hidden_dropout", default=0.1)),
        attention_dropout=float(_get(args, "attention_dropout", default=0.1)),
        init_method_std=float(_get(args, "init_method_std", default=0.02)),
        layernorm_epsilon=float(_get(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", default=128)),
        vocab_padding_tp=tp, add_qkv_bias=bool(_get(args, "add_qkv_bias", default=False)),
        mtp_num_layers=int(_get(args, "mtp_num_layers", default=0)),
        mtp_loss_scaling_factor=float(_get(args, "mtp_loss_scaling_factor", default=0.1)),
        **_attention_fields(args),
    )
    return GPTConfig(**{**fields, **_moe_fields(args), **_mla_fields(args), **hybrid_fields(args)})


def _attention_fields(args: Any) -> dict:
    """The sliding windows and sinks of Megatron's ``--window-size``, ``--window-attn-skip-freq`` and
    ``--softmax-type`` (a window of -1, unbounded, is none)."""
    window = _get(args, "window_size")
    freq = _get(args, "window_attn_skip_freq")
    out = dict(softmax_type=_get(args, "softmax_type", default="vanilla"))
    if window is not None and int(window[0]) >= 0:
        out.update(window_size=(int(window[0]), int(window[1])),
                   window_attn_skip_freq=tuple(int(f) for f in freq) if isinstance(freq, (list, tuple)) else freq)
    return out


def _moe_fields(args: Any) -> dict:
    """GPTConfig's mixture-of-experts fields from Megatron's ``--num-experts`` / ``--moe-*`` args."""
    experts = _get(args, "num_experts", "num_moe_experts")
    if not experts:
        return {}
    freq = _get(args, "moe_layer_freq", default=1)
    balancing = _get(args, "moe_router_load_balancing_type", default="aux_loss")
    out = dict(num_experts=int(experts), moe_router_topk=int(_get(args, "moe_router_topk", default=2)),
               moe_ffn_hidden_size=_get(args, "moe_ffn_hidden_size"),
               moe_layer_freq=tuple(int(f) for f in freq) if isinstance(freq, (list, tuple)) else int(freq),
               moe_router_load_balancing_type=balancing if isinstance(balancing, str) else balancing[0],
               moe_shared_expert_intermediate_size=_get(args, "moe_shared_expert_intermediate_size"),
               moe_shared_expert_gate=bool(_get(args, "moe_shared_expert_gate", default=False)),
               moe_router_pre_softmax=bool(_get(args, "moe_router_pre_softmax", default=False)),
               moe_router_score_function=_get(args, "moe_router_score_function", default="softmax"),
               moe_router_enable_expert_bias=bool(_get(args, "moe_router_enable_expert_bias", default=False)),
               moe_router_num_groups=_get(args, "moe_router_num_groups"),
               moe_router_group_topk=_get(args, "moe_router_group_topk"),
               moe_router_topk_scaling_factor=_get(args, "moe_router_topk_scaling_factor"),
               moe_router_dtype=_get(args, "moe_router_dtype", default="fp32"),
               moe_grouped_gemm=bool(_get(args, "moe_grouped_gemm", default=False)),
               moe_expert_capacity_factor=_get(args, "moe_expert_capacity_factor"),
               moe_token_drop_policy=_get(args, "moe_token_drop_policy", default="probs"),
               moe_pad_expert_input_to_capacity=bool(_get(args, "moe_pad_expert_input_to_capacity", default=False)))
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        v = _get(args, name)
        if v is not None:
            out[name] = float(v[0] if isinstance(v, (list, tuple)) else v)
    return out


def _mla_fields(args: Any) -> dict:
    """GPTConfig's multi-latent attention and RoPE-scaling fields from Megatron's args."""
    out = {}
    if _get(args, "multi_latent_attention", default=False):
        out = dict(multi_latent_attention=True, q_lora_rank=_get(args, "q_lora_rank"), num_query_groups=None,
                   kv_channels=None, kv_lora_rank=int(_get(args, "kv_lora_rank", default=512)),
                   qk_head_dim=int(_get(args, "qk_head_dim", default=128)),
                   qk_pos_emb_head_dim=int(_get(args, "qk_pos_emb_head_dim", default=64)),
                   v_head_dim=int(_get(args, "v_head_dim", default=128)))
    rope_type = _get(args, "rope_type") or ("yarn" if _get(args, "position_embedding_type") == "yarn" else None)
    if rope_type is not None:
        out["rope_type"] = rope_type
    for name, kind in (("rotary_scaling_factor", float), ("original_max_position_embeddings", int),
                       ("beta_fast", float), ("beta_slow", float), ("mscale", float), ("mscale_all_dim", float),
                       ("yarn_correction_range_round_to_int", bool)):
        if _get(args, name) is not None:
            out[name] = kind(_get(args, name))
    if _get(args, "use_rope_scaling", default=False):  # Megatron-LM's Llama 3.1 scaling: low 1, high 4, 8192 fixed
        out.update(rope_type="llama3", rotary_scaling_factor=float(_get(args, "rope_scaling_factor", default=8.0)),
                   low_freq_factor=float(_get(args, "rope_scaling_low_freq_factor", default=1.0)),
                   high_freq_factor=float(_get(args, "rope_scaling_high_freq_factor", default=4.0)),
                   original_max_position_embeddings=int(_get(args, "rope_scaling_original_max_position_embeddings",
                                                             default=8192)))
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict, under dotted names."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def megatron_names(flat: dict[str, torch.Tensor], layer_offset: int) -> dict[str, torch.Tensor]:
    """Megatron key names of one (tp, pp) shard -> megazero names with global layer numbers."""
    out = {}
    for k, v in flat.items():
        k = k.removeprefix("language_model.").removeprefix("module.")
        if k.endswith("_extra_state") or k.startswith("word_embeddings_for_head"):
            continue  # TE metadata; the last stage's copy of the tied embedding
        m = re.match(r"(?:encoder|transformer|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias)$", k)
        if m:
            name = _LAYER_NAMES.get(m.group(2))
            if name is None:
                raise KeyError(f"unknown Megatron layer parameter {k!r}")
            out[f"layers.{int(m.group(1)) + layer_offset}.{name}.{m.group(3)}"] = v
            continue
        m = re.match(r"(?:encoder|transformer|decoder)\.final_(?:layer)?norm\.(weight|bias)$", k)
        if m:
            out[f"final_norm.{m.group(1)}"] = v
        elif k == "embedding.word_embeddings.weight":
            out["embedding.weight"] = v
        elif k == "embedding.position_embeddings.weight":
            out["position_embeddings.weight"] = v
        elif k == "output_layer.weight":
            out["output_layer.weight"] = v
        else:
            raise KeyError(f"unknown Megatron parameter {k!r}")
    return out


def deepspeed_layer_names(files: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """One TP rank of a DeepSpeed pipeline checkpoint: its ``(file name, loaded layer_XX file)`` pairs, in
    layer order -> the megazero-named weights."""
    out, layer, seen_embedding = {}, 0, False
    for f, sd in files:
        sd = sd.get("module", sd) if isinstance(sd, dict) else sd
        flat = flatten(sd)
        if "word_embeddings.weight" in flat:
            if not seen_embedding:
                out["embedding.weight"] = flat["word_embeddings.weight"]
                if "position_embeddings.weight" in flat:
                    out["position_embeddings.weight"] = flat["position_embeddings.weight"]
                seen_embedding = True
            continue  # later: the tied output embedding, the same tensor
        if any(k.startswith(("self_attention.", "attention.")) for k in flat):
            for k, v in flat.items():
                name, _, suffix = k.rpartition(".")
                mapped = _LAYER_NAMES.get(name.replace("attention.", "self_attention.", 1)
                                          if name.startswith("attention.") else name)
                if mapped is None:
                    raise KeyError(f"unknown Megatron-DeepSpeed layer parameter {k!r} in {f}")
                out[f"layers.{layer}.{mapped}.{suffix}"] = v
            layer += 1
        elif "lm_head.weight" in flat or "output_layer.weight" in flat:
            out["output_layer.weight"] = flat.get("lm_head.weight", flat.get("output_layer.weight"))
        elif set(flat) <= {"weight", "bias"}:
            out.update({f"final_norm.{k}": v for k, v in flat.items()})
        else:
            raise KeyError(f"unrecognized Megatron-DeepSpeed layer file {f} with keys {sorted(flat)[:6]}")
    return out


def merge_tp_shards(shards: list[dict[str, torch.Tensor]], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Per-TP-rank megazero-named shards -> full tensors, joined as Megatron split them."""
    full = {}
    for k in shards[0]:
        parts = [s[k] for s in shards]
        local = k.split(".", 2)[-1] if k.startswith("layers.") else k
        if len(parts) == 1:
            full[k] = parts[0]
        elif local in _COLUMN:
            stride = 2 if local.startswith("mlp.linear_fc1") and config.gated_linear_unit else 1
            full[k] = full_from_shards(parts, 0, stride)
        elif local in _ROW:
            full[k] = torch.cat(parts, dim=1)
        elif k in ("embedding.weight", "output_layer.weight"):
            full[k] = torch.cat(parts, dim=0)
        else:
            full[k] = parts[0]  # replicated (norms, row-parallel biases, positions)
    return full


def megatron_to_megazero(shards: list[dict[str, torch.Tensor]], args: Any, vocab_size: Optional[int] = None
                         ) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """``(GPTConfig, full megazero state dict, GeLU kind "tanh"/"erf")`` from the per-TP-rank shards (megazero
    names, global layer numbers) and the run's ``args``."""
    config = config_from_megatron_args(args, vocab_size)
    full = merge_tp_shards(shards, config)
    if config.tie_embeddings:
        full.pop("output_layer.weight", None)
    elif "output_layer.weight" not in full:
        raise KeyError("the run untied embeddings and output weights but the checkpoint has no output layer")
    rows = full["embedding.weight"].shape[0]
    if rows != config.padded_vocab_size:
        raise ValueError(f"the checkpoint's embedding has {rows} rows but vocab_size {config.vocab_size} pads to "
                         f"{config.padded_vocab_size}; pass the tokenizer's vocabulary size (--vocab-size)")
    gelu = ("erf" if not _get(args, "bias_gelu_fusion", default=True) and not _get(args, "openai_gelu", default=False)
            and config.activation == "gelu" else "tanh")
    return config, full, gelu
