"""Saving a run as Megatron-LM's ``torch_dist`` checkpoint (``--ckpt-format torch_dist``), each rank writing its share.

The directory is what Megatron-LM's ``save_checkpoint`` writes: ``latest_checkpointed_iteration.txt`` and
``iter_XXXXXXX/`` holding ``__<rank>_0.distcp`` files, DCP's ``.metadata``, ``common.pt`` (Megatron's ``args``,
``iteration``, ``opt_param_scheduler``, the optimizer's param groups, and a ``megazero`` entry with the run's
train state and config) and ``metadata.json``. megatron-core's ``dist_checkpointing.load`` reads the model into
its ``GPTModel`` at any TP x PP (DCP reshards), and megazero resumes it at any layout.

Keys and global shapes are :func:`~megazero.model.interop.megatron_dist.mcore_entries`' (the layer spec of
``--transformer-impl``, Megatron-LM's default ``transformer_engine`` unless ``local`` is given). The model
tensors are in the run's compute dtype; the distributed optimizer's state follows megatron-core's
``fully_reshardable`` layout: ``optimizer.state.param.<key>`` (the fp32 master) and
``optimizer.state.<moment>.<key>``, in the model's global shapes. Every linear layer gets the empty
``_extra_state`` object megatron-core's layer specs ask for. Megatron's RNG state is not written (load with
``--no-load-rng``, as for any checkpoint from another trainer).

Each rank writes exactly the elements it owns: its ZeRO partition of each parameter, once per TP replica
group (the rule the gradient norm counts by, ``FlatGroup.counted_slots``). A partition is a flat range of the
TP shard, so it becomes at most a few rectangular chunks (:func:`flat_boxes`), each mapped into the global
tensor through the parameter's TP split (:func:`global_pieces`). Nothing is gathered: the bytes a rank
writes are its share of the model and optimizer state.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.async_save import HostCopier, PendingSave, gather_on_rank0
from megazero.checkpoint.native import _named_persistent_buffers, checkpoint_dir, clear_partial, publish_directory
from megazero.mpu.sharding import is_tp_sharded, tp_shard_of
from megazero.utils.phase_agreement import agree
from megazero.zero.optim import optimizer_step
from megazero.zero.shard_io import CheckpointError, fsync_path

__all__ = ["stage_torch_dist", "TorchDistSave", "flat_boxes", "global_pieces", "TRACKER"]

TRACKER = "latest_checkpointed_iteration.txt"
_METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}
_CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "distrib_optim_sharding_type": "fully_reshardable"}


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangular boxes, in order:
    ``(flat start - lo, offsets, sizes)``; each box is contiguous in memory (at most ``2 * ndim - 1``)."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [(0, (lo,), (hi - lo,))] if shape else [(0, (), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)
    if r0 == r1:
        return [(f, (r0,) + o, (1,) + z) for f, o, z in flat_boxes(shape[1:], c0, c1)]
    out, at = [], 0
    if c0:
        out += [(f, (r0,) + o, (1,) + z) for f, o, z in flat_boxes(shape[1:], c0, inner)]
        at, r0 = inner - c0, r0 + 1
    if r1 > r0:
        out.append((at, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
        at += (r1 - r0) * inner
    if c1:
        out += [(at + f, (r1,) + o, (1,) + z) for f, o, z in flat_boxes(shape[1:], 0, c1)]
    return out


def global_pieces(offsets: tuple[int, ...], sizes: tuple[int, ...], shard_shape: tuple[int, ...],
                  split: Optional[tuple[int, int, int, int]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """A box of a TP shard (of ``shard_shape``) placed in the full tensor: ``(start, length, global offsets)``
    per piece along the partition dim (``start`` relative to the box).
    ``split``: ``(dim, stride, rank, world)`` of the shard (:mod:`~megazero.mpu.sharding`'s layout: local
    block ``s`` of ``stride`` is global block ``s * world + rank``), None for a whole tensor."""
    if split is None or split[3] == 1:
        return [(0, sizes[0] if sizes else 1, offsets)]
    dim, stride, rank, world = split
    block = shard_shape[dim] // stride
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    out, j = [], lo
    while j < hi:
        s, within = divmod(j, block)
        end = min(hi, (s + 1) * block)
        g = list(offsets)
        g[dim] = (s * world + rank) * block + within
        out.append((j - lo, end - j, tuple(g)))
        j = end
    return out


# ---- what a rank writes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Chunk:
    """One rectangle of the global tensor ``key`` (``offsets``, ``sizes``, the key's ``shape``): the elements
    ``[start, start + prod(box))`` of a slot's owned segment viewed as ``box``, narrowed by ``narrow``
    (``(dim, start, length)``, or None)."""

    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    box: tuple[int, ...]
    narrow: Optional[tuple[int, int, int]]

    def of(self, segment: torch.Tensor) -> torch.Tensor:
        t = segment[self.start:self.start + math.prod(self.box)].view(self.box)
        if self.narrow is not None:
            t = t.narrow(*self.narrow)
        return t.reshape(self.sizes)


def slot_chunks(entry, shape: tuple[int, ...], lo: int, hi: int,
                split: Optional[tuple[int, int, int, int]]) -> list[_Chunk]:
    """The chunks of ``entry``'s global tensor that the flat range ``[lo, hi)`` of a (TP shard of) shape
    ``shape`` fills; ``split``: ``(dim, stride, rank, world)`` of a TP-sharded one. Raises CheckpointError when
    the shard does not fit the entry's shape."""
    lead = len(entry.index)
    full = tuple(entry.shape[lead:])
    expect = list(shape)
    if split is not None:
        expect[split[0]] *= split[3]
    if tuple(expect) != full:
        raise CheckpointError(f"{entry.name}: this rank's shard {tuple(shape)} does not make {entry.key}'s "
                              f"{full} (a megatron-core name table out of step with the model)")
    out = []
    for start, offsets, sizes in flat_boxes(tuple(shape), lo, hi):
        if split is None or split[3] == 1:
            pieces = [(None, offsets, sizes)]
        else:
            d = split[0]
            pieces = [((d, a, n), g, sizes[:d] + (n,) + sizes[d + 1:])
                      for a, n, g in global_pieces(offsets, sizes, tuple(shape), split)]
        for narrow, g, z in pieces:
            out.append(_Chunk(entry.key, tuple(entry.shape), tuple(entry.index) + tuple(g), (1,) * lead + tuple(z),
                              start, sizes, narrow))
    return out


def _split_of(engine, param: torch.Tensor) -> Optional[tuple[int, int, int, int]]:
    if not is_tp_sharded(param):
        return None
    rank, world = tp_shard_of(param, engine.tp_rank, engine.tp_size)
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1)), rank, world


