"""Host memory for offloaded state: one exact-size allocation per offload object, carved into views.

Pinning each tensor on its own goes through torch's caching host allocator, which rounds every
request up to a power of two and keeps the rounded block cached: arbitrary-sized masters, moments,
partitions and ring buffers would hold up to twice the bytes they need. A :class:`HostArena`
instead sums its tensors' sizes first (each view starting at a multiple of :data:`ALIGN_BYTES`),
allocates that many bytes once (pinned by :func:`pinned_bytes`, which bypasses that allocator),
and hands out views, so the host memory held is the arena's ``nbytes`` and that is what the
offload objects report.
"""

from __future__ import annotations

import mmap
from typing import Hashable

import torch

__all__ = ["ALIGN_BYTES", "HostArena", "pinned_bytes"]

# Every view starts at a multiple of this many bytes: the CPU allocator's own alignment, so the
# vectorised kernels that run on these views (the fused CPU Adam) see the same layout as on
# ordinarily allocated tensors, and any dtype can be viewed at any view's start.
ALIGN_BYTES = 64


class _LockedPages(mmap.mmap):
    """Anonymous pages that, once ``registered`` (their address) with the CUDA driver, are
    unregistered when the last tensor viewing them goes, before they are unmapped."""

    registered = 0

    def __del__(self) -> None:
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered)
            except Exception:  # at interpreter exit the runtime may be gone; exit frees the pages anyway
                pass


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` (> 0) of page-locked host memory as a uint8 tensor, held for as long as a view of
    it lives; raises ``RuntimeError`` where memory cannot be pinned (a CPU-only build, no driver,
    a locked-memory limit).

    The pages are mapped here and registered with the driver (``cudaHostRegister``) rather than
    taken from torch's pinned allocator (``pin_memory=True``), which would round the size up to a
    power of two and keep the rounded block cached after the tensor goes."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: host memory cannot be pinned")
    pages = _LockedPages(-1, nbytes)
    buffer = torch.frombuffer(pages, dtype=torch.uint8)  # holds ``pages`` as long as a view lives
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})")
    pages.registered = buffer.data_ptr()
    return buffer


def _round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class HostArena:
    """One host allocation holding every tensor in ``requests`` as a view.

    ``requests`` maps a key to ``(numel, dtype, tag)``. The views (``views[key]``: 1-D, contiguous,
    uninitialized, ``numel`` elements of ``dtype``) never overlap and each starts at a multiple of
    :data:`ALIGN_BYTES`. ``nbytes`` is the allocation's size, padding included; ``bytes_of(tag)``
    is the share of it taken by the views with that tag (a view and the padding after it), and the
    shares of all tags sum to ``nbytes``.

    The allocation is pinned (``pinned``) when ``pin`` is asked and possible, else ordinary
    pageable memory; on the ``meta`` device (a rehearsal) it is a meta tensor of the same size.
    An empty ``requests`` allocates nothing (``pinned`` is then true: nothing is pageable).
    """

    def __init__(self, requests: dict[Hashable, tuple[int, torch.dtype, str]], pin: bool,
                 device: torch.device) -> None:
        offsets, self._tag_bytes = {}, {}
        total = 0
        for key, (numel, dtype, tag) in requests.items():
            offsets[key] = total
            size = _round_up(numel * torch.empty((), dtype=dtype).element_size())
            self._tag_bytes[tag] = self._tag_bytes.get(tag, 0) + size
            total += size
        self.nbytes = total
        self.buffer, self.pinned = self._allocate(total, pin, torch.device(device))
        self.views: dict[Hashable, torch.Tensor] = {}
        for key, (numel, dtype, _) in requests.items():
            elem = torch.empty((), dtype=dtype).element_size()
            lo = offsets[key]
            self.views[key] = self.buffer[lo:lo + numel * elem].view(dtype)

    @staticmethod
    def _allocate(nbytes: int, pin: bool, device: torch.device) -> tuple[torch.Tensor, bool]:
        if device.type == "meta":  # a rehearsal: host bytes are counted, not allocated
            return torch.empty(nbytes, dtype=torch.uint8, device="meta"), False
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), True
        if pin:
            try:
                return pinned_bytes(nbytes), True
            except RuntimeError:  # a CPU-only build, no driver, or no locked memory in this container
                pass
        return torch.empty(nbytes, dtype=torch.uint8), False

    def bytes_of(self, tag: str) -> int:
        """Bytes of the allocation taken by the views tagged ``tag`` (0 for an unknown tag)."""
        return self._tag_bytes.get(tag, 0)
