"""Flat parameter groups: the storage unit of the ZeRO engine.

A :class:`FlatGroup` lays a list of parameters end to end in one 1-D buffer,
padded to a multiple of its partitioning's size (``partitioning.py``: the
data-parallel group by default), so that rank ``r`` of that group owns the
contiguous slice ``[r * shard, (r + 1) * shard)``. Every parameter is a view
into the full buffer. The group also carries its gradient buffers: the
full-size accumulation (``grad_full``, ZeRO 0-1) and this rank's reduced
partition (``grad_shard``), whichever the engine's gradient store uses.

ZeRO-3 keeps the full buffer *object* for the whole run but gives its storage
back (``untyped_storage().resize_(0)``) whenever the group is released, and
re-grows it in place for the next all-gather. Parameters therefore keep their
shapes, and everything that references them — above all the tensors autograd
saved for backward — costs nothing while released and sees the right values
again once the group is gathered (PyTorch FSDP2 frees its unsharded storage the
same way). Writing into the buffer does not bump the parameters' version
counters: ``param.data`` views carry their own.

Everything here is local to one TP rank: the parameters are TP shards already,
so the DP partition splits each TP shard again.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterator, Optional

import torch

from .partitioning import Partitioning

__all__ = ["ParamSlot", "FlatGroup", "storage_key", "squared_norm"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: the address of its C++ storage object, shared by every
    view, unchanged by ``resize_`` and unique among live storages. Not ``data_ptr()``: that
    changes when a released buffer is regrown, and fake or meta storages all have pointer 0."""
    return t.untyped_storage()._cdata


@dataclasses.dataclass
class ParamSlot:
    name: str
    param: torch.nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