def _state_prefixes(keys: tuple[str, ...]) -> dict[str, str]:
    """Segment name -> key prefix: the fp32 master and each optimizer state tensor ``keys`` (Adam's moments)."""
    return {"master": "optimizer.state.param.", **{k: f"optimizer.state.{k}." for k in keys}}


def _owned_items(engine, entries: dict, host) -> list[tuple[list[_Chunk], dict[str, torch.Tensor], torch.dtype]]:
    """``(chunks, {prefix: segment}, model dtype)`` for every parameter range this rank writes, and for the
    model's persistent buffers (TP rank 0 of data-parallel rank 0 of each stage)."""
    items = []
    for g in engine.groups:
        prefixes = _state_prefixes(engine.state_keys(g))
        state = engine.optimizer.state.get(g.master, {})
        for s, p0, s0, n in g.counted_slots(count_replicated=engine.tp_rank == 0):
            entry = entries.get(s.name)
            if entry is None:
                raise CheckpointError(f"{s.name} has no megatron-core torch_dist name: save with --ckpt-format "
                                      "megazero")
            master = host(g.master.detach()[s0:s0 + n])
            segments = {"": master}  # the model tensor: the master in the compute dtype (cast when written)
            for what, prefix in prefixes.items():
                value = master if what == "master" else state.get(what)
                if value is not None:
                    segments[prefix] = value if what == "master" else host(value.detach()[s0:s0 + n])
            items.append((slot_chunks(entry, tuple(s.shape), p0, p0 + n, _split_of(engine, s.param)), segments,
                          engine.compute_dtype))
    if engine.tp_rank == 0 and engine.dp_rank == 0:
        for name, b in _named_persistent_buffers(engine):
            entry = entries[engine.param_name(name)]
            items.append((slot_chunks(entry, tuple(b.shape), 0, b.numel(), None), {"": host(b.detach().reshape(-1))},
                          b.dtype))
    return items


def extra_state_keys(entries) -> list[str]:
    """The ``_extra_state`` objects megatron-core's layer specs save for every linear layer (keyed by the
    layer and expert the weight sits at), which its strict load asks for."""
    import re

    keys = {}
    for e in entries:
        m = re.fullmatch(r"(.+\.(?:linear_\w+|eh_proj))\.weight", e.key)
        if m is None or e.key.startswith("output_layer"):
            continue
        lead = len(e.index)
        offsets, shape = (e.index, e.shape[:lead]) if lead else ((0,), (1,))
        keys[f"{m.group(1)}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"] = None
    return list(keys)


