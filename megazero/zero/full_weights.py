"""Full (unpartitioned, tp = 1-shaped) weights in and out of a ZeRO engine.

Functions of a :class:`megazero.zero.engine.ZeroEngine` (its methods of the same names call them),
apart so the engine file stays about the step: loading a full checkpoint or pretrained weights
(each rank keeps its TP shard's partition, no communication) and assembling the full fp32 masters
or Adam moments (collective over each group's partitioning, then TP).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..mpu.sharding import full_from_shards, is_tp_sharded, shard_of_full, tp_shard_group_of, tp_shard_of

__all__ = ["tp_local", "load_full_weights", "full_master_tensors", "consolidated_state_dict"]


def tp_local(engine, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, a tp=1-shaped value of ``param`` (or of its optimizer state):
    the parameter's own shard (:func:`~megazero.mpu.sharding.tp_shard_of`), by default its TP shard."""
    if not is_tp_sharded(param):
        return full
    rank, world = tp_shard_of(param, engine.tp_rank, engine.tp_size)
    if world == 1:
        return full
    return shard_of_full(full, param.partition_dim, getattr(param, "partition_stride", 1), rank, world)


@torch.no_grad()
def load_full_weights(engine, full: Callable[[str], torch.Tensor]) -> None:
    """Set every parameter (fp32 master and compute copy) from its full, tp=1-shaped value.

    ``full(name)`` returns the full tensor of parameter ``name``; each rank keeps its
    TP shard's DP partition. No communication. Raises ValueError on a shape mismatch.
    """
    for g in engine.groups:
        for s in g.slots:
            value = full(s.name)
            local = tp_local(engine, s.param, value)
            if tuple(local.shape) != tuple(s.shape):
                raise ValueError(f"{s.name}: full shape {tuple(value.shape)} gives {tuple(local.shape)} on this rank, "
                                 f"the model has {tuple(s.shape)}; was the model configured differently?")
            g.load_param_values(s, local)
    engine.release_gathered()  # drop gathered copies of the old values


@torch.no_grad()
def full_master_tensors(engine, which: str = "master") -> dict[str, torch.Tensor]:
    """Every parameter's value (fp32 master, or an Adam moment ``exp_avg``/``exp_avg_sq``)
    for this TP rank's shard, assembled over DP. Collective over the DP group."""
    out = {}
    for g in engine.groups:
        local = g.master if which == "master" else engine.optimizer.state.get(g.master, {}).get(which)
        if local is None:
            local = torch.zeros_like(g.master)
        full = torch.empty(g.padded_numel, dtype=torch.float32, device=engine.device)
        if g.partitions > 1:  # an offloaded master is on the host: collectives run on the device
            engine.comm.all_gather(full, local.to(engine.device, torch.float32).contiguous(), g.part.name)
        else:
            full.copy_(local)
        out.update({k: v.clone() for k, v in g.unflatten(full).items()})
    return out


def _collect_own_groups(engine, out: dict[str, torch.Tensor]) -> None:
    """Add to ``out`` the parameters of own-group partitionings that other ranks of the stage hold (an
    object all-gather over data parallel, then over tensor parallel: small models only, as the rest)."""
    own = {s.name for g in engine.groups if g.part.name != "dp" for s in g.slots}
    if not own or not dist.is_initialized():  # every rank of a stage partitions alike: all return here, or none
        return
    for group in (engine.comm.groups["dp"], engine.tp_group):
        if group is None or dist.get_world_size(group) == 1:
            continue
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, {n: v for n, v in out.items() if n in own}, group=group)
        for part in parts:
            for n, v in part.items():
                out.setdefault(n, v)
                own.add(n)


@torch.no_grad()
def consolidated_state_dict(engine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full, unsharded fp32 weights with the keys of a tp=1 model (collective).

    Returned on global rank 0 only unless ``rank0_only=False``. A TP-sharded parameter is gathered
    over its own shard group (by default the TP group); parameters partitioned over a group of their own
    (experts, each held by some ranks of the stage) are collected from the data- and tensor-parallel
    ranks, so every rank returns its stage's whole model.
    """
    local = full_master_tensors(engine, "master")
    out = {}
    for name, value in local.items():
        g, slot = engine._slot_by_name[name]
        p = slot.param
        world = tp_shard_of(p, engine.tp_rank, engine.tp_size)[1] if is_tp_sharded(p) else 1
        if world > 1:
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value.contiguous(), group=tp_shard_group_of(p, engine.tp_group))
            value = full_from_shards(parts, p.partition_dim, getattr(p, "partition_stride", 1))
        out[name] = value.cpu()
    primary = {p: n for n, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if name != primary[p] and p in engine.slot_of:  # a shared weight under its other names
            out.setdefault(engine.param_name(name), out[engine.slot_of[p][1].name])
    for name, b in engine.module.named_buffers():
        out.setdefault(engine.param_name(name), b.detach().cpu().clone())
    _collect_own_groups(engine, out)
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out
