"""What a GPU run holds beyond its tensors, for the planner and the rehearsal: NCCL communicators'
device buffers (an estimate from NCCL's defaults) and pinned host blocks rounded by torch's
caching host allocator.

**NCCL communicators.** NCCL allocates, per communicator, a receive buffer per channel and per
protocol for every peer connection it sets up (``computeBuffSizes`` in NCCL's ``src/init.cc``):

    SIMPLE  NCCL_BUFFSIZE, default 1 << 22 = 4 MiB                 (DEFAULT_BUFFSIZE)
    LL      8 lines x 512 threads x 8 steps x 16 B = 512 KiB         (DEFAULT_LL_BUFFSIZE)
    LL128   120 elements x 640 threads x 8 steps x 8 B = 4.69 MiB    (DEFAULT_LL128_BUFFSIZE)

The estimate per communicator of more than one rank is

    NCCL_COMMUNICATOR_BYTES = NCCL_CHANNELS x NCCL_CONNECTIONS_PER_CHANNEL x (SIMPLE + LL + LL128)
                            = 32 x 1 x 9,633,792 B = 294 MiB

with 32 channels (NCCL's ``MAXCHANNELS``; NVLink nodes such as DGX H100 open all of them) and
one connection per channel (the ring: a rank receives from its predecessor, and buffers live on
the receiving side). Not counted: tree connections (about as much again where an all-reduce picks
the tree), NVLink SHARP (NVLS) buffers (up to about 1 GiB more per communicator on NVSwitch
nodes; ``NCCL_NVLS_ENABLE=0`` turns them off) and a smaller ``NCCL_BUFFSIZE``. NVIDIA/nccl#864
and #986 report hundreds of MB to about 1.5 GB per communicator. torch creates a communicator
at a group's first collective, so a group never used costs nothing; a group of one rank moves
nothing and is not counted.

**Pinned host memory.** ``torch.empty(..., pin_memory=True)`` and a DataLoader's
``pin_memory=True`` go through torch's caching host allocator, which rounds every request up to
the next power of two and keeps the rounded block cached (:func:`caching_host_allocator_bytes`).
ZeRO-Offload's host state does not: it is one exact-size allocation per offload object,
registered with ``cudaHostRegister`` (``megazero.zero.pinned``), so its host figures are exact.
The one path still pinning through the caching allocator is the data loader's batches.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from megazero.mpu.parallel_state import group_ranks

__all__ = ["NCCL_SIMPLE_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_CHANNELS",
           "NCCL_CONNECTIONS_PER_CHANNEL", "NCCL_COMMUNICATOR_BYTES", "nccl_communicators",
           "creates_gradient_communicator", "gradient_communicator_note", "nccl_line", "caching_host_allocator_bytes",
           "loader_pinned_bytes", "HOST_MEMORY_NOTE"]

NCCL_SIMPLE_BUFFSIZE = 1 << 22  # NCCL_BUFFSIZE's default
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x 16 B
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 B
NCCL_CHANNELS = 32  # NCCL's MAXCHANNELS, what NVLink nodes use
NCCL_CONNECTIONS_PER_CHANNEL = 1  # the ring's receive side
NCCL_COMMUNICATOR_BYTES = NCCL_CHANNELS * NCCL_CONNECTIONS_PER_CHANNEL * (
    NCCL_SIMPLE_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE)

HOST_MEMORY_NOTE = ("host memory of the offloads is exact: one exact-size allocation per offload object, pinned by "
                    "cudaHostRegister (not rounded up to a power of two by torch's caching host allocator)")


def creates_gradient_communicator(zero_stage: int, dp: int, keep_gathered: bool = False,
                                  collectives: str = "auto") -> bool:
    """Whether the ZeRO engine of an NCCL run gives ZeRO-3's gradient reduce-scatters a communicator
    of their own, as ``megazero.zero.comm.gradient_communicator`` decides it: a second communicator
    only on the emulated collectives (``collectives``, ``$MEGAZERO_ZERO_COLLECTIVES``: ``auto`` is the
    native path on NCCL), so an NCCL run of a GPT shares the DP communicator."""
    from megazero.zero.comm import gradient_communicator

    # The rule is asked, not restated: a communicator it reuses comes back as given; one it would
    # create makes it look up the group's ranks, which this stand-in for a group cannot answer.
    stand_in = object()
    try:
        separate = collectives == "emulated"
        return gradient_communicator(stand_in, zero_stage, dp, keep_gathered, separate) is not stand_in
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return True


def nccl_communicators(*, tp: int, pp: int, dp: int, zero_stage: int, keep_gathered: bool = False,
                       pp_rank: int = 0, collectives: str = "auto", cp: int = 1,
                       hierarchical_cp: tuple[int, ...] = (), ep: int = 1,
                       etp: Optional[int] = None) -> dict[str, int]:
    """The NCCL communicators of more than one rank that a rank of pipeline stage ``pp_rank`` joins
    in a tp x cp x pp x dp launch, by group name (``world``, ``tp``, ``dp``, ``pp``, ``mp``, ``embedding``,
    ``cp``, ``dp_cp``, with ``hierarchical_cp`` ``hcp_a2a`` and ``hcp_p2p``, with ``ep`` > 1 ``ep`` and ``edp``,
    with an ``etp`` other than ``tp`` also ``etp`` and ``expert`` where they are not TP or EP groups:
    ``megazero.mpu.parallel_state``'s groups; ``dp_grads``: ZeRO-3's gradient
    communicator, per :func:`creates_gradient_communicator`, over the ranks ZeRO partitions over),
    each counted 1. The default ``pp_rank`` 0 is a first stage, which joins the most (the embedding
    group when pp > 1)."""
    if min(tp, pp, dp, cp) < 1 or not 0 <= pp_rank < pp:
        raise ValueError(f"tp, pp, dp and cp must be >= 1 and 0 <= pp_rank < pp, got tp {tp}, pp {pp}, dp {dp}, "
                         f"cp {cp}, pp_rank {pp_rank}")
    # the layout search asks for thousands of plans over a few hundred layouts
    return dict(_communicators(tp, pp, dp, zero_stage, keep_gathered, pp_rank, collectives, cp,
                               tuple(hierarchical_cp or ()), ep, etp))


@lru_cache(maxsize=1024)
def _communicators(tp: int, pp: int, dp: int, zero_stage: int, keep_gathered: bool, pp_rank: int, collectives: str,
                   cp: int, hierarchical_cp: tuple[int, ...], ep: int, etp: Optional[int]) -> dict[str, int]:
    world = tp * pp * dp * cp
    rank = pp_rank * dp * cp * tp  # tp, cp and dp rank 0 of that stage: every rank of a stage joins alike
    out = {"world": 1} if world > 1 else {}
    etp = tp if etp is None else etp
    same = {"etp", "expert"} if etp == tp else ({"expert"} if min(ep, etp) == 1 else set())  # the TP or EP groups
    for kind, lines in group_ranks(world, tp, pp, cp, hierarchical_cp or None, ep, etp).items():
        if kind in same:
            continue
        if any(rank in line and len(line) > 1 for line in lines):
            out[kind] = 1
    if dp * cp > 1 and creates_gradient_communicator(zero_stage, dp * cp, keep_gathered, collectives):
        out["dp_grads"] = 1
    return out


def gradient_communicator_note(communicators: dict[str, int], zero_stage: int, dp: int) -> str:
    """What the count says of ZeRO-3's gradient communicator ("" where there is none to speak of)."""
    if zero_stage < 3 or dp == 1:
        return ""
    if "dp_grads" in communicators:
        return "ZeRO-3's gradient reduce-scatters on a communicator of their own"
    return "ZeRO-3's gradient reduce-scatters share the DP communicator on NCCL: 0 more"


