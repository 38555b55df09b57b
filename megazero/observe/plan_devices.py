"""The cluster a plan is for: GPU presets and where each process group of a layout lands.

A preset gives a GPU's dense peak FLOP/s per precision, its memory, HBM bandwidth, and the bus
bandwidth one GPU reaches in a collective inside its node (NVLink/NVSwitch) and across nodes (its share
of the network, one NIC per GPU as in DGX/HGX systems). Bandwidths are what nccl-tests reports as
``busbw`` on such systems (a ring moves ``2 (n - 1) / n`` of an all-reduce's bytes at that rate), not the
links' nominal rates; every figure can be overridden from the command line. A group whose ranks lie on
one node communicates at the node's bandwidth, one spanning nodes at the network's (the slowest hop of a
ring); which ranks form each group is Megatron's tp-cp-dp-pp order (:mod:`megazero.mpu.rank_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from megazero.mpu.rank_layout import group_ranks

__all__ = ["Device", "DEVICES", "Cluster", "device_preset"]


@dataclass(frozen=True)
class Device:
    """One GPU model: capacities and rates (GB/s = 1e9 bytes per second)."""

    name: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total, in GiB
    peak_tflops: dict  # dense tensor-core peak per training precision (fp32: TF32)
    hbm_gbps: float  # device-memory bandwidth
    intra_node_gbps: float  # collective bus bandwidth per GPU inside a node (NVLink)
    inter_node_gbps: float  # collective bus bandwidth per GPU across nodes (its NIC)
    pcie_gbps: float = 25.0  # host <-> device, each way (offload)
    host_memory_gib: float = 256.0  # the node's memory per GPU (what offloaded state may use)

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision`` (bf16, fp16, fp32)."""
        return self.peak_tflops[precision] * 1e12


# Datasheet peaks (dense, no sparsity); memory as the driver reports it; busbw from nccl-tests on
# DGX-class systems (NVLink 3/4/5; 8 x HDR 200 Gb/s for A100, 8 x NDR 400 Gb/s for the others); host memory
# a DGX's (2 TB, 4 TB for B200) over its 8 GPUs.
DEVICES = {
    "a100-80gb": Device("a100-80gb", 80.0, {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, 2039.0, 230.0, 23.0,
                        pcie_gbps=25.0, host_memory_gib=256.0),
    "h100-80gb": Device("h100-80gb", 79.6, {"bf16": 989.0, "fp16": 989.0, "fp32": 495.0}, 3350.0, 360.0, 45.0,
                        pcie_gbps=50.0),
    "h200": Device("h200", 140.4, {"bf16": 989.0, "fp16": 989.0, "fp32": 495.0}, 4800.0, 360.0, 45.0,
                   pcie_gbps=50.0),
    "b200": Device("b200", 179.1, {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0}, 8000.0, 720.0, 45.0,
                   pcie_gbps=50.0, host_memory_gib=512.0),
}


def device_preset(name: str, *, memory_gib: Optional[float] = None, peak_tflops: Optional[float] = None,
                  intra_node_gbps: Optional[float] = None, inter_node_gbps: Optional[float] = None,
                  hbm_gbps: Optional[float] = None, host_memory_gib: Optional[float] = None) -> Device:
    """The preset ``name`` with the given figures replaced (``peak_tflops``: the bf16/fp16 peak; TF32 half
    of it). An unknown name raises ValueError naming the presets."""
    if name not in DEVICES:
        raise ValueError(f"unknown GPU {name!r}: the presets are {', '.join(DEVICES)} (override their figures "
                         "with --device-memory-gb, --peak-tflops, --intra-node-gbps, --inter-node-gbps)")
    d = DEVICES[name]
    for label, value in (("--device-memory-gb", memory_gib), ("--peak-tflops", peak_tflops),
                         ("--intra-node-gbps", intra_node_gbps), ("--inter-node-gbps", inter_node_gbps),
                         ("--hbm-gbps", hbm_gbps), ("--host-memory-gb", host_memory_gib)):
        if value is not None and value <= 0:
            raise ValueError(f"{label} must be positive, got {value:g}")
    peaks = d.peak_tflops if peak_tflops is None else {"bf16": peak_tflops, "fp16": peak_tflops,
                                                       "fp32": peak_tflops / 2}
    return replace(d, memory_gib=memory_gib or d.memory_gib, peak_tflops=peaks,
                   intra_node_gbps=intra_node_gbps or d.intra_node_gbps,
                   inter_node_gbps=inter_node_gbps or d.inter_node_gbps, hbm_gbps=hbm_gbps or d.hbm_gbps,
                   host_memory_gib=host_memory_gib or d.host_memory_gib)


@lru_cache(maxsize=4096)
def _spans(world: int, gpus_per_node: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> dict[str, bool]:
    """Group kind -> whether some group of that kind spans more than one node."""
    groups = group_ranks(world, tp, pp, cp, ep=ep, etp=etp)
    return {kind: any(len({r // gpus_per_node for r in g}) > 1 for g in lines) for kind, lines in groups.items()}


@dataclass(frozen=True)
class Cluster:
    """``world`` GPUs of one ``device`` model, ``gpus_per_node`` to a node; a plan leaves ``reserve_gib`` of
    each GPU's memory to what no plan counts (the CUDA context, cuBLAS workspaces, allocator fragmentation)."""

    world: int
    gpus_per_node: int
    device: Device
    reserve_gib: float = 3.0

    @property
    def usable_bytes(self) -> float:
        """What a plan's peak (NCCL's estimate included) may use."""
        return (self.device.memory_gib - self.reserve_gib) * 2 ** 30

    def __post_init__(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--world-size and --gpus-per-node must be >= 1, got {self.world}, {self.gpus_per_node}")
        if not 0 <= self.reserve_gib < self.device.memory_gib:
            raise ValueError(f"--memory-reserve-gb {self.reserve_gib:g} must be >= 0 and below the device's "
                             f"{self.device.memory_gib:g} GiB")

    def crosses_nodes(self, kind: str, *, tp: int, pp: int, cp: int = 1, ep: int = 1,
                      etp: Optional[int] = None) -> bool:
        """Whether some group of the layout's ``kind`` (tp, cp, dp, dp_cp, pp, ep, edp, expert) spans more
        than one node."""
        etp = tp if etp is None else etp
        spans = _spans(self.world, self.gpus_per_node, tp, pp, cp, ep, etp)
        if kind not in spans:  # no such group of its own: ep and edp run over data (x context) parallel
            kind = {"ep": "dp_cp" if cp > 1 else "dp", "edp": "dp_cp" if cp > 1 else "dp", "cp": "tp"}.get(kind, kind)
        return spans.get(kind, False)

    def bandwidth(self, kind: str, **layout) -> float:
        """Bytes per second a rank moves in the layout's ``kind`` group: the node's bandwidth if every such
        group lies within a node, else the network's."""
        d = self.device
        return (d.inter_node_gbps if self.crosses_nodes(kind, **layout) else d.intra_node_gbps) * 1e9
