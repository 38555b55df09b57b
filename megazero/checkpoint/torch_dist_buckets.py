"""megatron-core's distributed optimizer state saved ``dp_reshardable`` (Megatron-LM's default), read at the
layout it was saved at.

The keys are ``[chained_<i>.]optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<(param, grad)>.bucket_idx_<k>.
<state>`` (``state``: ``param``, the fp32 master, and Adam's ``exp_avg``/``exp_avg_sq``): one flat tensor per
bucket of the grad buffer of one (tensor, pipeline) rank, ``g`` its rank in megatron-core's model-parallel group
(``tp_rank + tp * pp_rank``; the expert part of a chained optimizer, ``chained_1.``, counts over the expert
grid: ``etp_rank + etp * (ep_rank + ep * pp_rank)``). Within a buffer megatron-core's ``_ParamAndGradBuffer``
lays that rank's parameters out in the reverse of its ``named_parameters()`` order, each starting at a multiple
of 64 elements, and cuts buckets after whole parameters; the bucket tensors' global sizes say where. So a rank
of a megazero run at the saved tp x pp x ep (any dp, any ZeRO stage) finds each of its parameters: its TP shard
is megatron-core's local parameter, and megatron-core's module order (:func:`megatron_order`) places it.

The master of every region read is checked against the model's weights in the same checkpoint (megatron-core
copies one to the other after each step): a layout that does not match the bytes is refused, never loaded.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from megazero.mpu.sharding import is_tp_sharded, tp_shard_of
from megazero.zero.shard_io import CheckpointError

__all__ = ["bucket_parts", "module_path", "megatron_order", "BucketLayout", "BucketSource"]

_BUCKET = re.compile(r"(?P<chain>chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_"
                     r"(?P<gbuf>\d+)\.dtype_(?P<dtype>\(.*?\))\.bucket_idx_(?P<bucket>\d+)\.(?P<state>\w+)")
# The children of megatron-core's modules in the order their __init__ registers them (GPTModel, embedding,
# TransformerBlock, MTP layer, TransformerLayer, (MLA) self-attention, MLP, MoE layer, SequentialMLP).
_MODULES = ("embedding", "word_embeddings", "position_embeddings", "decoder", "mtp", "output_layer", "layers",
            "enorm", "hnorm", "eh_proj", "transformer_layer", "final_layernorm", "input_layernorm", "self_attention",
            "pre_cross_attn_layernorm", "cross_attention", "pre_mlp_layernorm", "mlp", "core_attention", "linear_proj",
            "linear_qkv",
            "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
            "q_layernorm", "k_layernorm", "kv_layernorm", "router", "experts", "local_experts", "shared_experts",
            "linear_fc1", "linear_fc2")
_FLAGS = {"tp": "--tp", "pp": "--pp", "ep": "--ep", "etp": "--expert-tensor-parallel-size"}
# A module's own parameters, in registration order; they come before its children's.
_PARAMS = ("layer_norm_weight", "layer_norm_bias", "weight", "bias", "gate_weight", "softmax_offset")


def bucket_parts(ckpt) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """``(chain prefix, dp_group_idx) -> [(bucket key prefix, numel), ...]`` by bucket index, of a dp_reshardable
    checkpoint's flat bucket tensors. A part with more than one grad buffer (parameters of several dtypes) is
    refused: which parameter went to which buffer is not recorded."""
    found: dict[tuple[str, int], dict[tuple[int, int], tuple[str, int]]] = {}
    for key in ckpt.keys():
        m = _BUCKET.fullmatch(key)
        if m is None:
            continue
        prefix = key[:-len(m.group("state"))]
        part = found.setdefault((m.group("chain") or "", int(m.group("group"))), {})
        part[int(m.group("gbuf")), int(m.group("bucket"))] = (prefix, ckpt.global_shape(key)[0])
    out = {}
    for part, buckets in found.items():
        if len({g for g, _ in buckets}) > 1:
            raise CheckpointError(f"{ckpt.directory}: the dp_reshardable optimizer part {part} has grad buffers of "
                                  "several dtypes, which megazero does not place; re-save with "
                                  "--dist-ckpt-optim-fully-reshardable, or load the weights only with --no-load-optim")
        out[part] = [buckets[k] for k in sorted(buckets)]
    return out


def module_path(entry, impl: str, grouped: bool, first_stage: bool) -> list[str]:
    """megatron-core's module path (and parameter name) of the local parameter that holds ``entry``'s tensor."""
    key = entry.key
    if entry.name == "embedding.weight" and not first_stage:
        key = "output_layer.weight"  # the last stage's copy of a tied embedding
    if impl == "local":  # the local spec keeps these norms as modules of the layer
        key = re.sub(r"self_attention\.linear_qkv\.layer_norm_(weight|bias)$", r"input_layernorm.\1", key)
        key = re.sub(r"mlp\.linear_fc1\.layer_norm_(weight|bias)$", r"pre_mlp_layernorm.\1", key)
    parts, index = key.split("."), list(entry.index)
    if parts[:2] == ["decoder", "layers"] and not parts[2].isdigit():
        parts.insert(2, str(index.pop(0)))  # stacked layers: the layer number leads the index
    if "experts" in parts and parts[parts.index("experts") + 1] == "experts":
        at, e = parts.index("experts"), index.pop(0)
        parts = parts[:at + 1] + ([parts[at + 2], f"{parts[at + 3]}{e}"] if grouped
                                  else ["local_experts", str(e)] + parts[at + 2:])
    return parts


def megatron_order(path: list[str]) -> tuple:
    """The sort key that puts parameters in megatron-core's ``named_parameters()`` order: pre-order over the
    modules (a module's own parameters, then its children in registration order)."""
    out = []
    for i, c in enumerate(path):
        if i == len(path) - 1:
            m = re.fullmatch(r"(weight|bias)(\d+)", c)  # Transformer Engine's grouped experts: weight0, ...
            base, n = (m.group(1), int(m.group(2))) if m else (c, 0)
            if base not in _PARAMS:
                raise CheckpointError(f"megazero does not know where megatron-core registers {'.'.join(path)}")
            out.append((0, _PARAMS.index(base), n))
        elif c.isdigit():
            out.append((1, int(c), 0))
        elif c in _MODULES:
            out.append((1, _MODULES.index(c), 0))
        else:
            raise CheckpointError(f"megazero does not know where megatron-core registers {'.'.join(path)}")
    return tuple(out)


class BucketLayout:
    """Where each of this rank's parameters sits in the dp_reshardable buckets: ``place[name] = (bucket key
    prefix, offset, numel)``, with ``split[name]`` (its TP split, as :mod:`~megazero.zero.source_load` reads it).

    ``table``: the checkpoint's name table; ``args``: its Megatron-LM args; ``coords``: this rank's ``tp_rank``,
    ``pp_rank``, ``ep_rank``, ``etp_rank`` and the run's ``tp``, ``pp``, ``ep``, ``etp`` (which must be the saved
    ones: the shards are megatron-core's local parameters only at the layout that wrote them)."""

    def __init__(self, ckpt, engine, table: list, args: Any, coords: dict[str, int]) -> None:
        self.ckpt = ckpt
        saved = {"tp": int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                 "pp": int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
                 "ep": int(getattr(args, "expert_model_parallel_size", 1) or 1)}
        saved["etp"] = int(getattr(args, "expert_tensor_parallel_size", None) or saved["tp"])
        if getattr(args, "virtual_pipeline_model_parallel_size", None) or any(
                coords[k] != v for k, v in saved.items()):
            flags = " ".join(f"{_FLAGS[k]} {v}" for k, v in saved.items())
            raise CheckpointError(f"{ckpt.directory}: its optimizer state is megatron-core's dp_reshardable layout, "
                                  f"which megazero reads only at the layout that saved it ({flags}, no virtual "
                                  "pipeline); resume at that layout, re-save it in Megatron-LM with "
                                  "--dist-ckpt-optim-fully-reshardable, or load the weights only with --no-load-optim")
        impl = getattr(args, "transformer_impl", "transformer_engine")
        grouped = bool(getattr(args, "moe_grouped_gemm", False))
        if grouped and impl == "local":
            raise CheckpointError(f"{ckpt.directory}: the local spec's grouped experts (GroupedMLP) keep all of a "
                                  "rank's experts in one parameter, which megazero does not split out of "
                                  "dp_reshardable buckets; re-save with --dist-ckpt-optim-fully-reshardable")
        by_name = {e.name: e for e in table}
        parts = bucket_parts(ckpt)
        expert_part = saved["ep"] > 1  # megatron-core keeps experts apart only under expert parallelism
        chains = sorted({c for c, _ in parts})
        members: dict[tuple[str, int], list] = {}
        for g in engine.groups:
            for s in g.slots:
                expert = expert_part and ".mlp.experts." in s.name
                chain = ("chained_1." if expert else "chained_0.") if chains != [""] else ""
                group = (coords["etp_rank"] + coords["etp"] * (coords["ep_rank"] + coords["ep"] * coords["pp_rank"])
                         if expert else coords["tp_rank"] + coords["tp"] * coords["pp_rank"])
                path = module_path(by_name[s.name], impl, grouped, coords["pp_rank"] == 0)
                members.setdefault((chain, group), []).append((megatron_order(path), s))
        self.place: dict[str, tuple[str, int, int]] = {}
        self.split: dict[str, Optional[tuple[int, int, int, int]]] = {}
        for part, params in members.items():
            if part not in parts:
                raise CheckpointError(f"{ckpt.directory} has no dp_reshardable buckets for optimizer part {part} "
                                      f"(it has {sorted(parts)}): it was saved at another layout or by another "
                                      "model; load the weights only with --no-load-optim")
            self._walk(part, parts[part], [s for _, s in sorted(params, key=lambda x: x[0])], engine)

    def _walk(self, part, buckets: list[tuple[str, int]], slots: list, engine) -> None:
        """megatron-core's _ParamAndGradBuffer: parameters in reverse order, each from a multiple of 64."""
        b, pos = 0, 0
        for s in reversed(slots):
            pos = -(-pos // 64) * 64
            if b < len(buckets) and pos and pos == buckets[b][1]:
                b, pos = b + 1, 0  # a bucket closed before this parameter
            if b >= len(buckets) or pos + s.numel > buckets[b][1]:
                b = -1
                break
            self.place[s.name] = (buckets[b][0], pos, s.numel)
            rank, world = tp_shard_of(s.param, engine.tp_rank, engine.tp_size)
            self.split[s.name] = ((int(getattr(s.param, "partition_dim", 0)),
                                   int(getattr(s.param, "partition_stride", 1)), rank, world)
                                  if is_tp_sharded(s.param) and world > 1 else None)
            pos += s.numel
            if pos == buckets[b][1]:
                b, pos = b + 1, 0
        if b != len(buckets):
            raise CheckpointError(f"{self.ckpt.directory}: the dp_reshardable buckets of optimizer part {part} "
                                  f"({[n for _, n in buckets]} elements) do not hold this rank's {len(slots)} "
                                  "parameters as megatron-core lays them out: the model or its pipeline split "
                                  "differs from the run that saved it; load the weights only with --no-load-optim")


class _Slice:
    """One parameter's full-tensor view over its local shard in a bucket: ``get_shape()`` and ``[index]`` (unit-step
    slices) for regions inside this rank's TP shard, which is what the loader asks for."""

    def __init__(self, source: "BucketSource", name: str) -> None:
        self.source, self.name = source, name
        self.full = list(source.weights.get_slice(name).get_shape())

    def get_shape(self) -> list[int]:
        return list(self.full)

    def __getitem__(self, index) -> torch.Tensor:
        src = self.source
        prefix, offset, numel = src.layout.place[self.name]
        split = src.layout.split[self.name]
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.full) or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise IndexError(f"{self.name}: index {index} is not unit-step slices of its {len(self.full)} dims")
        local = list(self.full)
        bounds = [i.indices(n)[:2] for i, n in zip(index + (slice(None),) * len(self.full), self.full)]
        if split is not None:
            dim, stride, rank, world = split
            local[dim] //= world
            blk = self.full[dim] // (stride * world)
            a, b = bounds[dim]
            j = a // blk
            s, r = divmod(j, world)
            if r != rank or b > (j + 1) * blk:
                raise CheckpointError(f"{self.name}: rows {a}:{b} of dim {dim} are not in this rank's TP shard")
            bounds[dim] = (s * blk + a - j * blk, s * blk + b - j * blk)
        row = numel // local[0] if local else 1
        r0, r1 = bounds[0] if local else (0, 1)
        flat = src.ckpt.read(prefix + src.state, slice(offset + r0 * row, offset + r1 * row))
        out = flat.view([r1 - r0] + local[1:])[(slice(None),) + tuple(slice(a, b) for a, b in bounds[1:])]
        if src.state == "param":
            src.check(self.name, index, out)
        return out


class BucketSource:
    """A source (safetensors' ``keys()`` / ``get_slice()``) of one optimizer state (``param``, ``exp_avg``,
    ``exp_avg_sq``) of this rank's parameters, in megazero's full names, read from the dp_reshardable buckets.
    ``weights``: the checkpoint's model weights as a source (shapes, and the check of the master)."""

    def __init__(self, ckpt, layout: BucketLayout, state: str, weights) -> None:
        self.ckpt, self.layout, self.state, self.weights = ckpt, layout, state, weights
        missing = [p for p, _, _ in layout.place.values() if _missing(ckpt, p + state)]
        if missing:
            raise CheckpointError(f"{ckpt.directory}: the dp_reshardable buckets hold no {state} ({missing[0]}{state} "
                                  "is absent): it was saved by another optimizer; load the weights only with "
                                  "--no-load-optim")

    def keys(self) -> list[str]:
        return list(self.layout.place)

    def get_slice(self, name: str) -> _Slice:
        if name not in self.layout.place:
            raise KeyError(f"{name!r} is not a parameter of this rank")
        return _Slice(self, name)

    def check(self, name: str, index, master: torch.Tensor) -> None:
        """The master region must round to the model's weights there (megatron-core copies one into the other)."""
        weight = self.weights.get_slice(name)[index]
        if not torch.equal(master.to(weight.dtype), weight):
            raise CheckpointError(f"{self.ckpt.directory}: the dp_reshardable master of {name} does not match the "
                                  "checkpoint's weights there: its buckets are not laid out as megazero placed them "
                                  "(another model, layer spec or layout); load the weights only with --no-load-optim")


def _missing(ckpt, key: str) -> bool:
    try:
        ckpt.global_shape(key)
    except CheckpointError:
        return True
    return False