class TorchDistSave(PendingSave):
    """A staged torch_dist checkpoint (:func:`stage_torch_dist`): ``write()`` writes this rank's chunks into
    ``iter_XXXXXXX.partial/__<rank>_0.distcp``; ``commit()`` gathers every rank's chunk list on rank 0, which
    writes ``.metadata``, ``common.pt`` and ``metadata.json``, renames the directory and moves the tracker."""

    def __init__(self, save: str, final: str, items: list, common: dict, entries: list, *, tokenizer,
                 group, on_written) -> None:
        self.save, self.directory, self.partial = save, final, final + ".partial"
        self.items, self.common, self.entries = items, common, entries
        self.tokenizer, self.group, self.on_written = tokenizer, group, on_written
        self.records: Optional[list[tuple]] = None

    def write(self) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(self.partial, exist_ok=True)  # every rank: a shared filesystem may not show rank 0's mkdir
        name = f"__{rank}_0.distcp"
        path, records = os.path.join(self.partial, name), []
        with open(path, "wb") as f:
            for chunks, segments, dtype in self.items:
                for prefix, segment in segments.items():
                    segment = segment.cpu()
                    for c in chunks:
                        t = c.of(segment).to(dtype if prefix == "" else torch.float32).contiguous()
                        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                            t = t.clone()  # torch.save writes a view's whole storage
                        offset = f.tell()
                        torch.save(t, f)  # a blob of its own (DCP's layout), written in place
                        records.append((prefix + c.key, t.dtype, c.shape, c.offsets, c.sizes, name, offset,
                                        f.tell() - offset))
            f.flush()
            os.fsync(f.fileno())
        if self.on_written is not None:
            self.on_written(self.partial)
        self.records, self.items = records, None  # the host copies are on disk now

    def commit(self) -> None:
        gathered = gather_on_rank0(self.records, self.group)
        agree("checkpoint save", lambda: self._seal(gathered) if gathered is not None else None, group=self.group)

    def _seal(self, gathered: list) -> None:
        """Rank 0: DCP's metadata over every rank's chunks, the common state, then the directory in place."""
        from megazero.data import save_tokenizer_files

        extra = os.path.join(self.partial, "__0_1.distcp")
        with open(extra, "wb") as f:
            torch.save([None], f)  # every _extra_state object (megatron-core stores [obj]): its linears load None
            length = f.tell()
        fsync_path(extra)
        meta = _dcp_metadata([r for part in gathered for r in part], extra_state_keys(self.entries),
                             os.path.basename(extra), length)
        with open(os.path.join(self.partial, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
        torch.save(self.common, os.path.join(self.partial, "common.pt"))
        with open(os.path.join(self.partial, "metadata.json"), "w") as f:
            json.dump(_METADATA_JSON, f)
        if self.tokenizer is not None:
            save_tokenizer_files(self.tokenizer, os.path.join(self.partial, "tokenizer"))
        for root, _, files in os.walk(self.partial):
            for name in files:
                fsync_path(os.path.join(root, name))
        publish_directory(self.save, self.partial, self.directory, TRACKER, str(self.common["iteration"]))


def _dcp_metadata(records: list[tuple], extra_keys: list[str], extra_file: str, extra_len: int):
    """torch.distributed.checkpoint's ``Metadata`` of every rank's chunks. A chunk written by two ranks (a
    copy both hold) is kept once; two chunks that overlap otherwise are an error of the writer."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    tensors: dict[str, TensorStorageMetadata] = {}
    storage, seen = {}, {}
    for key, dtype, shape, offsets, sizes, file, offset, length in records:
        if (key, offsets) in seen:
            if seen[key, offsets] != sizes:
                raise CheckpointError(f"{key}: two ranks wrote overlapping chunks at {offsets}")
            continue
        seen[key, offsets] = sizes
        md = tensors.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), []))
        md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        storage[MetadataIndex(key, torch.Size(offsets), len(md.chunks) - 1)] = _StorageInfo(file, offset, length)
    for key, md in tensors.items():
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if covered != math.prod(md.size):
            raise CheckpointError(f"{key}: the ranks wrote {covered} of its {math.prod(md.size)} elements")
    state: dict[str, Any] = dict(tensors)
    for key in extra_keys:
        state[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(extra_file, 0, extra_len)
    return Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage,
                    version="1.0.0")


# ---- the common state and the staging ----------------------------------------------------------------------

def _megatron_scheduler(state: dict[str, Any]) -> dict[str, Any]:
    """Megatron's ``OptimizerParamScheduler.state_dict()`` of megazero's LR schedule state."""
    out = {"max_lr": state["max_lr"], "min_lr": state["min_lr"], "lr_warmup_steps": state["warmup_steps"],
           "lr_decay_steps": state["decay_steps"], "lr_decay_style": state["decay_style"],
           "num_steps": state["num_steps"]}
    for k in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
        if state.get(k) is not None:
            out[k] = state[k]
    return out


def megatron_args(config: dict[str, Any], iteration: int, consumed_samples: int, transformer_impl: str):
    """The ``args`` Namespace Megatron-LM's ``pretrain_gpt.py`` would store for this run (``config``:
    ``TrainConfig.to_dict()``)."""
    import argparse

    from megazero.model.config import GPTConfig
    from megazero.model.interop.megatron_args import megatron_model_args

    par, pre, opt, sch = config["parallel"], config["precision"], config["optim"], config["schedule"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(pre["dtype"], torch.float32)
    return argparse.Namespace(
        **megatron_model_args(GPTConfig.from_dict(config["model"])),
        tensor_model_parallel_size=par["tp"], pipeline_model_parallel_size=par["pp"],
        virtual_pipeline_model_parallel_size=par["virtual_pp"] if par["virtual_pp"] > 1 else None,
        context_parallel_size=par["cp"], expert_model_parallel_size=par["ep"],
        expert_tensor_parallel_size=par["etp"], data_parallel_size=par["dp"], world_size=par["world_size"],
        sequence_parallel=par["sequence_parallel"], bf16=pre["dtype"] == "bf16", fp16=pre["dtype"] == "fp16",
        params_dtype=dtype, optimizer="sgd" if opt["type"] == "SGD" else "adam", lr=opt["lr"], min_lr=opt["min_lr"],
        weight_decay=opt["weight_decay"], adam_beta1=opt["adam_beta1"], adam_beta2=opt["adam_beta2"],
        adam_eps=opt["adam_eps"], clip_grad=opt["clip_grad"], micro_batch_size=sch["micro_batch_size"],
        global_batch_size=sch["global_batch_size"], train_iters=sch["train_iters"],
        lr_decay_style=sch["lr_decay_style"], seed=config["seed"], iteration=iteration,
        consumed_train_samples=consumed_samples, consumed_valid_samples=0, ckpt_format="torch_dist",
        use_dist_ckpt=True, use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True,
        transformer_impl=transformer_impl)


def _common_state(engine, iteration: int, train_state: dict, config: dict, transformer_impl: str) -> dict:
    """``common.pt``: Megatron-LM's non-sharded state, and megazero's own (train state, config, engine)."""
    step = optimizer_step(engine.optimizer)
    groups = [{"lr": g.get("lr"), "weight_decay": g.get("weight_decay"), "step": step}
              for g in engine.optimizer.param_groups]
    own_engine = {"loss_scaler": engine.loss_scaler.state_dict(), "global_steps": engine.global_steps,
                  "skipped_steps": engine.skipped_steps, "precision": str(engine.compute_dtype).replace("torch.", "")}
    return {"args": megatron_args(config, iteration, train_state["consumed_samples"], transformer_impl),
            "checkpoint_version": 3.0, "iteration": iteration,
            "opt_param_scheduler": _megatron_scheduler(train_state["lr_scheduler"]),
            "num_floating_point_operations_so_far": 0.0,
            "optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"},
            "content_metadata": dict(_CONTENT),
            "megazero": {"train_state": json.dumps(train_state), "config": json.dumps(config),
                         "engine": json.dumps(own_engine)}}


def stage_torch_dist(save: str, iteration: int, engine, *, train_state: dict[str, Any], config: dict[str, Any],
                     tokenizer=None, pipeline=None, group: Optional[dist.ProcessGroup] = None, copy: bool = False,
                     on_written=None, transformer_impl: str = "transformer_engine",
                     entries: Optional[list] = None) -> TorchDistSave:
    """Collective over ``group`` (default: the default group): the torch_dist checkpoint of ``iteration``,
    staged (:mod:`~megazero.checkpoint.async_save`). ``config``: ``TrainConfig.to_dict()``. With ``copy`` the
    rank's owned master, optimizer state and buffers are copied into host memory (``host_bytes``), so
    training may go on while ``write()`` runs; without, the write reads the live tensors. ``entries``: the
    name table ``mcore_entries(model config, transformer_impl=...)``, which a run keeps for its saves (at
    DeepSeek-V3's size it takes seconds to build); built here when not given."""
    from megazero.model.config import GPTConfig
    from megazero.model.interop.megatron_dist import mcore_entries

    del pipeline  # every stage's engine names its parameters as at pp = 1: the keys place them
    final = checkpoint_dir(save, iteration)
    clear_partial(save, final + ".partial", group)
    if entries is None:
        entries = mcore_entries(GPTConfig.from_dict(config["model"]), transformer_impl=transformer_impl)
    copier = HostCopier() if copy else None
    items = _owned_items(engine, {e.name: e for e in entries}, copier if copier is not None else (lambda t: t))
    if copier is not None:
        copier.finish()
        engine.drop_pages()  # the NVMe maps' pages the copies read (offload)
    pending = TorchDistSave(save, final, items, _common_state(engine, iteration, train_state, config,
                                                              transformer_impl),
                            entries, tokenizer=tokenizer, group=group, on_written=on_written)
    pending.host_bytes = copier.bytes if copier is not None else 0
    return pending
