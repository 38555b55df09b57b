"""Sharded ZeRO checkpoints that load at any tp x dp x ZeRO stage, reading only what a rank owns.

Each rank writes one safetensors file with its fp32 master partitions and the
optimizer's per-element state (Adam's two moments, SGD's momentum buffer), plus
JSON metadata saying which parameter (by its tp=1 name) lies
where in each flat partition and how it is TP-sharded: a TP-sharded slot records
``"shard": [rank, world]``, the shard of its full tensor it holds (its TP shard, or an
expert's own, :func:`~megazero.mpu.sharding.tp_shard_of`); a slot saved without it
is its file's TP shard ``[tp_rank, tp_size]``.

Loading plans, for every element range this rank will own under *its* layout,
where those elements lie in the saved files: same tp x dp x stage, that is the
rank's own file; another layout, the slices of the saved shards overlapping
this rank's TP shard and DP partition. It then reads only those byte ranges
(verified chunk by chunk, see :mod:`shard_io`). So a rank reads about its own
state, never the whole model, and a checkpoint written at tp=2 x dp=2 with
ZeRO-3 resumes at tp=1 x dp=4 with ZeRO-1, weights and optimizer state
identical.

Element mapping. A TP-sharded tensor of full shape ``[A, S, B]`` (``S`` the
partition dim) with stride ``k`` over ``T`` shards (the saved slot's world) is
cut into ``k*T`` blocks along ``S``; shard ``t`` holds blocks ``s*T + t``. Local and saved flat indices
are related through the full (tp=1) flat index; equal TP layouts and
replicated tensors need no index arithmetic at all.

Nothing here unpickles: tensors come from safetensors, metadata from JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..mpu.sharding import is_tp_sharded, tp_shard_of
from .engine import ZeroEngine
from .optim import optimizer_step, set_optimizer_step
from .shard_io import CheckpointError, ReadCounter, ShardFile, fsync_path

__all__ = ["CheckpointError", "save_zero_state", "load_zero_state", "read_zero_state", "publish_loaded_state",
           "read_full_parameters", "CheckpointReader", "ReadCounter", "shard_file"]



def shard_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"zero_rank{rank:05d}.safetensors")


def save_zero_state(engine: ZeroEngine, directory: str, *, pp_rank: int = 0, pp_size: int = 1) -> str:
    """Write this rank's partitions (collective-free, fsync'd); returns the file path.

    A pipeline stage passes its ``pp_rank`` / ``pp_size``; its slots already carry pp = 1
    names (``zero.initialize(param_names=...)``), and a stage's copy
    of another stage's parameter (``pipeline_shared_copy``: the tied head's embedding) is
    not listed, since it equals the original and loads from it.
    """
    tensors, meta = stage_zero_state(engine, pp_rank=pp_rank, pp_size=pp_size)
    path = write_zero_state(tensors, meta, directory)
    engine.drop_pages()  # the NVMe maps' pages this save read (offload)
    return path


def stage_zero_state(engine: ZeroEngine, *, pp_rank: int = 0, pp_size: int = 1,
                     snapshot: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, metadata)`` of this rank's file (:func:`save_zero_state`), read now: the fp32
    partitions and optimizer state on the host, the metadata as plain values. ``snapshot(t)``
    makes each host tensor (default ``t.float().contiguous().cpu()``, which may share the live
    tensor's memory on the CPU); a background save passes one that copies, so the step may change
    the live tensors right after (and then drops the NVMe pages its copies read, as
    :func:`save_zero_state` does after writing)."""
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().contiguous().cpu()

    snapshot = snapshot or host
    tensors, groups_meta = {}, []
    step = optimizer_step(engine.optimizer)  # torch keeps it in the state, apex's FusedAdam in the group
    for i, g in enumerate(engine.groups):
        state = engine.optimizer.state.get(g.master, {})
        for key in ("master",) + engine.state_keys(g):
            value = g.master if key == "master" else state.get(key)
            if value is not None:
                tensors[f"g{i}.{key}"] = snapshot(value.detach())
        groups_meta.append({
            "partitions": g.partitions, "shard_start": g.shard_start, "shard_numel": g.shard_numel,
            "padded_numel": g.padded_numel, "partitioning": g.part.name, "replica_rank": g.part.replica_rank,
            "slots": [_slot_meta(engine, s) for s in g.slots if not getattr(s.param, "pipeline_shared_copy", False)],
        })
    meta = {
        "format": "megazero-zero-1",
        "tp_rank": engine.tp_rank, "tp_size": engine.tp_size, "dp_rank": engine.dp_rank, "dp_size": engine.dp_size,
        "stage": engine.stage, "optimizer_step": step, "groups": groups_meta, "pp_rank": pp_rank, "pp_size": pp_size,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "precision": str(engine.compute_dtype).replace("torch.", ""),
        "engine": {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                   "micro_steps": engine.micro_steps},
    }
    if snapshot is not host:
        engine.drop_pages()
    return tensors, json.loads(json.dumps(meta))  # plain values, detached from the live engine


