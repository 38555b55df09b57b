"""Time to first step at scale: bytes each rank reads to resume, values it draws to initialize.

Both follow from the layout (what a rank owns), not from the model size:

* resume (same layout) reads the rank's own fp32 master and two Adam moments, 12 bytes per
  owned parameter (a reshard reads at most twice that, see ``zero.checkpoint``), and
  verifies them with sha256 as they arrive;
* a fresh start draws the rank's owned values only (``zero.materialize``): its DP partition
  of its TP shard with ZeRO-3, the whole TP shard with ZeRO 0-2 (whose compute parameters
  are replicated over DP).

Rates are inputs: a read bandwidth per rank and for the whole filesystem (stated, as they
depend on the cluster), and the sha256 and initialization rates of one CPU thread, measured
here by :func:`measure_rates`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import torch

from megazero.model import GPTConfig, num_parameters
from megazero.model.flops import replicated_parameters

__all__ = ["StartupEstimate", "estimate_startup", "measure_rates", "replicated_parameters"]

GB = 1e9


@dataclasses.dataclass
class StartupEstimate:
    parameters: int
    tp_shard_parameters: int  # Ψ of one TP rank
    owned_parameters: int  # fp32 masters this rank keeps
    drawn_values: int  # values this rank draws at a fresh start
    resume_bytes: int  # bytes this rank reads at resume (same layout)
    world: int
    read_gbps_per_rank: float
    fs_gbps: float
    sha256_gbps: float
    init_values_per_s: float

    @property
    def load_seconds(self) -> float:
        """Slowest of: this rank's read, everyone's reads through the filesystem, the hashing."""
        per_rank = self.resume_bytes / (self.read_gbps_per_rank * GB)
        shared = self.resume_bytes * self.world / (self.fs_gbps * GB)
        return max(per_rank, shared) + self.resume_bytes / (self.sha256_gbps * GB)

    @property
    def init_seconds(self) -> float:
        return self.drawn_values / self.init_values_per_s

    @property
    def full_init_seconds(self) -> float:
        """What drawing every value of the model on each rank took before sharded initialization."""
        return self.parameters / self.init_values_per_s

    def to_text(self) -> str:
        return "\n".join([
            f"start-up per rank ({self.world} ranks):",
            f"  resume: reads {self.resume_bytes / GB:.2f} GB (its own fp32 masters + Adam moments of "
            f"{self.owned_parameters:,} parameters; at most twice that after a reshard), whole checkpoint "
            f"{self.resume_bytes * self.world / GB:.1f} GB",
            f"    ~{self.load_seconds:.0f} s at {self.read_gbps_per_rank:g} GB/s per rank, {self.fs_gbps:g} GB/s for "
            f"the filesystem (stated), sha256 at {self.sha256_gbps:.2f} GB/s (measured, one thread)",
            f"  fresh start: draws {self.drawn_values:,} values, ~{self.init_seconds:.0f} s at "
            f"{self.init_values_per_s / 1e6:.0f} M values/s (measured, one thread); "
            f"the whole model on every rank would take ~{self.full_init_seconds:.0f} s",
        ])


def estimate_startup(config: GPTConfig, *, tp: int, dp: int, zero_stage: int, read_gbps_per_rank: float = 1.0,
                     fs_gbps: float = 40.0, sha256_gbps: float = 0.5, init_values_per_s: float = 60e6) -> StartupEstimate:
    total = num_parameters(config)
    replicated = replicated_parameters(config)
    shard = (total - replicated) // tp + replicated
    owned = shard if zero_stage == 0 else -(-shard // dp)
    drawn = owned if zero_stage == 3 else shard
    return StartupEstimate(total, shard, owned, drawn, 12 * owned, tp * dp, read_gbps_per_rank, fs_gbps,
                           sha256_gbps, init_values_per_s)


def measure_rates(seconds: float = 0.3) -> tuple[float, float]:
    """``(sha256 GB/s, counter-based init values/s)`` of one thread of the local machine."""
    from megazero.mpu.initializers import InitSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = bytes(8 << 20)
        h, n, t0 = hashlib.sha256(), 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            h.update(block)
            n += len(block)
        sha = n / (time.perf_counter() - t0) / GB
        spec = InitSpec("normal", (4096, 1024), std=0.02)
        spec.draw(1, 0, 1 << 16)  # warm-up
        values, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            spec.draw(values + 1, 0, 4096 * 1024)
            values += 4096 * 1024
        rate = values / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return sha, rate
