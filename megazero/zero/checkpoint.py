"""Sharded ZeRO checkpoints that load at any tp x dp x ZeRO stage.

Each rank writes one safetensors file with its fp32 master partitions and Adam
moments, plus JSON metadata saying which parameter (by its tp=1 name) lies
where in each flat partition and how it is TP-sharded. Loading reads, lazily
and one parameter at a time, the slices it needs from every saved file,
reassembles the full (tp=1) tensor, and keeps the part the loading rank owns
under *its* layout. So a checkpoint written at tp=2 x dp=2 with ZeRO-3 resumes
at tp=1 x dp=4 with ZeRO-1, weights and optimizer state identical.

Nothing here unpickles: tensors come from safetensors, metadata from JSON.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..mpu.sharding import full_from_shards
from .engine import ZeroEngine

__all__ = ["CheckpointError", "save_zero_state", "load_zero_state", "read_full_parameters", "ShardedReader"]

STATES = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, tampered with, or does not fit the model."""


def shard_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"zero_rank{rank:05d}.safetensors")


def save_zero_state(engine: ZeroEngine, directory: str) -> str:
    """Write this rank's partitions (collective-free); returns the file path."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors, groups_meta = {}, []
    step = 0
    for i, g in enumerate(engine.groups):
        state = engine.optimizer.state.get(g.master, {})
        if "step" in state:
            step = int(state["step"])
        for key in STATES:
            value = g.master if key == "master" else state.get(key)
            if value is not None:
                tensors[f"g{i}.{key}"] = value.detach().float().contiguous().cpu()
        groups_meta.append({
            "partitions": g.partitions, "shard_start": g.shard_start, "shard_numel": g.shard_numel,
            "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel,
                       "tp_sharded": bool(getattr(s.param, "tensor_model_parallel", False)),
                       "partition_dim": int(getattr(s.param, "partition_dim", 0)),
                       "partition_stride": int(getattr(s.param, "partition_stride", 1))} for s in g.slots],
        })
    meta = {
        "format": "megazero-zero-1",
        "tp_rank": engine.tp_rank, "tp_size": engine.tp_size, "dp_rank": engine.dp_rank, "dp_size": engine.dp_size,
        "stage": engine.stage, "optimizer_step": step, "groups": groups_meta,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "engine": {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                   "micro_steps": engine.micro_steps},
    }
    path = shard_file(directory, rank)
    save_file(tensors, path, metadata={"megazero": json.dumps(meta)})
    return path


class ShardedReader:
    """Index over every rank file of a checkpoint; rebuilds full tp=1 tensors on demand."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        files = sorted(f for f in os.listdir(directory) if f.startswith("zero_rank") and f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{directory} holds no zero_rank*.safetensors files: not a megazero checkpoint")
        self.handles, self.meta = [], []
        for f in files:
            path = os.path.join(directory, f)
            try:
                h = safe_open(path, framework="pt")
                meta = json.loads(h.metadata()["megazero"])
            except Exception as e:  # safetensors raises several types for bad headers/sizes
                raise CheckpointError(f"cannot read {path}: {e} (truncated or not a megazero shard?)") from e
            self.handles.append(h)
            self.meta.append(meta)
        self.tp_size = self.meta[0]["tp_size"]
        # name -> tp_rank -> list of (file index, group index, slot)
        self.where: dict[str, dict[int, list]] = {}
        for fi, meta in enumerate(self.meta):
            for gi, g in enumerate(meta["groups"]):
                if g["partitions"] == 1 and meta["dp_rank"] != 0:
                    continue  # ZeRO-0 keeps full copies on every DP rank: one is enough
                for slot in g["slots"]:
                    self.where.setdefault(slot["name"], {}).setdefault(meta["tp_rank"], []).append((fi, gi, slot))
        found = {m["tp_rank"] for m in self.meta}
        if found != set(range(self.tp_size)):
            raise CheckpointError(f"{directory}: files for TP ranks {sorted(set(range(self.tp_size)) - found)} are missing")

    @property
    def names(self) -> list[str]:
        return list(self.where)

    @property
    def first_meta(self) -> dict:
        return self.meta[0]

    def _local(self, name: str, tp_rank: int, key: str) -> Optional[torch.Tensor]:
        """One TP rank's shard of parameter ``name`` assembled from the DP partitions."""
        entries = self.where[name][tp_rank]
        slot0 = entries[0][2]
        out = torch.zeros(slot0["numel"], dtype=torch.float32)
        covered = 0
        for fi, gi, slot in entries:
            g = self.meta[fi]["groups"][gi]
            lo = max(slot["offset"], g["shard_start"])
            hi = min(slot["offset"] + slot["numel"], g["shard_start"] + g["shard_numel"])
            if hi <= lo:
                continue
            tensor_name = f"g{gi}.{key}"
            if tensor_name not in self.handles[fi].keys():
                return None  # e.g. Adam moments before the first step
            try:
                piece = self.handles[fi].get_slice(tensor_name)[lo - g["shard_start"]:hi - g["shard_start"]]
            except Exception as e:
                raise CheckpointError(f"cannot read {tensor_name} of shard file {fi}: {e}") from e
            out[lo - slot["offset"]:hi - slot["offset"]] = piece
            covered += hi - lo
        if covered != slot0["numel"]:
            raise CheckpointError(f"parameter {name} (TP rank {tp_rank}) is only partly present: "
                                  f"{covered} of {slot0['numel']} elements; a shard file is missing")
        return out.view(slot0["shape"])

    def full(self, name: str, key: str = "master") -> Optional[torch.Tensor]:
        """The full (tp=1) fp32 tensor of ``name`` for ``key`` in master/exp_avg/exp_avg_sq."""
        if name not in self.where:
            raise CheckpointError(f"parameter {name} is not in the checkpoint")
        slot = self.where[name][0][0][2]
        shards = [self._local(name, t, key) for t in range(self.tp_size)]
        if any(s is None for s in shards):
            return None
        if not slot["tp_sharded"]:
            return shards[0]
        return full_from_shards(shards, slot["partition_dim"], slot["partition_stride"])


