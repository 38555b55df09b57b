"""megazero parameters <-> megatron-core's sharded-state-dict keys (the ``torch_dist`` checkpoint format).

``mcore_entries(config)`` is the one name table, used to read Megatron-LM's ``torch_dist`` checkpoints
(``megazero.checkpoint.torch_dist_source``) and to write them (``megazero.checkpoint.torch_dist_save``):
each megazero full tensor (a parameter, or a persistent buffer such as the routers'
``expert_bias``) is the global tensor ``key`` of megatron-core at the leading integer ``index``.

What megatron-core writes (``sharded_state_dict`` of TransformerBlock, TransformerLayer, MLP,
SequentialMLP/GroupedMLP/TEGroupedMLP, MLA, MTP in megatron-core 0.16):

* Homogeneous decoders stack the layers on a leading axis: ``decoder.layers.<name>`` global
  ``[num_layers, ...]``, index ``(layer,)``. A decoder whose layers differ (``moe_layer_freq`` a pattern or
  > 1) writes one key per layer, ``decoder.layers.<i>.<name>``, index ``()``. MTP layers are always one key
  per depth, ``mtp.layers.<k>.transformer_layer.<name>`` (and ``enorm``/``hnorm``/``eh_proj``/``final_layernorm``).
* Norms fused into the next linear layer are saved under that layer's name: the input norm as
  ``self_attention.linear_qkv.layer_norm_{weight,bias}``, the pre-MLP norm as ``mlp.linear_fc1.layer_norm_*``
  (both layer specs for standard attention's dense layers; the local spec maps its separate norms onto these
  names). Where the specs differ (a MoE layer's pre-MLP norm, MLA's norms) the key follows
  ``transformer_impl`` (Megatron-LM's ``--transformer-impl``) and the other spec's key is an alias.
* Experts: every implementation writes ``mlp.experts.experts.linear_fc{1,2}.{weight,bias}`` global
  ``[(L,) E, out, in]`` (GroupedMLP transposes its ``[in, out]`` weights back), index ``(layer, expert)``.
* Tensor-parallel shards join as megazero's full tensors do: QKV and MLA up-projections concatenate (whole
  heads per rank); SwiGLU ``linear_fc1`` global is ``[gate_full; up_full]``, megazero's stride-2 full layout.
  So no entry needs more than indexing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..config import GPTConfig

__all__ = ["McoreEntry", "mcore_entries", "mcore_per_layer_keys", "TRANSFORMER_IMPLS"]

TRANSFORMER_IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True)
class McoreEntry:
    """megazero full tensor ``name`` == megatron-core global tensor ``key`` (shape ``shape``) at the leading
    integer indices ``index`` (``(layer,)``, ``(layer, expert)``, ``(expert,)`` or ``()``). ``aliases``: the
    keys other layer specs save the same tensor under (read when ``key`` is absent)."""

    name: str
    key: str
    shape: tuple[int, ...]
    index: tuple[int, ...]
    aliases: tuple[str, ...] = ()


def mcore_per_layer_keys(config: GPTConfig) -> bool:
    """Whether megatron-core writes one key per decoder layer for ``config`` (its non-homogeneous rule)."""
    f = config.moe_layer_freq
    if config.hybrid_layer_pattern is not None or config.linear_attention_freq is not None:
        return True  # the layers differ in kind (megatron-core's hybrid stack writes one key per layer)
    return bool(config.num_experts) and (isinstance(f, (tuple, list)) or f > 1)


# Within a layer: megazero name -> megatron-core name, for names both layer specs write alike.
_SAME = ("self_attention.linear_qkv.", "self_attention.linear_proj.", "self_attention.linear_q_proj.",
         "self_attention.core_attention.",
         "self_attention.linear_q_down_proj.", "self_attention.linear_q_up_proj.",
         "self_attention.linear_kv_down_proj.", "self_attention.linear_kv_up_proj.",
         "mlp.linear_fc1.", "mlp.linear_fc2.", "mlp.router.", "mlp.shared_experts.linear_fc")


# The recurrent layers' tensors keep megazero's names and shapes: a Mamba layer's ``norm`` and ``mixer`` are
# megatron-core's module names, but its fused, per-rank-interleaved ``in_proj`` and 3-D ``conv1d`` (and Gated
# DeltaNet's) are split here into equal-part projections and 2-D filters, which megatron-core does not read.
_RECURRENT = ("norm.", "mixer.", "self_attention.in_proj_", "self_attention.out_proj.",
              "self_attention.conv1d_weight", "self_attention.A_log", "self_attention.dt_bias",
              "self_attention.norm_weight")


def _layer_key(local: str, config: GPTConfig, moe: bool, te: bool) -> tuple[str, tuple[str, ...]]:
    """(key, aliases) inside one layer for the megazero layer-local name ``local`` (no expert index)."""
    mla = config.multi_latent_attention
    head, _, suffix = local.rpartition(".")
    qk_norm = local.startswith(("self_attention.q_layernorm.", "self_attention.k_layernorm."))
    if local.startswith(_SAME) or (qk_norm and not mla) or local.startswith(_RECURRENT):
        return local, ()
    if head == "input_layernorm":
        fused = f"self_attention.linear_qkv.layer_norm_{suffix}"
        return (local, ()) if mla else (fused, (local,))
    if head == "pre_mlp_layernorm":
        fused, separate = f"mlp.linear_fc1.layer_norm_{suffix}", local
        # TE keeps a separate norm before experts; the local spec maps it onto fc1's name (not for MLA).
        if te:
            return (separate, (fused,)) if moe else (fused, (separate,))
        return (separate, (fused,)) if mla else (fused, (separate,))
    if mla and head in ("self_attention.q_layernorm", "self_attention.kv_layernorm"):
        up = "linear_q_up_proj" if head.endswith("q_layernorm") else "linear_kv_up_proj"
        fused = f"self_attention.{up}.layer_norm_{suffix}"
        return (fused, (local,)) if te else (local, (fused,))
    if head == "mlp.shared_gate":
        return f"mlp.shared_experts.gate_{suffix}", ()
    m = re.fullmatch(r"mlp\.experts\.\d+\.(linear_fc[12]\.\w+)", local)
    if m:
        return f"mlp.experts.experts.{m.group(1)}", ()
    raise KeyError(f"megazero parameter {local!r} has no megatron-core torch_dist name")


_TOP = {"embedding.weight": "embedding.word_embeddings.weight",
        "position_embeddings.weight": "embedding.position_embeddings.weight",
        "final_norm.weight": "decoder.final_layernorm.weight", "final_norm.bias": "decoder.final_layernorm.bias",
        "output_layer.weight": "output_layer.weight"}
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")


def _megazero_tensors(config: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of every parameter and persistent buffer of ``config``'s model, in model order."""
    from megazero.mpu.utils import NO_GROUP

    from ..gpt import GPTModel

    # full (tp = 1, every expert) shapes, whatever groups the calling process registered
    model = GPTModel(config, tp_group=NO_GROUP, ep_group=NO_GROUP, device="meta")
    out = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    for prefix, module in model.named_modules():
        for n, b in module.named_buffers(recurse=False):
            if n not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{n}" if prefix else n, tuple(b.shape)))
    return out