def nccl_line(communicators: dict[str, int], note: str = "") -> str:
    """``NCCL communicators: N x ~294 MiB (estimate) = ... (names)``: the line the tools print
    (``note``, e.g. :func:`gradient_communicator_note`, appended)."""
    n = sum(communicators.values())
    each = NCCL_COMMUNICATOR_BYTES / 2 ** 20
    names = ", ".join(communicators) or "none: one rank"
    return (f"NCCL communicators: {n} x ~{each:.0f} MiB (estimate) = {n * each:.0f} MiB per GPU ({names}; "
            f"{NCCL_CHANNELS} channels x (SIMPLE {NCCL_SIMPLE_BUFFSIZE >> 20} MiB + LL128 + LL buffers), "
            "NVLS not counted" + (f"; {note}" if note else "") + ")")


def caching_host_allocator_bytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator holds for a ``pin_memory=True`` request of
    ``nbytes``: the next power of two (its default rounding threshold is unlimited)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def loader_pinned_bytes(micro_batch_size: int, seq_length: int, num_workers: int = 0) -> int:
    """Pinned host bytes of the data loader's batches (``[micro_batch, seq + 1]`` int64, pinned by
    the DataLoader on CUDA), as the caching host allocator holds them: each rounded up to a power
    of two; the batch being copied and the next, plus two prefetched per worker."""
    blocks = 2 + 2 * num_workers
    return blocks * caching_host_allocator_bytes(micro_batch_size * (seq_length + 1) * 8)