class FlatGroup:
    """Parameters of one unit, one partitioning and one optimizer class, flattened and partitioned.

    ``part`` is the :class:`Partitioning` the group is reduced over; ``partitioned`` False
    keeps the whole group on every rank (ZeRO-0), so ``partitions`` is ``part.size`` or 1. ``resident``
    groups keep the full compute-dtype buffer allocated for the whole run (ZeRO 0-2, and ZeRO-3's small
    persistent parameters).
    ``trainable`` is False for frozen parameters (``requires_grad=False``): they
    are partitioned and gathered like the others but get no gradient buffer and
    never enter the optimizer, so weight decay cannot touch them. ``per_matrix`` groups hold
    parameters a per-matrix optimizer (Muon) updates whole (``megazero/zero/optimizers/muon_step.py``).
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        *,
        part: Partitioning,
        partitioned: bool = True,
        compute_dtype: torch.dtype,
        device: torch.device,
        resident: bool,
        weight_decay: bool,
        trainable: bool = True,
        per_matrix: bool = False,
    ) -> None:
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(ParamSlot(name, p, p.shape, offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.part = part
        self.partitions, self.rank = (part.size, part.rank) if partitioned else (1, 0)
        self.unit = None  # the units.Unit holding the group (it sets this)
        self.padded_numel = -(-offset // self.partitions) * self.partitions
        self.shard_numel = self.padded_numel // self.partitions
        self.shard_start = self.rank * self.shard_numel
        self.compute_dtype, self.device = compute_dtype, device
        self.resident, self.weight_decay, self.trainable = resident, weight_decay, trainable
        self.per_matrix = per_matrix  # stepped matrix by matrix (Muon: zero/optimizers/muon_step.py), not elementwise
        self.full: Optional[torch.Tensor] = None  # [padded_numel] compute dtype; storage empty while released
        self.shard: torch.Tensor  # [shard_numel] compute dtype (a view of `full` when resident)
        self.master: torch.Tensor  # [shard_numel] fp32 (aliases `shard` when compute is fp32)
        self.gathered = resident
        self.grad_full: Optional[torch.Tensor] = None  # [padded_numel] accumulated full gradient (ZeRO 0-1)
        self.grad_shard: Optional[torch.Tensor] = None  # [shard_numel] this rank's reduced partition (ZeRO 1-3)

    @property
    def full_bytes(self) -> int:
        return self.padded_numel * torch.empty((), dtype=self.compute_dtype).element_size()

    # ---- construction ------------------------------------------------------------------

    def allocate(self) -> None:
        """Create the buffers. Non-resident groups start released (the full buffer's storage
        is empty); parameters are bound to the full buffer later, by :meth:`bind`."""
        self.full = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        if self.resident:
            self.shard = self.full.narrow(0, self.shard_start, self.shard_numel)
        else:
            self.shard = torch.zeros(self.shard_numel, dtype=self.compute_dtype, device=self.device)
            self.full.untyped_storage().resize_(0)
        if self.compute_dtype == torch.float32:
            self.master = self.shard
        else:
            self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)

    def bind(self) -> None:
        """Make every parameter a view of the full buffer (views need storage to be created)."""
        if not self.resident:
            self.materialize_storage()
        self.bind_views()
        if not self.resident:
            self.release()

    def bind_views(self) -> None:
        for s in self.slots:
            s.param.data = self.full.narrow(0, s.offset, s.numel).view(s.shape)
            s.param.ds_shape = s.shape  # DeepSpeed's attribute, for code that looks for it

    def owned_range(self, slot: ParamSlot, partition: Optional[int] = None) -> tuple[int, int, int]:
        """``(start_in_param, start_in_shard, length)`` of the part of ``slot`` this rank owns, or the
        rank at ``partition`` of the group's partitioning (unpartitioned, every rank holds the whole)."""
        start = self.shard_start if partition is None or self.partitions == 1 else partition * self.shard_numel
        lo = max(slot.offset, start)
        hi = min(slot.offset + slot.numel, start + self.shard_numel)
        if hi <= lo:
            return 0, 0, 0
        return lo - slot.offset, lo - start, hi - lo

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

    def materialize_storage(self) -> None:
        """Give the full buffer its storage back (contents undefined until gathered into)."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full_bytes)

    def own_slice(self) -> torch.Tensor:
        """This rank's partition inside the full buffer. An all-gather sent from it runs in place:
        no full-size temporary (gloo allocates one for any other input and copies out of it; NCCL
        and FSDP2 gather in place too)."""
        return self.full.narrow(0, self.shard_start, self.shard_numel)

    def fill_own_slice(self) -> torch.Tensor:
        """The partition copied into :meth:`own_slice` (materialized): what a ZeRO-3 gather sends."""
        return self.own_slice().copy_(self.shard)

    def release(self) -> None:
        """Free the full buffer's storage; parameters keep their shapes (no-op when resident)."""
        if self.resident:
            return
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def storage_key(self) -> int:
        """The identity of the full buffer's storage (see :func:`storage_key`)."""
        return storage_key(self.full)

    def start_gather(self, all_gather: Callable[[torch.Tensor, torch.Tensor, "FlatGroup"], object],
                     source: Callable[["FlatGroup"], torch.Tensor]) -> object:
        """Regrow the full buffer and all-gather every partition into it over the group's partitioning:
        ``all_gather(full, source(self), self)``, whose work (or None when done) is returned."""
        self.materialize_storage()
        return all_gather(self.full, source(self), self)

    def publish(self, write_shard: Callable[["FlatGroup", int, torch.Tensor], None],
                all_gather: Callable[[torch.Tensor, torch.Tensor, str], object], written: bool = False) -> None:
        """After the fp32 master changed: copy it into the compute-dtype partition (``write_shard``,
        wherever that lives; not when already ``written``) and, resident, collect every rank's partition."""
        if self.master is not self.shard and not written:
            write_shard(self, 0, self.master)
        if self.resident and self.partitions > 1:
            # Every rank updated its partition only: collect the others, in place (the partition
            # is the full buffer's own slice: no temporary).
            all_gather(self.full, self.shard, self.part.name)

    # ---- gradients ----------------------------------------------------------------------

    def register_grad_hooks(self, on_grad: Callable[["FlatGroup", ParamSlot, torch.Tensor], None]) -> list:
        """Call the bound method ``on_grad(group, slot, param)`` once each parameter's gradient is
        accumulated in a backward. Returns the hook handles.

        The hooks live in the parameters' autograd metadata (C++), which Python's garbage collector
        cannot traverse: a strong reference there to anything that leads back to the parameter (this
        group does, and so does ``on_grad``'s owner) is a cycle nobody collects, and every engine a
        process ever built would stay alive with its buffers and process groups. Hence weak
        references and the slot's index; once either is gone the hooks do nothing."""
        # weakref.ref, not WeakMethod: dereferencing it is C, the hook runs for every parameter in every backward
        group_ref, owner_ref, func = weakref.ref(self), weakref.ref(on_grad.__self__), on_grad.__func__

        def hook_of(index: int):
            def hook(param: torch.Tensor) -> None:
                group, owner = group_ref(), owner_ref()
                if group is not None and owner is not None:
                    func(owner, group, group.slots[index], param)
            return hook

        return [s.param.register_post_accumulate_grad_hook(hook_of(i)) for i, s in enumerate(self.slots)]

    @torch.no_grad()
    def scale_rows(self, slot: ParamSlot, factors: torch.Tensor) -> None:
        """Multiply row ``r`` of ``slot``'s parameter (2-D) by ``factors[r]`` in the part of the fp32
        master this rank holds."""
        p0, s0, n = self.owned_range(slot)
        if n:
            cols = slot.numel // slot.shape[0]
            rows = torch.arange(p0, p0 + n, device=self.master.device) // cols
            self.master.narrow(0, s0, n).mul_(factors.to(self.master.device, torch.float32)[rows])

    # ---- views --------------------------------------------------------------------------

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a full flat tensor laid out like this group."""
        return {s.name: flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots}

    def grads_into(self, out: torch.Tensor) -> None:
        """Write the group's gradients into ``out`` ``[partitions, shard_numel]`` (any dtype,
        possibly a strided column block of a larger bucket) and drop them; missing
        gradients and padding are written as zeros."""
        rows = out
        covered = 0
        for s in self.slots:
            grad = s.param.grad
            lo, hi = s.offset, s.offset + s.numel
            if lo > covered:
                fill_range(rows, covered, lo, self.shard_numel, None)
            fill_range(rows, lo, hi, self.shard_numel, None if grad is None else grad.reshape(-1))
            covered = hi
            s.param.grad = None
        if covered < self.padded_numel:
            fill_range(rows, covered, self.padded_numel, self.shard_numel, None)

    def counts_in_norm(self) -> bool:
        """Whether this rank's copy of the group enters the global norm: the first replica only,
        and, unpartitioned (ZeRO-0), the partitioning's first rank only."""
        return self.part.replica_rank == 0 and (self.partitions > 1 or self.part.rank == 0)

    def norm_ranges(self, count_replicated: bool, count_any: Optional[bool] = None) -> list[tuple[int, int]]:
        """Ranges of this rank's shard whose squared gradients enter the global norm.

        TP-replicated parameters hold the same gradient on every TP rank, so only
        TP rank 0 counts them (``count_replicated``); copies held by other ranks of
        the partitioning count once (``count_any``, by default :meth:`counts_in_norm`).
        Parameters marked ``pipeline_shared_copy`` (a pipeline stage's copy of a tied
        weight) are counted by their owner only.
        """
        return [(s0, s0 + n) for _, _, s0, n in self.counted_slots(count_replicated, count_any)]

    def counted_slots(self, count_replicated: bool, count_any: Optional[bool] = None
                      ) -> Iterator[tuple[ParamSlot, int, int, int]]:
        """``(slot, start_in_param, start_in_shard, length)`` of each parameter range this rank owns and counts
        (:meth:`norm_ranges`' rule): over all ranks, every element of every parameter exactly once. What the
        norm sums and what a checkpoint that writes each element once writes."""
        if count_any is None:
            count_any = self.counts_in_norm()
        if not count_any:
            return
        for s in self.slots:
            if getattr(s.param, "pipeline_shared_copy", False):
                continue
            if not count_replicated and not getattr(s.param, "tensor_model_parallel", False):
                continue
            p0, s0, n = self.owned_range(s)
            if n:
                yield s, p0, s0, n


