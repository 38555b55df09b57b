"""Autograd collectives over a context-parallel (CP) group, with byte counters.

A CP group splits one sequence over its ranks. Attention then needs either every
token for a subset of heads (all-to-all over heads, DeepSpeed Ulysses) or every
key/value for this rank's queries (all-gather along the sequence). Each function is
the forward half of a pair whose backward is its conjugate:

* ``seq_to_heads_all_to_all``: ``[s/P, b, n, d]`` -> ``[s, b, n/P, d]``; backward the reverse;
* ``heads_to_seq_all_to_all``: ``[s, b, n/P, d]`` -> ``[s/P, b, n, d]``; backward the reverse;
* ``replicated_kv_all_to_all``: the first, for KV heads fewer than the ranks (each rank gets one);
* ``gather_sequence``: ``[s/P, ...]`` -> ``[s, ...]``; backward reduce-scatter (sum over ranks).

``d`` is each tensor's own width: K and V of different head widths (multi-latent attention) travel
in calls of their own, each at its width. ``group`` is the CP process group (``None``: the default
group). The gathered sequence is in rank-major order (rank 0's tokens, then rank 1's, ...),
whatever layout put which tokens on which rank; callers reorder by global positions.

``CommCounter`` records what each call moves on this rank: for an all-to-all the
(P-1)/P of the tensor that leaves (and arrives at) the rank; for an all-gather or a
reduce-scatter the P-1 chunks every rank must receive (and send), i.e. the
algorithm-independent volume the usual formulas count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .utils import all_gather_flat, divide, group_size, reduce_scatter_flat

__all__ = [
    "CommCounter",
    "seq_to_heads_all_to_all",
    "heads_to_seq_all_to_all",
    "replicated_kv_all_to_all",
    "gather_sequence",
    "all_gather_tensor",
]


@dataclass
class CommCounter:
    """Bytes and elements this rank sends and receives, per phase ("forward" / "backward")."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes_received: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    elements_sent: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    elements_received: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    calls: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def add(self, phase: str, sent: int, received: int, element_size: int) -> None:
        """Record one collective of ``phase`` moving ``sent``/``received`` elements of ``element_size`` bytes."""
        self.elements_sent[phase] += sent
        self.elements_received[phase] += received
        self.bytes_sent[phase] += sent * element_size
        self.bytes_received[phase] += received * element_size
        self.calls[phase] += 1

    def reset(self) -> None:
        for d in (self.bytes_sent, self.bytes_received, self.elements_sent, self.elements_received, self.calls):
            for key in d:
                d[key] = 0


def _count(counter: Optional[CommCounter], phase: str, sent: int, received: int, t: torch.Tensor) -> None:
    if counter is not None:
        counter.add(phase, sent, received, t.element_size())


# ---- raw collectives (no autograd) -------------------------------------------------------