def read_full_parameters(directory: str, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights (tp=1 names and shapes) from a sharded checkpoint, for export and inference."""
    reader = ShardedReader(directory)
    return {n: reader.full(n) for n in (names or reader.names)}


@torch.no_grad()
def load_zero_state(engine: ZeroEngine, directory: str) -> dict:
    """Load masters, Adam moments and the loss scaler into ``engine``, whatever layout saved them.

    Returns the saved metadata. Parameter names must match; shapes must match
    after undoing the saved TP sharding.
    """
    reader = ShardedReader(directory)
    mine = {s.name for g in engine.groups for s in g.slots}
    missing, unexpected = sorted(mine - set(reader.names)), sorted(set(reader.names) - mine)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    step = reader.first_meta["optimizer_step"]
    try:
        engine.load_full_weights(lambda name: reader.full(name, "master"))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    fused = bool(engine.optimizer.defaults.get("fused"))  # torch keeps fused Adam's step on the device
    for g in engine.groups:
        moments = {}
        for key in STATES[1:]:
            for s in g.slots:
                full = reader.full(s.name, key)
                if full is None:
                    break  # no Adam state yet (saved before the first step)
                local = engine.tp_local(s.param, full)
                p0, s0, n = g.owned_range(s)
                buf = moments.setdefault(key, torch.zeros_like(g.master))
                if n:
                    buf[s0:s0 + n].copy_(local.reshape(-1)[p0:p0 + n])
        if moments:
            state = engine.optimizer.state[g.master]
            state["step"] = torch.tensor(float(step), device=g.master.device if fused else "cpu")
            state.update(moments)
    engine.loss_scaler.load_state_dict(reader.first_meta["loss_scaler"])
    counters = reader.first_meta["engine"]
    engine.global_steps, engine.skipped_steps = counters["global_steps"], counters["skipped_steps"]
    engine.micro_steps = 0  # checkpoints are taken at accumulation boundaries
    return reader.first_meta
