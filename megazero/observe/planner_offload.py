"""Host and NVMe bytes of ZeRO-Offload and ZeRO-Infinity, for the planner (:mod:`.planner`).

Apart from the device formulas so each file reads in one sitting; the engine's own count is
``ZeroEngine.model_state_bytes()`` (``megazero.zero.offload``, ``megazero.zero.param_offload``),
which the rehearsal compares with these.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["DTYPE_BYTES", "offloaded_bytes", "offloaded_param_bytes"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_ALIGN = 4096  # the optimizer ring's chunks start at multiples of this many elements (offload.ALIGN)


def offloaded_bytes(psi: float, *, dp: int, ratio: float, device: str, buffer_count: int = 4,
                    buffer_size: int = 1 << 23, largest: Optional[float] = None) -> dict[str, float]:
    """Host bytes of ZeRO-Offload (``megazero.zero.offload``) for a rank holding ``psi`` parameters
    at ``dp``-way partitioning: the fp32 master and two Adam moments (12 B) of ``ratio`` of the
    partition, in memory (``cpu``) or in files (``nvme``), and the step's ring of ``buffer_count``
    buffers of ``buffer_size`` fp32 elements (the gradient; with NVMe also the streamed state: x4),
    no larger than the largest flat group's partition (``largest`` elements; default the whole)."""
    if device == "none" or ratio <= 0:
        return {"host_optimizer": 0.0, "host_ring": 0.0, "nvme": 0.0}
    state = 12.0 * psi / dp * ratio
    chunk = max(_ALIGN, int(buffer_size) // _ALIGN * _ALIGN)
    group = psi / dp if largest is None else largest
    ring = buffer_count * min(chunk, -(-int(group) // _ALIGN) * _ALIGN) * 4 * (4 if device == "nvme" else 1)
    return {"host_optimizer": 0.0 if device == "nvme" else state, "host_ring": float(ring),
            "nvme": state if device == "nvme" else 0.0}


def offloaded_param_bytes(psi: float, *, dp: int, precision: str, device: str, max_in_cpu: float = 1e9,
                          buffer_count: int = 5, buffer_size: float = 1e8, optimizer_device: str = "none",
                          optimizer_ratio: float = 0.0, largest: Optional[float] = None) -> dict[str, float]:
    """ZeRO-Infinity's parameter offload (``megazero.zero.param_offload``) for a rank holding
    ``psi`` parameters at ZeRO-3 over ``dp``: its weight partition (compute dtype) in host memory
    (up to ``max_in_cpu`` elements with ``nvme``) or in files, the NVMe reads' ``buffer_count``
    buffers (each at most the largest flat group's partition, ``largest`` elements), and the share
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
    ring = buffer_count * min(buffer_size, group, on_files) * e if on_files else 0.0
    return {"host_params": in_memory * e, "host_param_ring": ring, "nvme_params": on_files * e,
            "weights_on_device": kept}