def write_zero_state(tensors: dict[str, torch.Tensor], meta: dict, directory: str) -> str:
    """Write a staged file (:func:`stage_zero_state`) into ``directory``, fsync'd; no communication."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(directory, exist_ok=True)  # every rank: a shared filesystem may not show rank 0's mkdir yet
    path = shard_file(directory, rank)
    save_file(tensors, path, metadata={"megazero": json.dumps(meta)})
    fsync_path(path)
    return path


def _slot_meta(engine: ZeroEngine, s) -> dict:
    """A slot's saved metadata; a TP-sharded one names the shard it holds (``"shard"``)."""
    p = s.param
    meta = {"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel,
            "tp_sharded": is_tp_sharded(p), "partition_dim": int(getattr(p, "partition_dim", 0)),
            "partition_stride": int(getattr(p, "partition_stride", 1))}
    if meta["tp_sharded"]:
        meta["shard"] = list(tp_shard_of(p, engine.tp_rank, engine.tp_size))
    return meta


def _saved_shard(slot: dict, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(rank, world)`` of the full tensor a saved slot holds, read from a file of TP coordinates
    ``(tp_rank, tp_size)``: ``(0, 1)`` for a whole (TP-replicated) tensor; a TP-sharded slot saved
    without ``"shard"`` holds its file's TP shard."""
    if not slot["tp_sharded"]:
        return 0, 1
    rank, world = slot.get("shard", (tp_rank, tp_size))
    return int(rank), int(world)


def _follows_tp(meta: dict) -> bool:
    """Whether every TP-sharded slot of a file holds the file's own TP shard (no expert of
    another expert tensor-parallel size): then TP rank ``t``'s files hold shard ``t`` of every name."""
    t, tp = meta["tp_rank"], meta["tp_size"]
    return all(_saved_shard(s, t, tp) == (t, tp) for g in meta["groups"] for s in g["slots"] if s["tp_sharded"])


# ---------------------------------------------------------------------------- element mapping


def _abs(shape: list[int], dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])


