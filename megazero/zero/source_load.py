"""Full (tp = 1-named) weights and optimizer state into a ZeRO engine from a *source*, reading only a rank's share.

A source is anything with safetensors' reading interface: ``keys()`` and ``get_slice(name)``, an object with
``get_shape()`` and ``[index]`` (slices of the full tensor, reading only what they touch). safetensors'
``safe_open`` is one (``model_full.safetensors``); a view of a Megatron-LM torch_dist checkpoint in megazero's
names (``megazero.model.interop.megatron_dist.MegatronDistSource``) another, one per copy of the model's
tensors (the weights, the fp32 master, each Adam moment).

Each rank reads, for every parameter, the rows holding its DP partition of its TP shard (ZeRO-3), or its
whole TP shard where the group keeps full compute parameters; the moments and the master only for the
partition it owns. Nothing here communicates.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from ..mpu.sharding import is_tp_sharded, tp_shard_of
from .optim import set_optimizer_step
from .shard_io import CheckpointError

__all__ = ["open_safetensors", "load_from_sources", "read_local_rows"]


def open_safetensors(path: str) -> Any:
    """safetensors' lazy reader of ``path``: a source; CheckpointError when it is not a readable file."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises several types for bad headers/sizes
        raise CheckpointError(f"cannot read {path}: {e} (truncated or not a safetensors file?)") from None


def read_local_rows(sl: Any, full_shape: list[int], sharded: bool, dim: int, stride: int, rank: int, world: int,
                    lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` (fp32) of the flattened TP shard ``(rank, world)`` of a source's slice handle
    ``sl`` (full shape ``full_shape``), reading only the rows (dim 0) that hold them."""
    local = list(full_shape)
    if sharded:
        local[dim] //= world
    row = math.prod(local[1:])
    r0, r1 = lo // row, -(-hi // row)
    if not sharded:
        rows = sl[r0:r1]
    elif dim == 0:
        blk = full_shape[0] // (stride * world)
        pieces = []
        for s in range(stride):
            a, b = max(r0, s * blk), min(r1, (s + 1) * blk)
            if a < b:
                base = (s * world + rank) * blk
                pieces.append(sl[base + a - s * blk:base + b - s * blk])
        rows = torch.cat(pieces)
    elif dim == len(full_shape) - 1:
        blk = full_shape[dim] // (stride * world)
        rows = torch.cat([sl[r0:r1, (s * world + rank) * blk:(s * world + rank + 1) * blk] for s in range(stride)],
                         dim=-1)
    else:  # a middle partition dim (no such parameter in megazero's models): read the rows whole
        from ..mpu.sharding import shard_of_full

        rows = shard_of_full(sl[r0:r1], dim, stride, rank, world)
    return rows.reshape(-1)[lo - r0 * row:hi - r0 * row].float()


class _Slot:
    """One parameter's place in its source and on this rank: TP split and the shape check."""

    def __init__(self, engine, s, source: Any, where: str) -> None:
        sl = source.get_slice(s.name)
        self.full_shape = list(sl.get_shape())
        p = s.param
        self.rank, self.world = tp_shard_of(p, engine.tp_rank, engine.tp_size)
        self.sharded = is_tp_sharded(p) and self.world > 1
        self.dim, self.stride = int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1))
        local = list(self.full_shape)
        if self.sharded:
            local[self.dim] //= self.world
        if local != list(s.shape):
            raise CheckpointError(f"{where}: {s.name} has shape {tuple(self.full_shape)}, which gives {tuple(local)} "
                                  f"on this rank; the model has {tuple(s.shape)}: was it configured differently?")

    def read(self, source: Any, name: str, lo: int, hi: int) -> torch.Tensor:
        return read_local_rows(source.get_slice(name), self.full_shape, self.sharded, self.dim, self.stride,
                               self.rank, self.world, lo, hi)


def _check_names(engine, sources: Mapping[str, Any], where: str, groups: Optional[list] = None) -> None:
    wanted = {s.name for g in (engine.groups if groups is None else groups) for s in g.slots}
    for what, source in sources.items():
        missing = sorted(wanted - set(source.keys()))
        if missing:
            raise CheckpointError(f"{where} lacks the {what} of {missing[:8]}"
                                  + (": it was made for another model shape" if what == "weights" else ""))


@torch.no_grad()
def load_from_sources(engine, weights: Any, *, where: str, master: Optional[Any] = None,
                      moments: Optional[Mapping[str, Any]] = None, step: Optional[int] = None) -> None:
    """Set every parameter of ``engine`` from the source ``weights`` (``where`` names it in errors), reading
    only this rank's rows. ``master``: the fp32 masters' own source (then the compute copies are made from
    them and ``weights`` is not read); ``moments``: optimizer state key (``exp_avg``...) -> its source,
    loaded into the optimizer's state for the partition this rank owns, the step count set to ``step``.
    Collective-free; the engine's gathered copies are dropped."""
    values_from = master if master is not None else weights
    moments = dict(moments or {})
    _check_names(engine, {"weights": values_from}, where)
    for key, source in moments.items():  # each state key, for the masters whose optimizer keeps it
        _check_names(engine, {key: source}, where, [g for g in engine.groups if key in engine.state_keys(g)])
    for g in engine.groups:
        kept = {key: source for key, source in moments.items() if key in engine.state_keys(g)}
        bufs = engine.optimizer_state_buffers(g, tuple(kept))
        for s in g.slots:
            slot = _Slot(engine, s, values_from, where)
            p0, s0, n = g.owned_range(s)
            if g.resident:
                g.load_param_values(s, slot.read(values_from, s.name, 0, s.numel).view(s.shape))
            elif n:
                values = slot.read(values_from, s.name, p0, p0 + n)
                g.master[s0:s0 + n].copy_(values)
                if g.master is not g.shard:
                    g.shard[s0:s0 + n].copy_(values)
            for key, source in kept.items():
                if n:
                    bufs[key][s0:s0 + n].copy_(slot.read(source, s.name, p0, p0 + n))
        if g.resident:
            g.bind_views()
    if moments and step is not None:  # after the moments: written where this run's kernel keeps it
        set_optimizer_step(engine.optimizer, int(step))
    engine.release_gathered()