def mcore_entries(config: GPTConfig, *, transformer_impl: str = "transformer_engine",
                  per_layer: Optional[bool] = None) -> list[McoreEntry]:
    """The table for ``config``: one entry per megazero full tensor, in the model's order.

    ``transformer_impl``: the layer spec whose names win where the specs differ ("transformer_engine",
    Megatron-LM's default, or "local"); the other's names are ``aliases``. ``per_layer``: one key per decoder
    layer (None: megatron-core's own rule, ``mcore_per_layer_keys``)."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {transformer_impl!r}")
    te = transformer_impl == "transformer_engine"
    per_layer = mcore_per_layer_keys(config) if per_layer is None else per_layer
    L, E = config.num_layers, config.num_experts or 0
    tensors = _megazero_tensors(config)
    moe_layers = {n.rsplit(".mlp.router.", 1)[0] for n, _ in tensors if ".mlp.router." in n}
    entries = []
    for name, shape in tensors:
        if name in _TOP:
            entries.append(McoreEntry(name, _TOP[name], shape, ()))
            continue
        m = re.fullmatch(r"(layers|mtp\.layers)\.(\d+)\.(.+)", name)
        if m is None:
            raise KeyError(f"megazero parameter {name!r} has no megatron-core torch_dist name")
        group, i, local = m.group(1), int(m.group(2)), m.group(3)
        if group == "mtp.layers":
            if local.startswith(_MTP_OWN):
                entries.append(McoreEntry(name, f"mtp.layers.{i}.{local}", shape, ()))
                continue
            local = local.removeprefix("transformer_layer.")
            prefix, lead, index = f"mtp.layers.{i}.transformer_layer.", (), ()
            moe = f"mtp.layers.{i}.transformer_layer" in moe_layers
        else:
            prefix, lead, index = ((f"decoder.layers.{i}.", (), ()) if per_layer else ("decoder.layers.", (L,), (i,)))
            moe = f"layers.{i}" in moe_layers
        key, aliases = _layer_key(local, config, moe, te)
        expert = re.match(r"mlp\.experts\.(\d+)\.", local)
        if expert:
            lead, index = lead + (E,), index + (int(expert.group(1)),)
        entries.append(McoreEntry(name, prefix + key, lead + shape, index, tuple(prefix + a for a in aliases)))
    return entries