def fill_range(rows: torch.Tensor, lo: int, hi: int, width: int, src: Optional[torch.Tensor]) -> None:
    """Copy ``src`` (or zeros) into flat positions ``[lo, hi)`` of the row-major ``rows`` [N, width]
    (possibly a strided column block of a wider bucket).

    At most three copies whatever N: the partial first row, the full rows between as one strided
    copy, the partial last row (a copy per row made N kernel launches per parameter on a GPU)."""
    if hi <= lo:
        return
    r0, c0 = divmod(lo, width)
    r1, c1 = divmod(hi, width)

    def put(dst: torch.Tensor, a: int) -> None:
        if src is None:
            dst.zero_()
        else:
            dst.copy_(src[a:a + dst.numel()].view(dst.shape))

    if r0 == r1:
        put(rows[r0, c0:c1], 0)
        return
    pos = lo
    if c0:
        put(rows[r0, c0:], 0)
        pos += width - c0
        r0 += 1
    if r1 > r0:
        put(rows[r0:r1], pos - lo)
        pos += (r1 - r0) * width
    if c1:
        put(rows[r1, :c1], pos - lo)


def squared_norm(grads: dict[FlatGroup, torch.Tensor], *, tp_rank: int, device: torch.device) -> torch.Tensor:
    """Squared L2 norm of this rank's part of the model's gradient (still scaled), on the device.

    Summed over the data-parallel and model-parallel groups (the engine's step), each element of
    the model is counted exactly once: partitions are disjoint, copies are counted on their first
    replica only (:meth:`FlatGroup.counts_in_norm`), TP shards are disjoint, and TP-replicated
    parameters (norms, row-parallel biases) are counted on TP rank 0 only.

    One ``_foreach_norm`` over all ranges (multi-tensor kernels on CUDA), fp32 per range, squares
    summed in fp64. Elements another rank counts are still checked: their norm enters times 0, and
    0 * (inf or nan) is nan.
    """
    counted: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for g, t in grads.items():
        pos = 0
        for lo, hi in g.norm_ranges(count_replicated=tp_rank == 0):
            if lo > pos:
                others.append(t[pos:lo])
            counted.append(t[lo:hi])
            pos = hi
        if pos < t.numel():
            others.append(t[pos:])
    total = torch.zeros((), dtype=torch.float64, device=device)
    if counted:
        total += torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float32)).double().square().sum()
    if others:
        total += torch.stack(torch._foreach_norm(others, 2, dtype=torch.float32)).sum().double() * 0.0
    return total