def _all_to_all_dim0(x: torch.Tensor, group, counter, phase) -> torch.Tensor:
    """``x[j]`` goes to rank ``j``; ``out[j]`` came from rank ``j`` (dim 0 has size P)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    world = x.size(0)
    moved = x.numel() // world * (world - 1)  # the chunk addressed to this rank stays here
    _count(counter, phase, moved, moved, x)
    return out


def _seq_to_heads(x: torch.Tensor, group, counter, phase) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    s, b, n, d = x.shape
    per_rank = divide(n, world, "heads / context parallel size")
    # [P, s, b, n/P, d]: slab j holds the heads rank j will own
    slabs = x.reshape(s, b, world, per_rank, d).permute(2, 0, 1, 3, 4)
    return _all_to_all_dim0(slabs, group, counter, phase).reshape(world * s, b, per_rank, d)


def _heads_to_seq(x: torch.Tensor, group, counter, phase) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    s, b, n, d = x.shape
    local = divide(s, world, "sequence length / context parallel size")
    # slab j holds rank j's tokens; it comes back as [P (head slabs), s/P, b, n, d]
    back = _all_to_all_dim0(x.reshape(world, local, b, n, d), group, counter, phase)
    return back.permute(1, 2, 0, 3, 4).reshape(local, b, world * n, d)


def all_gather_tensor(x: torch.Tensor, group, counter: Optional[CommCounter] = None,
                      phase: str = "forward") -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (no autograd), counted in ``counter``."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group=group)
    _count(counter, phase, x.numel() * (world - 1), x.numel() * (world - 1), x)
    return out


def _reduce_scatter(x: torch.Tensor, group, counter, phase) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    rows = divide(x.size(0), world, "sequence length / context parallel size")
    x = x.contiguous()
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x, group=group)
    _count(counter, phase, out.numel() * (world - 1), out.numel() * (world - 1), x)
    return out


# ---- autograd functions ------------------------------------------------------------------


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return _seq_to_heads(x, group, counter, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.counter, "backward"), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return _heads_to_seq(x, group, counter, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.counter, "backward"), None, None


class _ReplicatedKV(torch.autograd.Function):
    """Forward sends each rank the one KV head its query heads read; backward returns one gradient
    per query head, so that the caller's ``repeat_interleave`` sums them exactly as one process does."""

    @staticmethod
    def forward(ctx, k_rep, group, counter):
        ctx.group, ctx.counter = group, counter
        world = group_size(group)
        per_rank = divide(k_rep.size(2), world, "heads / context parallel size")
        one_each = k_rep[:, :, ::per_rank]  # [s, b, P, d]: the head addressed to each rank
        mine = _seq_to_heads(one_each, group, counter, "forward")  # [P*s, b, 1, d]
        return mine.expand(-1, -1, per_rank, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.counter, "backward"), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return all_gather_tensor(x, group, counter, "forward")

    @staticmethod
    def backward(ctx, grad):
        # every rank holds a partial gradient for the whole sequence (from its own queries)
        return _reduce_scatter(grad, ctx.group, ctx.counter, "backward"), None, None


def seq_to_heads_all_to_all(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                            counter: Optional[CommCounter] = None) -> torch.Tensor:
    """``[s_local, b, n, d]`` -> ``[P * s_local, b, n / P, d]``: every rank's tokens, this rank's heads.

    Rank ``j`` keeps heads ``[j * n/P, (j+1) * n/P)``; the sequence is in rank-major order.
    Backward is the reverse all-to-all. ``n`` must be divisible by P.
    """
    if group_size(group) == 1:
        return x
    return _SeqToHeads.apply(x, group, counter)


def heads_to_seq_all_to_all(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                            counter: Optional[CommCounter] = None) -> torch.Tensor:
    """``[P * s_local, b, n, d]`` (rank-major sequence) -> ``[s_local, b, P * n, d]``: the inverse of
    ``seq_to_heads_all_to_all``. Backward is the forward all-to-all."""
    if group_size(group) == 1:
        return x
    return _HeadsToSeq.apply(x, group, counter)


def replicated_kv_all_to_all(k_repeated: torch.Tensor, group: Optional[dist.ProcessGroup],
                             counter: Optional[CommCounter] = None) -> torch.Tensor:
    """KV heads fewer than the CP ranks: ``[s_local, b, n, d]`` -> ``[P * s_local, b, n / P, d]`` like
    ``seq_to_heads_all_to_all``, for a ``k_repeated`` whose heads are already repeated to the query heads
    (``n``) and whose ``n / P`` heads bound for one rank are copies of one KV head.

    Forward moves one head per destination rank (not ``n / P``); backward moves ``n / P`` gradients per
    rank, one per query head, which the caller's repeat then sums in one process's order.
    """
    if group_size(group) == 1:
        return k_repeated
    return _ReplicatedKV.apply(k_repeated, group, counter)


def gather_sequence(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                    counter: Optional[CommCounter] = None) -> torch.Tensor:
    """All-gather along dim 0 (rank-major); backward sums the gradient over ranks and keeps this
    rank's rows (reduce-scatter), since each rank's queries contribute to every key's gradient."""
    if group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, counter)
