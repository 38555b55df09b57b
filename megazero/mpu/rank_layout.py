"""Which global ranks form each process group: pure host arithmetic over the launch's sizes.

Megatron-LM's order tp-cp-dp-pp: ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``.
No communication and no tensors beyond :func:`rank_grid`, so a rehearsal (fake or meta process
groups) and the planner compute the groups a launch would build (``parallel_state`` builds them).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["rank_grid", "rank_coordinates", "context_parallel_rank", "group_ranks"]


def _data_parallel_size(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(f"tensor ({tp}), pipeline ({pp}) and context ({cp}) parallel sizes must be >= 1")
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"context_parallel_size ({cp}) x pipeline_model_parallel_size ({pp}) = {tp * cp * pp}; "
            "choose sizes whose product divides it"
        )
    return world_size // (tp * pp * cp)


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> torch.Tensor:
    """Global ranks arranged as ``[pp, dp, cp, tp]`` (Megatron's order tp-cp-dp-pp, tp fastest);
    every group is a line (or, for data x context, a plane) through it."""
    dp = _data_parallel_size(world_size, tp, pp, cp)
    return torch.arange(world_size).view(pp, dp, cp, tp)


def rank_coordinates(rank: int, world_size: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of global ``rank`` (pure host arithmetic; its context-parallel
    rank is :func:`context_parallel_rank`)."""
    dp = _data_parallel_size(world_size, tp, pp, cp)
    return rank // (dp * cp * tp), (rank // (cp * tp)) % dp, rank % tp


def context_parallel_rank(rank: int, tp: int, cp: int) -> int:
    """The context-parallel rank of global ``rank`` (tp varies fastest, then cp)."""
    return (rank // tp) % cp


def group_ranks(world_size: int, tp: int, pp: int, cp: int = 1,
                hierarchical_cp: Optional[Sequence[int]] = None, ep: int = 1,
                etp: Optional[int] = None) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks (pure host arithmetic; no communication,
    no tensors, so it runs the same under a fake-tensor mode). With ``cp`` > 1 also ``cp`` (the
    ranks splitting one sequence) and ``dp_cp`` (data x context: the ranks holding the same
    parameters); the model-parallel group is tensor x pipeline for each data and context rank.
    ``hierarchical_cp`` (a2a size, p2p size), product ``cp``: also ``hcp_a2a`` (consecutive context
    ranks of one CP group) and ``hcp_p2p`` (those a2a-size apart), Megatron's hierarchical CP groups.

    Experts (``ep`` > 1, or an expert tensor-parallel size ``etp`` other than ``tp``) lay the ranks of
    a pipeline stage out again as etp x ep x expert-dp, etp fastest (Megatron-core's tp-ep-dp-pp over
    the stage's ranks in their tp-cp-dp order): also ``etp`` (the ranks sharing one expert's weights),
    ``ep`` (one rank of each etp group holding different experts), ``expert`` (etp x ep: together
    they hold every expert once) and ``edp`` (the ranks holding the same expert shard). With etp = tp
    an ``etp`` group is a TP group and ep runs over data x context."""
    dp = _data_parallel_size(world_size, tp, pp, cp)

    def r(p: int, d: int, t: int, c: int = 0) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    pipelines = [[r(p, d, t, c) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)]
    out = {
        "tp": [[r(p, d, t, c) for t in range(tp)] for p in range(pp) for d in range(dp) for c in range(cp)],
        "dp": [[r(p, d, t, c) for d in range(dp)] for p in range(pp) for c in range(cp) for t in range(tp)],
        "pp": pipelines,
        "mp": [[r(p, d, t, c) for p in range(pp) for t in range(tp)] for d in range(dp) for c in range(cp)],
        "embedding": [[line[0], line[-1]] if len(line) > 1 else [line[0]] for line in pipelines],
        "position_embedding": [[line[0]] for line in pipelines],
    }
    if cp > 1:
        out["cp"] = [[r(p, d, t, c) for c in range(cp)] for p in range(pp) for d in range(dp) for t in range(tp)]
        out["dp_cp"] = [[r(p, d, t, c) for d in range(dp) for c in range(cp)] for p in range(pp) for t in range(tp)]
    if hierarchical_cp is not None:
        inner, outer = (int(x) for x in hierarchical_cp)
        if inner * outer != cp or min(inner, outer) < 1:
            raise ValueError(f"hierarchical context-parallel sizes {inner} x {outer} must multiply to the "
                             f"context-parallel size {cp}")
        lines = out.get("cp", [])
        out["hcp_a2a"] = [line[o * inner:(o + 1) * inner] for line in lines for o in range(outer)]
        out["hcp_p2p"] = [line[i::inner] for line in lines for i in range(inner)]
    etp = tp if etp is None else etp
    if ep > 1 or etp != tp:
        out.update(_expert_groups(pp, world_size // pp, ep, etp))
    return out


def _expert_groups(pp: int, stage: int, ep: int, etp: int) -> dict[str, list[list[int]]]:
    """The etp, ep, expert (etp x ep) and edp groups of every pipeline stage of ``stage`` ranks."""
    if ep < 1 or etp < 1 or stage % (ep * etp):
        raise ValueError(f"expert_model_parallel_size {ep} x expert_tensor_parallel_size {etp} = {ep * etp} must "
                         f"divide the {stage} ranks of a pipeline stage (tp x cp x dp)")
    width, edp = ep * etp, stage // (ep * etp)
    out: dict[str, list[list[int]]] = {"etp": [], "ep": [], "expert": [], "edp": []}
    for p in range(pp):
        ranks = range(p * stage, (p + 1) * stage)  # in tp-cp-dp order
        out["etp"] += [list(ranks[b * etp:(b + 1) * etp]) for b in range(stage // etp)]
        out["expert"] += [list(ranks[x * width:(x + 1) * width]) for x in range(edp)]
        out["ep"] += [list(ranks[x * width + t:(x + 1) * width:etp]) for x in range(edp) for t in range(etp)]
        out["edp"] += [list(ranks[t + etp * e::width]) for e in range(ep) for t in range(etp)]
    return out
