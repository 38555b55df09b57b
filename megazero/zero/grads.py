"""Gradient stores: where a ZeRO engine's gradients accumulate and how they are reduced.

The engine chooses one store when it is built (the stage is a choice of strategy, not a branch
in the step):

* :class:`FullGradients` (ZeRO-0, ZeRO-1, and ZeRO-3 with ``stage3_keep_gathered_in_step``):
  every micro-batch's gradients are added into a full-size buffer per flat group
  (``FlatGroup.grad_full``, fp32 under bf16); at the accumulation boundary ZeRO-0 all-reduces
  it and ZeRO-1 reduce-scatters it, each rank keeping its partition (``grad_shard``).
* :class:`ShardedGradients` (ZeRO-2/3): each unit's gradients leave autograd's buffers as soon
  as the unit's backward is complete, reduce-scattered in buckets (``reducer.py``) and added
  into the rank's partition; nothing full-size outlives a backward.

Either way each group is reduced over its own partitioning (``partitioning.py``): within
``shard``, then, once per step, across ``replicate``. Gradients stay scaled (loss scale,
predivide) until the step divides them.
"""

from __future__ import annotations

import torch

from .comm import CommCounter, grads_channel
from .flat import FlatGroup, ParamSlot, fill_range, storage_key
from .reducer import GradReducer
from .units import Unit

__all__ = ["GradientStore", "FullGradients", "ShardedGradients", "build_gradient_store"]


class GradientStore:
    """What the engine asks of a store (see the module docstring)."""

    def __init__(self, groups: list[FlatGroup], comm: CommCounter, *, grad_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device: torch.device, predivide: float) -> None:
        self.groups, self.comm = groups, comm
        self.grad_dtype, self.reduce_dtype, self.device = grad_dtype, reduce_dtype, device
        self.predivide = predivide  # DeepSpeed's gradient_predivide_factor, undone by the step

    def on_grad(self, group: FlatGroup, slot: ParamSlot, param: torch.Tensor) -> None:
        """``param.grad`` of ``slot`` is complete for this backward."""
        raise NotImplementedError

    def add(self, group: FlatGroup, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Add a gradient that arrived outside autograd (already carrying the loss scale)."""
        raise NotImplementedError

    def begin_backward(self, record) -> None:
        """A backward starts, following ``record`` (the agreed forward, ``agreement.py``)."""

    def end_backward(self) -> None:
        """A backward ended: whatever it started is complete when this returns."""

    def reduce(self) -> None:
        """At the accumulation boundary: finish each group's reduction over its partitioning."""
        for g in self.groups:
            if g.part.replicas > 1:
                self.comm.all_reduce(self.local(g), g.part.replicate_name)

    def local(self, group: FlatGroup) -> torch.Tensor:
        """The reduced gradient this rank steps ``group`` with: its partition (ZeRO 1-3) or the whole."""
        return group.grad_shard

    def zero(self) -> None:
        for g in self.groups:
            for buf in (g.grad_full, g.grad_shard):
                if buf is not None:
                    buf.zero_()

    def nbytes(self) -> int:
        """Bytes of gradient buffers this store keeps for the whole run."""
        seen, total = set(), 0
        for g in self.groups:
            for buf in (g.grad_full, g.grad_shard):
                if buf is not None and storage_key(buf) not in seen:  # ZeRO-1's shard is a view of grad_full
                    seen.add(storage_key(buf))
                    total += buf.untyped_storage().nbytes()
        return total


class FullGradients(GradientStore):
    """Full-size accumulation; reduced once per step (ZeRO-0: all-reduce; partitioned: reduce-scatter)."""

    def __init__(self, groups: list[FlatGroup], comm: CommCounter, *, partition_in_place: bool, **kw) -> None:
        super().__init__(groups, comm, **kw)
        for g in groups:
            g.grad_full = torch.zeros(g.padded_numel, dtype=self.grad_dtype, device=self.device)
            if g.partitions > 1:
                # ZeRO-1 keeps the reduced partition in the full buffer's own slice; the keep-gathered
                # ZeRO-3 policy gives it a buffer of its own, as the sharded stores do.
                g.grad_shard = (g.grad_full.narrow(0, g.shard_start, g.shard_numel) if partition_in_place
                                else torch.zeros(g.shard_numel, dtype=self.grad_dtype, device=self.device))

    def on_grad(self, group: FlatGroup, slot: ParamSlot, param: torch.Tensor) -> None:
        # Accumulated locally (fp32 for bf16); communication waits for the accumulation boundary.
        group.grad_full.narrow(0, slot.offset, slot.numel).add_(param.grad.reshape(-1))
        param.grad = None

    def add(self, group: FlatGroup, slot: ParamSlot, grad: torch.Tensor) -> None:
        group.grad_full.narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1).to(self.grad_dtype))

    def reduce(self) -> None:
        for g in self.groups:
            if self.predivide != 1.0:
                g.grad_full.div_(self.predivide)
            if g.partitions == 1:
                self.comm.all_reduce(g.grad_full, g.part.name)
            else:
                out = torch.empty_like(g.grad_shard)
                self.comm.reduce_scatter(out, g.grad_full, g.part.name)
                g.grad_shard.copy_(out)
        super().reduce()

    def local(self, group: FlatGroup) -> torch.Tensor:
        return group.grad_full if group.partitions == 1 else group.grad_shard