def _local_to_full(idx: torch.Tensor, full: list[int], dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    a_, s_, b_ = _abs(full, dim)
    sl, blk = s_ // world, s_ // (stride * world)
    a, rem = idx // (sl * b_), idx % (sl * b_)
    j, b = rem // b_, rem % b_
    big_j = ((j // blk) * world + rank) * blk + j % blk
    return (a * s_ + big_j) * b_ + b


def _full_to_local(fidx: torch.Tensor, full: list[int], dim: int, stride: int, world: int):
    a_, s_, b_ = _abs(full, dim)
    sl, blk = s_ // world, s_ // (stride * world)
    a, rem = fidx // (s_ * b_), fidx % (s_ * b_)
    big_j, b = rem // b_, rem % b_
    block = big_j // blk
    j = (block // world) * blk + big_j % blk
    return block % world, (a * sl + j) * b_ + b


def _runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal ``(src_start, dst_start, length)`` runs where both index lists advance by one."""
    if src.numel() == 0:
        return []
    brk = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(brk).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([src.numel()])])
    return list(zip(src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist()))


# ---------------------------------------------------------------------------- reading


class _Location:
    """Where one saved shard lies: its slot and group metadata, its pipeline stage, the ``(rank,
    world)`` of the full tensor it is (``shard``), and the (file, group index) of each of its
    partitions (``uniform``: every DP rank's file of its TP rank, same group index)."""

    __slots__ = ("slot", "group", "pp", "gi", "uniform", "shard", "holders")

    def __init__(self, slot: dict, group: dict, pp: int, gi: int, uniform: bool, shard: tuple[int, int]) -> None:
        self.slot, self.group, self.pp, self.gi, self.uniform, self.shard = slot, group, pp, gi, uniform, shard
        self.holders: dict[int, tuple[str, int]] = {}

    def admits(self, slot: dict, group: dict) -> bool:
        """Whether a file's copy of this shard is laid out alike (the ranks of one partitioning
        always are), so that its partitions combine with this location's."""
        return (slot["offset"], group["partitions"], group["shard_numel"]) == (
            self.slot["offset"], self.group["partitions"], self.group["shard_numel"])


class CheckpointReader:
    """The saved layout of one checkpoint directory, and planned reads of any element range.

    Headers are read lazily: one file per saved TP rank (they share the group
    structure), preferring ``prefer_dp``'s file so that a rank of an unchanged
    layout opens its own file only. A checkpoint whose files hold shards other than
    their TP rank's (experts of another expert tensor-parallel size) is looked up
    in every file of the stage.
    """

    def __init__(self, directory: str, manifest: Optional[dict] = None, *, prefer_dp: int = 0,
                 counter: Optional[ReadCounter] = None) -> None:
        self.directory = directory
        self.counter = counter or ReadCounter()
        self.entries: dict[str, dict] = (manifest or {}).get("files", {}) if manifest is not None else {}
        self.verify = manifest is not None
        self._files: dict[str, ShardFile] = {}
        # (tp_rank, dp_rank) -> file name, per pipeline stage (one stage unless saved with pp > 1)
        self.stages: list[dict[tuple[int, int], str]] = [{}]
        self.by_rank = self.stages[0]
        layout = (manifest or {}).get("layout")
        if layout is not None:
            self.tp_size, self.dp_size = layout["tp_size"], layout["dp_size"]
            self.stages = [{} for _ in range(layout.get("pp_size", 1))]
            for name, e in self.entries.items():
                if "tp_rank" in e:
                    self.stages[e.get("pp_rank", 0)][(e["tp_rank"], e["dp_rank"])] = name
        else:  # no layout in a manifest: learn it from every shard's header
            names = sorted(f for f in os.listdir(directory) if f.startswith("zero_rank") and f.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"{directory} holds no zero_rank*.safetensors files: not a megazero checkpoint")
            meta0 = self._open(names[0]).meta
            if meta0 is None:
                raise CheckpointError(f"cannot read {os.path.join(directory, names[0])}: no megazero metadata "
                                      "(not a megazero shard?)")
            self.stages = [{} for _ in range(meta0.get("pp_size", 1))]
            for n in names:
                meta = self._open(n).meta
                if meta is None:
                    raise CheckpointError(f"cannot read {os.path.join(directory, n)}: no megazero metadata "
                                          "(not a megazero shard?)")
                self.stages[meta.get("pp_rank", 0)][(meta["tp_rank"], meta["dp_rank"])] = n
            self.tp_size, self.dp_size = meta0["tp_size"], meta0["dp_size"]
        self.by_rank = self.stages[0]
        self.pp_size = len(self.stages)
        missing = [(t, d, pp) for pp, files in enumerate(self.stages) for t in range(self.tp_size)
                   for d in range(self.dp_size) if (t, d) not in files]
        if missing:
            raise CheckpointError(f"{directory}: the shard files of (tp rank, dp rank, pp rank) {missing[:8]} are "
                                  "missing")
        self.prefer_dp = prefer_dp % self.dp_size
        self._where: dict[int, dict[str, _Location]] = {}

    def _open(self, name: str) -> ShardFile:
        f = self._files.get(name)
        if f is None:
            entry = self.entries.get(name)
            if self.verify and entry is None:
                raise CheckpointError(f"{os.path.join(self.directory, name)} is not listed in manifest.json")
            f = self._files[name] = ShardFile(os.path.join(self.directory, name), entry, self.counter)
            if f.meta is None:
                raise CheckpointError(f"cannot read {f.path}: no megazero metadata (not a megazero shard?)")
        return f

    def file_of(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> ShardFile:
        return self._open(self.stages[pp_rank][(tp_rank, dp_rank)])

    @property
    def first_meta(self) -> dict:
        return self.file_of(0, self.prefer_dp).meta

    def where(self, t: int) -> dict[str, "_Location"]:
        """name -> where the partitions of its shard index ``t`` lie (a whole tensor: any copy,
        preferably saved TP rank ``t``'s; a whole TP-sharded one, saved at world 1: ``t = 0`` only).

        When the files hold their TP rank's shards, those of TP rank ``t`` say it all. Groups over
        the data-parallel group lie alike in every DP rank's file: the preferred file's header
        suffices. A checkpoint with other partitionings (experts, replicated groups) names its
        tensors differently per file: every DP file's header of the TP rank is read, and each
        partition is taken from the first file holding it."""
        if t not in self._where:
            where: dict[str, _Location] = {}
            for pp in range(self.pp_size):  # every stage's names (pp = 1 names when saved by a pipeline)
                if t < self.tp_size and _follows_tp(self.file_of(t, self.prefer_dp, pp).meta):
                    self._where_tp(where, t, pp)
                else:
                    self._where_any(where, t, pp)
            self._where[t] = where
        return self._where[t]

    def _index(self, g: dict) -> int:
        """The partition a saved group's file holds (0: unpartitioned, every file holds it all)."""
        return g["shard_start"] // g["shard_numel"] if g["partitions"] > 1 else 0

    def _where_tp(self, where: dict, tp_rank: int, pp: int) -> None:
        """:meth:`where` for a stage whose TP rank ``tp_rank`` files hold its TP shards."""
        files = self.stages[pp]
        meta = self.file_of(tp_rank, self.prefer_dp, pp).meta
        uniform = all(g.get("partitioning", "dp") == "dp" for g in meta["groups"])
        ranks = [self.prefer_dp] + ([] if uniform else [d for d in range(self.dp_size) if d != self.prefer_dp])
        for d in ranks:
            for gi, g in enumerate(self.file_of(tp_rank, d, pp).meta["groups"]):
                for s in g["slots"]:
                    loc = where.setdefault(s["name"], _Location(s, g, pp, gi, uniform,
                                                                _saved_shard(s, tp_rank, self.tp_size)))
                    loc.holders.setdefault(self._index(g), (files[(tp_rank, d)], gi))

    def _where_any(self, where: dict, t: int, pp: int) -> None:
        """:meth:`where` for a stage whose files hold other shards than their TP rank's: every
        file's header is read, TP rank ``t``'s first (its preferred DP rank's first of all), and
        each slot of shard index ``t`` (or whole) is taken where it lies, keyed by its partition."""
        files = self.stages[pp]
        order = sorted(files, key=lambda k: (k[0] != t, k[1] != self.prefer_dp, k))
        for key in order:
            meta = self._open(files[key]).meta
            for gi, g in enumerate(meta["groups"]):
                for s in g["slots"]:
                    shard = _saved_shard(s, key[0], self.tp_size)
                    if s["tp_sharded"] and shard[0] != t:
                        continue
                    loc = where.setdefault(s["name"], _Location(s, g, pp, gi, False, shard))
                    if loc.admits(s, g):
                        loc.holders.setdefault(self._index(g), (files[key], gi))

    @property
    def names(self) -> list[str]:
        return list(self.where(0))

    def slot(self, name: str) -> dict:
        hit = self.where(0).get(name)
        if hit is None:
            raise CheckpointError(f"parameter {name} is not in the checkpoint")
        return hit.slot

    def own_group_names(self) -> set[str]:
        """Names saved in groups partitioned over a group of their own, or sharded other than over
        TP (experts): a rank may hold some of them only."""
        return {n for n, loc in self.where(0).items() if loc.group.get("partitioning", "dp") != "dp"
                or (loc.slot["tp_sharded"] and loc.shard[1] != self.tp_size)}

    def saved_world(self, name: str) -> int:
        """How many shards ``name`` was saved in (1: whole, or not TP-sharded)."""
        self.slot(name)  # a missing name raises CheckpointError
        return self.where(0)[name].shard[1]

    def full_shape(self, name: str) -> list[int]:
        """The full (tp=1) shape of ``name``."""
        s = self.slot(name)
        shape = list(s["shape"])
        if s["tp_sharded"]:
            shape[s["partition_dim"]] *= self.saved_world(name)
        return shape

    def state_keys(self) -> tuple[str, ...]:
        """The optimizer state keys saved beside the masters (none before the first step)."""
        keys = {k.split(".", 1)[1] for k in self.file_of(0, self.prefer_dp).tensors}
        return tuple(sorted(keys - {"master"}))

    # ---- planning

    def _split_dp(self, plan: dict, t: int, name: str, key: str, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Queue saved-local elements ``[lo, hi)`` of ``name``'s saved shard index ``t`` for ``dest``."""
        loc = self.where(t).get(name)
        if loc is None:
            raise CheckpointError(f"{self.directory}: no file holds shard {t} of {name}; the checkpoint is incomplete")
        g, files = loc.group, self.stages[loc.pp]

        def holder(d: int) -> tuple[str, int]:
            if loc.uniform:
                return files[(t, d)], loc.gi
            if d not in loc.holders:
                raise CheckpointError(f"{self.directory}: no file holds partition {d} of {name} (shard {t}); "
                                      "the checkpoint is incomplete")
            return loc.holders[d]

        a, b = loc.slot["offset"] + lo, loc.slot["offset"] + hi
        if g["partitions"] == 1:  # ZeRO-0: every rank holds the whole group; read the preferred one
            fname, gi = holder(self.prefer_dp if loc.uniform else 0)
            plan.setdefault(fname, []).append((f"g{gi}.{key}", a, b, dest))
            return
        sn = g["shard_numel"]
        for d in range(a // sn, (b - 1) // sn + 1):
            x, y = max(a, d * sn), min(b, (d + 1) * sn)
            fname, gi = holder(d)
            plan.setdefault(fname, []).append((f"g{gi}.{key}", x - d * sn, y - d * sn, dest[x - a:y - a]))

    def plan(self, plan: dict, name: str, key: str, local_shape: list[int], tp_sharded: bool, dim: int,
             stride: int, rank: int, world: int, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Queue the elements ``[lo, hi)`` of the flattened local shard ``(rank, world)`` of
        ``name`` (a tp=1 shape when ``world == 1``) for ``dest`` (1-D, ``hi - lo`` elements).
        The saved side is cut as it was saved: in the slot's own world of shards."""
        saved = self.slot(name)
        full = list(local_shape)
        if tp_sharded:
            full[dim] *= world
        if full != self.full_shape(name):
            raise CheckpointError(f"{name}: the checkpoint holds shape {tuple(self.full_shape(name))} (tp=1), the model "
                                  f"{tuple(full)}; was the model configured differently?")
        sworld = self.saved_world(name)
        split = saved["tp_sharded"] and sworld > 1  # saved in several shards
        sdim, sstride = (saved["partition_dim"], saved["partition_stride"]) if split else (dim, stride)
        # A whole saved tensor: a TP-sharded one saved at world 1 is shard 0; a TP-replicated one is
        # read from the requester's TP rank's copy, most often its own file.
        whole = 0 if saved["tp_sharded"] else rank % self.tp_size
        same = not split and (not tp_sharded or world == 1)
        same = same or (split and tp_sharded and world == sworld and (sdim, sstride) == (dim, stride))
        if same:
            self._split_dp(plan, rank if split else whole, name, key, lo, hi, dest)
            return
        idx = torch.arange(lo, hi, dtype=torch.long)
        fidx = _local_to_full(idx, full, dim, stride, rank, world) if tp_sharded and world > 1 else idx
        if split:
            owner, loc = _full_to_local(fidx, full, sdim, sstride, sworld)
        else:
            owner, loc = torch.full_like(fidx, whole), fidx
        pos = idx - lo
        for t in torch.unique(owner).tolist():
            mask = owner == t
            for s0, d0, n in _runs(loc[mask], pos[mask]):
                self._split_dp(plan, t, name, key, s0, s0 + n, dest[d0:d0 + n])

    def execute(self, plan: dict) -> None:
        for name, requests in plan.items():
            self._open(name).read(requests)
        plan.clear()

    # ---- whole tensors (export, inference)

    def full(self, name: str, key: str = "master") -> torch.Tensor:
        """The full (tp=1) fp32 tensor of ``name``."""
        return self.tp_shard(name, 0, 1, key)

    def tp_shard(self, name: str, rank: int, world: int, key: str = "master") -> torch.Tensor:
        """TP rank ``rank`` of ``world``'s shard of ``name``, reading only its elements."""
        s = self.slot(name)
        shape = self.full_shape(name)
        sharded = s["tp_sharded"] and world > 1
        if sharded:
            shape[s["partition_dim"]] //= world
        out = torch.empty(shape, dtype=torch.float32)
        plan: dict = {}
        self.plan(plan, name, key, shape, sharded, s["partition_dim"], s["partition_stride"], rank, world, 0,
                  out.numel(), out.view(-1))
        self.execute(plan)
        return out


def read_full_parameters(directory: str, names: Optional[list[str]] = None,
                         manifest: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights (tp=1 names and shapes) from a sharded checkpoint (all in memory: small models only;
    :func:`iter_full_parameters` streams)."""
    return dict(iter_full_parameters(directory, names, manifest))


def iter_full_parameters(directory: str, names: Optional[list[str]] = None,
                         manifest: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full fp32 tensor)`` one at a time: peak memory is one full tensor."""
    reader = CheckpointReader(directory, manifest)
    for n in names or reader.names:
        yield n, reader.full(n)


def _template(name: str) -> str:
    """``name`` with its indices blanked: ``layers.#.mlp.experts.#.linear_fc1.weight``."""
    return re.sub(r"\d+", "#", name)


def _held_elsewhere(engine: ZeroEngine, names: list[str]) -> set[str]:
    """Those of ``names`` that may belong to another rank's share of a group this rank partitions over a
    group of its own (experts saved where one rank held them all, loaded where each holds some): they
    have the shape of such a name of this rank's."""
    own = {_template(s.name) for g in engine.groups if g.part.name != "dp" for s in g.slots}
    return {n for n in names if _template(n) in own} if own else set()


@torch.no_grad()
def read_zero_state(engine: ZeroEngine, directory: str, manifest: Optional[dict] = None,
                    counter: Optional[ReadCounter] = None, *, load_optimizer: bool = True,
                    partial_model: bool = False) -> dict:
    """Collective-free part of a load: fill this rank's fp32 masters and optimizer state from ``directory``.

    Reads only the saved elements that this rank owns under its own layout. Returns the
    saved metadata, with ``bytes_read`` and ``files_read`` of this rank added. Follow with
    :func:`publish_loaded_state` (a collective) before using the engine. A pipeline stage
    (its engine names parameters as at pp = 1) passes ``partial_model=True``: it holds part
    of the saved names, and its copy of the tied embedding loads from the embedding itself.
    ``load_optimizer=False`` (Megatron's ``--finetune`` / ``--no-load-optim``) reads the weights
    only: the optimizer starts afresh, whatever optimizer saved the checkpoint.
    """
    reader = CheckpointReader(directory, manifest, prefer_dp=engine.dp_rank, counter=counter)
    mine = {s.name for g in engine.groups for s in g.slots}
    saved = set(reader.names)
    missing, unexpected = sorted(mine - saved), sorted(saved - mine)
    if partial_model:
        unexpected = []  # a pipeline stage holds part of the model; the other stages load the rest
    else:  # experts: each rank holds those of its own group
        elsewhere = reader.own_group_names() | _held_elsewhere(engine, unexpected)
        unexpected = [n for n in unexpected if n not in elsewhere]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    meta = dict(reader.first_meta)
    wanted, saved_keys = engine.state_keys(), reader.state_keys()
    if not load_optimizer:
        saved_keys = ()
    if saved_keys and set(saved_keys) != set(wanted):
        raise CheckpointError(f"{directory} holds optimizer state {list(saved_keys)}, this run's "
                              f"{engine.config.optimizer.type} keeps {list(wanted)}: it was saved with another "
                              "optimizer (or SGD momentum on/off); resume with the optimizer that saved it, or "
                              "switch optimizers with --no-load-optim (the weights load, the state starts afresh)")
    for g in engine.groups:
        keys = ("master",) + (engine.state_keys(g) if saved_keys else ())
        bufs = {"master": g.master, **engine.optimizer_state_buffers(g, keys[1:])}
        # One DP partition at a time: the CPU staging memory is one group's partition.
        stage = {k: torch.zeros(g.shard_numel, dtype=torch.float32) for k in keys}
        plan: dict = {}
        for s in g.slots:
            p0, s0, n = g.owned_range(s)
            if not n:
                continue
            p = s.param
            rank, world = tp_shard_of(p, engine.tp_rank, engine.tp_size)
            for key in keys:
                reader.plan(plan, s.name, key, list(s.shape), is_tp_sharded(p),
                            int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1)),
                            rank, world, p0, p0 + n, stage[key][s0:s0 + n])
        reader.execute(plan)
        for key in keys:
            bufs[key].copy_(stage[key])
    if len(keys) > 1:  # after the moments: written where this run's kernel keeps it, whoever saved it
        set_optimizer_step(engine.optimizer, int(meta["optimizer_step"]))
    meta["bytes_read"] = reader.counter.bytes
    meta["files_read"] = len(reader.counter.files)
    return meta


@torch.no_grad()
def publish_loaded_state(engine: ZeroEngine, meta: dict, *, initial_scale_on_precision_change: bool = True) -> Optional[str]:
    """Collective part of a load: masters -> compute-dtype parameters (all-gathered over DP where
    replicated), loss scaler and counters. Returns a note when the loss scaler was not restored."""
    engine.publish_params()  # also drops gathered copies of the old values
    note = None
    saved_precision = meta.get("precision")
    mine = str(engine.compute_dtype).replace("torch.", "")
    if saved_precision is not None and saved_precision != mine and initial_scale_on_precision_change:
        note = (f"the checkpoint was saved in {saved_precision}, this run uses {mine}: the loss scaler starts from "
                f"its configured initial scale ({engine.loss_scaler.scale:g}) instead of the saved one")
    else:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    counters = meta["engine"]
    engine.global_steps, engine.skipped_steps = counters["global_steps"], counters["skipped_steps"]
    engine.micro_steps = 0  # checkpoints are taken at accumulation boundaries
    return note


def load_zero_state(engine: ZeroEngine, directory: str, manifest: Optional[dict] = None) -> dict:
    """Load masters, optimizer state and the loss scaler into ``engine``, whatever layout saved them
    (collective over the engine's groups). Returns the saved metadata (+ ``bytes_read``)."""
    meta = read_zero_state(engine, directory, manifest)
    meta["scaler_note"] = publish_loaded_state(engine, meta)
    return meta



@torch.no_grad()
def load_full_weights_file(engine: ZeroEngine, source: Any, *, master: Optional[Any] = None,
                           moments: Optional[dict[str, Any]] = None, step: Optional[int] = None,
                           where: Optional[str] = None) -> None:
    """Set every parameter from full (tp=1-named) weights, reading only this rank's rows: its DP partition
    of its TP shard with ZeRO-3, its TP shard where the group keeps full compute parameters. ``source``: the
    path of a safetensors state dict (``model_full.safetensors``) or a source with safetensors' ``keys()`` /
    ``get_slice()`` (a torch_dist checkpoint's ``MegatronDistSource``); ``master`` and ``moments``
    (``exp_avg``... -> source) the fp32 masters and optimizer state from their own sources, with the
    optimizer's ``step`` (:func:`~megazero.zero.source_load.load_from_sources`). Collective-free."""
    from .source_load import load_from_sources, open_safetensors

    if isinstance(source, (str, os.PathLike)):
        where, source = where or str(source), open_safetensors(str(source))
    load_from_sources(engine, source, where=where or type(source).__name__, master=master, moments=moments, step=step)
