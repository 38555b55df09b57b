"""Flat parameter groups: the storage unit of the ZeRO engine.

A :class:`FlatGroup` lays a list of parameters end to end in one 1-D buffer,
padded to a multiple of the data-parallel size, so that rank ``r`` of the DP
group owns the contiguous slice ``[r * shard, (r + 1) * shard)``. Every
parameter (and its gradient) is a view into the full buffer while the buffer
exists; with ZeRO-3 the full buffer exists only while the group is gathered.

Everything here is local to one TP rank: the parameters are TP shards already,
so the DP partition splits each TP shard again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["ParamSlot", "FlatGroup"]


@dataclasses.dataclass
class ParamSlot:
    name: str
    param: torch.nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


class FlatGroup:
    """Parameters of one unit and one weight-decay class, flattened and DP-partitioned.

    ``partitions`` is the number of DP ranks the optimizer state is split over
    (1 for ZeRO-0). ``resident`` groups keep the full compute-dtype buffer for the
    whole run (ZeRO 0-2, and ZeRO-3's small persistent parameters).
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        *,
        partitions: int,
        rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        resident: bool,
        weight_decay: bool,
    ) -> None:
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(ParamSlot(name, p, p.shape, offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.partitions, self.rank = partitions, rank
        self.padded_numel = -(-offset // partitions) * partitions
        self.shard_numel = self.padded_numel // partitions
        self.shard_start = rank * self.shard_numel
        self.compute_dtype, self.device = compute_dtype, device
        self.resident, self.weight_decay = resident, weight_decay
        self.full: Optional[torch.Tensor] = None  # [padded_numel] compute dtype, while gathered
        self.shard: torch.Tensor  # [shard_numel] compute dtype (a view of `full` when resident)
        self.master: torch.Tensor  # [shard_numel] fp32 (aliases `shard` when compute is fp32)

    # ---- construction ------------------------------------------------------------------

    def allocate(self) -> None:
        """Create the (zeroed) buffers; parameters are bound to them later by the caller."""
        if self.resident:
            self.full = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            self.shard = self.full.narrow(0, self.shard_start, self.shard_numel)
        else:
            self.shard = torch.zeros(self.shard_numel, dtype=self.compute_dtype, device=self.device)
        if self.compute_dtype == torch.float32:
            self.master = self.shard
        else:
            self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)

    def owned_range(self, slot: ParamSlot) -> tuple[int, int, int]:
        """``(start_in_param, start_in_shard, length)`` of the part of ``slot`` this rank owns."""
        lo = max(slot.offset, self.shard_start)
        hi = min(slot.offset + slot.numel, self.shard_start + self.shard_numel)
        if hi <= lo:
            return 0, 0, 0
        return lo - slot.offset, lo - self.shard_start, hi - lo

    @torch.no_grad()
    def load_param_values(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Write a parameter's full local value: its owned part into the fp32 master
        and compute shard, and into the full buffer when resident."""
        flat = value.detach().reshape(-1)
        p0, s0, n = self.owned_range(slot)
        if n:
            self.master[s0:s0 + n].copy_(flat[p0:p0 + n])
            if self.master is not self.shard:
                self.shard[s0:s0 + n].copy_(flat[p0:p0 + n])
        if self.resident:
            self.full[slot.offset:slot.offset + slot.numel].copy_(flat)

    # ---- gather / release (ZeRO-3) --------------------------------------------------------

    def bind_views(self) -> None:
        for s in self.slots:
            s.param.data = self.full.narrow(0, s.offset, s.numel).view(s.shape)

    def release(self) -> None:
        """Drop the full buffer; parameters keep an empty placeholder (and their shape in ``ds_shape``)."""
        if self.resident:
            return
        self.full = None
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty
            s.param.ds_shape = s.shape

    # ---- views --------------------------------------------------------------------------

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a full flat tensor laid out like this group."""
        return {s.name: flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots}

    def flatten_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """The group's gradients as one padded flat tensor (missing grads count as zero)."""
        out = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        for s in self.slots:
            if s.param.grad is not None:
                out.narrow(0, s.offset, s.numel).copy_(s.param.grad.reshape(-1))
        return out

    def norm_ranges(self, count_replicated: bool, count_any: bool) -> list[tuple[int, int]]:
        """Ranges of this rank's shard whose squared gradients enter the global norm.

        TP-replicated parameters hold the same gradient on every TP rank, so only
        TP rank 0 counts them (``count_replicated``); without DP partitioning
        (ZeRO-0) only DP rank 0 counts anything (``count_any``).
        """
        if not count_any:
            return []
        ranges = []
        for s in self.slots:
            if not count_replicated and not getattr(s.param, "tensor_model_parallel", False):
                continue
            _, s0, n = self.owned_range(s)
            if n:
                ranges.append((s0, s0 + n))
        return ranges
