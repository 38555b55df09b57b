"""ZeRO-Infinity for parameters: ZeRO-3 partitions on the host or NVMe between their all-gathers.

What moves. At stage 3 each rank keeps, for every gathered (non-persistent) flat group, its
partition of the parameters in the compute dtype (``group.shard``) and all-gathers the full unit
from it when a layer needs it. With ``offload_param`` that partition lives in host memory
(``device: cpu``) or in one file per group under ``nvme_path`` (``device: nvme``; the first
``max_in_cpu`` elements in model order stay in host memory), so the accelerator holds, between
steps, only the gradient partition, the persistent small parameters and whatever the optimizer
keeps there. With ``offload_optimizer`` too, a mixed-precision run's accelerator holds 4 bytes
per element of its partition (the gradient) instead of 18, and fp32 training's host copy *is*
the host fp32 master (no second copy).

The gather. The partition is copied into the unit's full buffer at this rank's own slice (from
NVMe through ``buffer_count`` host buffers of ``buffer_size`` elements; unset, sized by
:func:`ring_bytes` to a small share of what is on NVMe), and the all-gather runs
in place from that slice (as FSDP2's does): no device staging beyond the full buffer, which the
gather needs anyway. Asynchronous when the host memory is pinned.

The step. Updated weights go back where the partition lives: the host copy, or the file
(plain ``pwrite`` through the same buffers). Whole-tensor access (checkpoint save and load,
pretrained weights) goes through ``group.shard`` as always: a host tensor, or a shared memory
map of the file, whose pages :meth:`ParamOffload.drop_pages` unmaps afterwards.

Exactness: only copies, so a run with parameter offload is bit-identical to the run without.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from .config import OffloadParamConfig
from .flat import FlatGroup
from .offload import ALIGN, DEFAULT_CHUNK, RING_SHARE, OffloadFiles, claim_directory, close_all, file_name
from .pinned import HostArena

__all__ = ["DEEPSPEED_BUFFER_SIZE", "ParamOffload", "ring_bytes"]

DEEPSPEED_BUFFER_SIZE = 100_000_000  # DeepSpeed's offload_param.buffer_size, in elements


def ring_bytes(on_nvme: list[int], elem: int, buffer_count: int, buffer_size: Optional[int]) -> int:
    """Bytes per NVMe buffer for partitions of ``on_nvme`` elements of ``elem`` bytes in files: at
    most the largest partition; ``buffer_size`` elements when given; else :data:`DEFAULT_CHUNK`
    elements (at most DeepSpeed's :data:`DEEPSPEED_BUFFER_SIZE`), lowered so that the
    ``buffer_count`` buffers hold at most :data:`RING_SHARE` of the bytes on NVMe (multiples of
    ``ALIGN`` elements, at least ALIGN). 0 when nothing is on NVMe."""
    if not on_nvme:
        return 0
    largest = max(on_nvme) * elem
    if buffer_size is not None:
        return min(largest, int(buffer_size) * elem)
    cap = int(sum(on_nvme) * RING_SHARE) // max(buffer_count, 1)  # elements
    return min(largest, max(ALIGN, min(DEFAULT_CHUNK, DEEPSPEED_BUFFER_SIZE, cap) // ALIGN * ALIGN) * elem)


class ParamOffload:
    """The parameter partitions of ``groups`` (ZeRO-3, non-resident) off the accelerator.

    ``masters_on_host``: the groups whose fp32 master already lives in host memory (the
    optimizer offload's ``cpu`` device); with fp32 compute their partition *is* that master.
    """

    def __init__(self, groups: list[FlatGroup], config: OffloadParamConfig, device: torch.device, *,
                 rank: int = 0, masters_on_host: frozenset = frozenset(),
                 say: Callable[[str], None] = lambda m: None) -> None:
        self.config, self.device = config, torch.device(device)
        self.groups = [g for g in groups if g.shard_numel and not g.resident]
        self._owned = set(self.groups)
        real = self.device.type != "meta"  # a rehearsal counts host and file bytes, allocates none
        self.files: dict[FlatGroup, OffloadFiles] = {}
        self.on_nvme: list[FlatGroup] = []  # groups whose partition is a file (or would be, rehearsed)
        self.aliased: set[FlatGroup] = set()  # fp32 groups whose host partition is the host master
        self._lock_fd: Optional[int] = None
        kept_on_device = 0
        if config.device == "nvme" and real:
            self.directory, self._lock_fd = claim_directory(config.nvme_path, rank, "params", key="offload_param")
        in_memory = config.max_in_cpu if config.device == "nvme" else float("inf")
        to_host: list[FlatGroup] = []  # groups whose partition moves to the host arena
        for g in self.groups:
            if g.compute_dtype == torch.float32 and g in masters_on_host:
                g.shard = g.master  # the optimizer's host master is the forward's weights
                self.aliased.add(g)
                continue
            if g.master is g.shard:  # fp32: the optimizer steps this master on the accelerator
                kept_on_device += g.shard_numel
            if g.shard_numel > in_memory:
                self.on_nvme.append(g)
                if real:
                    files = OffloadFiles(self.directory, file_name(g), g.shard_numel, ("param",), g.compute_dtype)
                    self.files[g] = files
                    files.write("param", 0, g.shard.detach().to("cpu").contiguous())
                    g.shard = files.tensors["param"]
                else:  # rehearsed: a stand-in for the file, outside the host arena
                    g.shard = torch.empty(g.shard_numel, dtype=g.compute_dtype, device="meta")
                continue
            in_memory -= g.shard_numel
            to_host.append(g)
        # NVMe reads and writes go through a ring of host buffers (bytes, whatever the dtype).
        elem = max([g.full.element_size() for g in self.on_nvme] or [1])
        self.chunk_bytes = ring_bytes([g.shard_numel for g in self.on_nvme], elem, config.buffer_count,
                                      config.buffer_size)
        count = config.buffer_count if self.on_nvme else 0
        # The host partitions and the ring in one allocation, sized exactly: pinning them one by one
        # would round each up to a power of two.
        requests = {("param", i): (g.shard_numel, g.compute_dtype, "params") for i, g in enumerate(to_host)}
        requests.update({("ring", i): (self.chunk_bytes, torch.uint8, "ring") for i in range(count)})
        self.arena = HostArena(requests, config.pin_memory, self.device)
        self.pinned = self.arena.pinned
        for i, g in enumerate(to_host):
            host = self.arena.views["param", i]
            host.copy_(g.shard.detach())
            g.shard = host
        self.ring: list[torch.Tensor] = [self.arena.views["ring", i] for i in range(count)]
        self._copies: list[Optional[torch.cuda.Event]] = [None] * count  # the last copy out of each buffer (CUDA)
        self._next = 0
        # Descriptors close when this object goes, released or not (see OptimizerOffload).
        self._closer = weakref.finalize(self, close_all, [f.fds for f in self.files.values()], self._lock_fd)
        if config.pin_memory and not self.pinned and real:
            say("offload_param: pin_memory was asked for but host memory cannot be pinned here (no CUDA driver, or "
                "the container limits locked memory); copies to and from the accelerator are synchronous")
        if kept_on_device and self.device.type != "cpu":
            say(f"offload_param: in fp32 the parameter partition is the optimizer's master, which steps on the "
                f"accelerator: {kept_on_device:,} elements stay there beside their host copy. Offload the "
                "optimizer too (offload_optimizer) to move them off")

    def owns(self, g: FlatGroup) -> bool:
        """Whether ``g``'s partition lives off the accelerator (its gathers go through :meth:`source`)."""
        return g in self._owned

    # ------------------------------------------------------------------ the gather

    def _slot(self, nbytes: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """The next ring buffer as ``nbytes`` of ``dtype``, once the copy that last read it is done."""
        i = self._next
        self._next = (i + 1) % len(self.ring)
        if self._copies[i] is not None:
            self._copies[i].synchronize()
            self._copies[i] = None
        return i, self.ring[i][:nbytes].view(dtype)

    def source(self, g: FlatGroup) -> torch.Tensor:
        """The tensor ``g``'s all-gather sends: this rank's slice of ``g.full`` (materialized),
        filled from the host copy or the file; the gather then runs in place."""
        dst = g.own_slice()
        files = self.files.get(g)
        if files is None:
            dst.copy_(g.shard, non_blocking=self.pinned)
            return dst
        step = max(1, self.chunk_bytes // files.elem)
        for lo in range(0, g.shard_numel, step):
            hi = min(lo + step, g.shard_numel)
            i, buf = self._slot((hi - lo) * files.elem, g.compute_dtype)
            files.read("param", lo, buf)
            dst[lo:hi].copy_(buf, non_blocking=self.pinned)
            if self.pinned and dst.is_cuda:  # the buffer is reused once this copy has finished
                self._copies[i] = torch.cuda.Event()
                self._copies[i].record()
        return dst

    # ------------------------------------------------------------------ the step's write-back

    @torch.no_grad()
    def write(self, g: FlatGroup, lo: int, src: torch.Tensor) -> None:
        """Updated weights ``src`` (any dtype, any device) for elements ``[lo, lo + n)`` of ``g``'s
        partition: into the host copy, or through the ring into the file."""
        if g in self.aliased and src.data_ptr() == g.shard[lo:].data_ptr():
            return  # the host master was updated in place: it is the partition
        files = self.files.get(g)
        if files is None:
            g.shard[lo:lo + src.numel()].copy_(src)
            return
        step = max(1, self.chunk_bytes // files.elem)
        for a in range(0, src.numel(), step):
            b = min(a + step, src.numel())
            _, buf = self._slot((b - a) * files.elem, g.compute_dtype)
            buf.copy_(src[a:b])  # to the host (synchronous: the write needs the values)
            files.write("param", lo + a, buf)

    # ------------------------------------------------------------------ accounting

    def host_bytes(self) -> dict[str, int]:
        """``host_params`` (partitions in host memory, aliased masters excluded: the optimizer
        offload counts them) and ``host_param_ring``, which sum to the host allocation's size,
        alignment padding included; and ``nvme_params`` (the files' size)."""
        files = sum(g.shard_numel * g.full.element_size() for g in self.on_nvme)
        return {"host_params": self.arena.bytes_of("params"), "host_param_ring": self.arena.bytes_of("ring"),
                "nvme_params": files}

    def io_bytes(self) -> tuple[int, int]:
        """Bytes read from and written to the parameter files so far."""
        return (sum(f.bytes_read for f in self.files.values()), sum(f.bytes_written for f in self.files.values()))

    def drop_pages(self) -> None:
        """Unmap the file pages a whole-tensor access (checkpoint, load) brought into this process."""
        for files in self.files.values():
            files.drop_pages()

    def release(self) -> None:
        """Close the files and release the directory's lock (the maps close with their last tensor)."""
        self._closer()
        self.files.clear()
        self._lock_fd = None