class ShardedGradients(GradientStore):
    """Per-unit reduce-scatter during backward into each group's partition (ZeRO-2/3)."""

    def __init__(self, groups: list[FlatGroup], comm: CommCounter, units: list[Unit], *, bucket_numel: int,
                 max_in_flight: int, overlap: bool, **kw) -> None:
        super().__init__(groups, comm, **kw)
        for g in groups:
            g.grad_shard = torch.zeros(g.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.reducer = GradReducer(
            units,
            reduce_scatter=lambda out, full, part: comm.reduce_scatter(out, full, part.name, async_op=overlap,
                                                                       via=grads_channel(part)),
            reduce_dtype=self.reduce_dtype, device=self.device, bucket_numel=bucket_numel,
            max_in_flight=max_in_flight, predivide=self.predivide)

    def on_grad(self, group: FlatGroup, slot: ParamSlot, param: torch.Tensor) -> None:
        self.reducer.grad_ready(group.unit)

    def add(self, group: FlatGroup, slot: ParamSlot, grad: torch.Tensor) -> None:
        # Written straight into a bucket in the reduction dtype (fp32 by default under bf16): the
        # contribution is summed in the precision every other gradient is, and pre-divided like them.
        buf = torch.zeros(group.partitions, group.shard_numel, dtype=self.reduce_dtype, device=self.device)
        fill_range(buf, slot.offset, slot.offset + slot.numel, group.shard_numel,
                   grad.reshape(-1).to(self.reduce_dtype))
        if self.predivide != 1.0:
            buf.div_(self.predivide)
        out = torch.empty(group.shard_numel, dtype=self.reduce_dtype, device=self.device)
        self.comm.reduce_scatter(out, buf.view(-1), group.part.name)
        group.grad_shard.add_(out)

    def begin_backward(self, record) -> None:
        self.reducer.used, self.reducer.used_here = record.used, record.used_here

    def end_backward(self) -> None:
        self.reducer.finish()


def build_gradient_store(stage: int, hold: bool, zc, groups: list[FlatGroup], comm: CommCounter, units: list[Unit],
                         **common) -> GradientStore:
    """The store of a stage: full-size for ZeRO 0-1 and for ZeRO-3 kept gathered in step (``hold``), per-unit
    reduce-scatters otherwise; ``zc`` is the ``zero_optimization`` config, ``common`` the stores' keywords."""
    if stage <= 1 or hold:
        return FullGradients(groups, comm, partition_in_place=stage == 1, **common)
    return ShardedGradients(groups, comm, units, bucket_numel=zc.reduce_bucket_size or 1,
                            max_in_flight=zc.max_reduce_in_flight, overlap=zc.overlap_comm, **common)


