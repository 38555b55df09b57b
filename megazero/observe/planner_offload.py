"""Host and NVMe bytes of ZeRO-Offload and ZeRO-Infinity, for the planner (:mod:`.planner`).

Apart from the device formulas so each file reads in one sitting; the engine's own count is
``ZeroEngine.model_state_bytes()`` (``megazero.zero.offload``, ``megazero.zero.param_offload``),
which the rehearsal compares with these.
"""

from __future__ import annotations

from typing import Optional

from megazero.zero.offload import ring_chunk
from megazero.zero.param_offload import ring_bytes

__all__ = ["DTYPE_BYTES", "offloaded_bytes", "offloaded_param_bytes"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def offloaded_bytes(psi: float, *, dp: int, ratio: float, device: str, buffer_count: int = 4,
                    buffer_size: Optional[int] = None, largest: Optional[float] = None) -> dict[str, float]:
    """Host bytes of ZeRO-Offload (``megazero.zero.offload``) for a rank holding ``psi`` parameters
    at ``dp``-way partitioning: the fp32 master and two Adam moments (12 B) of ``ratio`` of the
    partition, in memory (``cpu``) or in files (``nvme``), and the step's ring of ``buffer_count``
    buffers of fp32 chunks (the gradient; with NVMe also the streamed state: x4), each chunk as the
    engine sizes it (``megazero.zero.offload.ring_chunk``: ``buffer_size`` elements when given,
    else a small share of the offloaded state), no larger than the largest flat group's partition
    (``largest`` elements; default the whole)."""
    if device == "none" or ratio <= 0:
        return {"host_optimizer": 0.0, "host_ring": 0.0, "nvme": 0.0}
    state = 12.0 * psi / dp * ratio
    group = psi / dp if largest is None else largest
    chunk = ring_chunk(int(psi / dp * ratio), int(group), buffer_count, buffer_size, device == "nvme")
    ring = buffer_count * chunk * 4 * (4 if device == "nvme" else 1)
    return {"host_optimizer": 0.0 if device == "nvme" else state, "host_ring": float(ring),
            "nvme": state if device == "nvme" else 0.0}


def offloaded_param_bytes(psi: float, *, dp: int, precision: str, device: str, max_in_cpu: float = 1e9,
                          buffer_count: int = 5, buffer_size: Optional[float] = None, optimizer_device: str = "none",
                          optimizer_ratio: float = 0.0, largest: Optional[float] = None) -> dict[str, float]:
    """ZeRO-Infinity's parameter offload (``megazero.zero.param_offload``) for a rank holding
    ``psi`` parameters at ZeRO-3 over ``dp``: its weight partition (compute dtype) in host memory
    (up to ``max_in_cpu`` elements with ``nvme``) or in files, the NVMe reads' ``buffer_count``
    buffers (sized as the engine does, ``megazero.zero.param_offload.ring_bytes``, with the files
    as one partition of at most the largest flat group's, ``largest`` elements), and the share
    of the partition that stays on the device (``weights_on_device``): in fp32 the partition is the
    optimizer's master, so the part the optimizer steps on the device stays, and the part whose
    master is in host memory (optimizer offload ``cpu``) costs nothing more there."""
    if device == "none":
        return {"host_params": 0.0, "host_param_ring": 0.0, "nvme_params": 0.0, "weights_on_device": 1.0}
    e = DTYPE_BYTES[precision]
    part = psi / dp
    ratio = optimizer_ratio if optimizer_device != "none" else 0.0
    kept = (1.0 - ratio) if precision == "fp32" else 0.0
    aliased = ratio if precision == "fp32" and optimizer_device == "cpu" else 0.0
    own = part * (1.0 - aliased)  # elements this offload keeps itself
    in_memory = own if device == "cpu" else min(own, max_in_cpu)
    on_files = own - in_memory
    group = part if largest is None else largest
    size = None if buffer_size is None else int(buffer_size)
    ring = buffer_count * min(ring_bytes([int(on_files)], e, buffer_count, size), int(group) * e) if on_files else 0.0
    return {"host_params": in_memory * e, "host_param_ring": ring, "nvme_params": on_files * e,
            "weights_on_device": kept}
