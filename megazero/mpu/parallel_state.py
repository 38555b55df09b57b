"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

All groups live in one immutable :class:`ParallelGroups` object that
:func:`initialize_model_parallel` builds and returns. The Megatron-style
module-level getters (``get_tensor_model_parallel_rank()`` ...) read that one
object; everything else in megazero takes a group explicitly and only defaults
to the registry. This module-level registry (the groups and the model-parallel RNG
streams) is the only mutable global state in the package.

Rank layout (Megatron-LM's): with ``world = tp * dp * pp``::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so TP groups are consecutive ranks (they share the fastest links inside a
node), DP groups stride over TP, and PP groups stride over TP x DP.

Worked example, 16 ranks, tp=2, pp=4 (so dp=2)::

    TP groups (8):  [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    DP groups (8):  [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    PP groups (2x2):[0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    MP groups (tp x pp, DeepSpeed's "model parallel"), one per dp rank:
                    [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]

Rank 5 is therefore tp_rank 1, dp_rank 0, pp_rank 1.

Pipeline extras (Megatron's): the *embedding group* of each pipeline joins its first
and last stage, which both hold the word embedding when input and output weights are
tied (their gradients are all-reduced over it); above, [0, 12] [1, 13] [2, 14] [3, 15].
The *position-embedding group* is the first stage alone ([0] [1] [2] [3]): a decoder-only
GPT keeps learned positions there only. With ``v`` virtual stages (interleaving) rank
``r`` holds model chunks ``c = 0..v-1``, virtual stage ``c * pp + r``; the chunk being run
is passed explicitly (``virtual_rank=``) instead of Megatron's mutable global.

Every group megazero creates goes through :func:`new_group`, which gives it the default
group's collective timeout: torch would otherwise give each subgroup its backend's default
(10 minutes for NCCL), whatever timeout the default group was initialized with.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .rank_layout import _data_parallel_size, context_parallel_rank, group_ranks, rank_coordinates, rank_grid

__all__ = [
    "ParallelGroups",
    "rank_grid",
    "context_parallel_rank",
    "group_ranks",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "destroy_model_parallel",
    "get_parallel_groups",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_virtual_pipeline_model_parallel_world_size",
    "get_embedding_group",
    "get_embedding_ranks",
    "is_rank_in_embedding_group",
    "get_position_embedding_group",
    "is_rank_in_position_embedding_group",
    "get_data_parallel_group",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_context_parallel_global_ranks",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_src_rank",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_device",
    "new_group",
    "collective_timeout",
]


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """Every process group of one rank, plus the ranks each group contains."""

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    mp_group: Optional[dist.ProcessGroup]
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    mp_ranks: tuple[int, ...]
    # Pipeline: the first+last stage pair of this pipeline (None / () on middle stages),
    # the first stage alone for positions, and the number of model chunks per rank.
    embedding_group: Optional[dist.ProcessGroup] = None
    embedding_ranks: tuple[int, ...] = ()
    position_embedding_group: Optional[dist.ProcessGroup] = None
    position_embedding_ranks: tuple[int, ...] = ()
    virtual_pp_size: int = 1
    # Context parallelism: the ranks that split one sequence (same tp, dp and pp coordinates), and
    # data x context parallel ranks, over which parameters are replicated and ZeRO partitions.
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Optional[dist.ProcessGroup] = None
    cp_ranks: tuple[int, ...] = ()
    dp_cp_group: Optional[dist.ProcessGroup] = None
    dp_cp_ranks: tuple[int, ...] = ()
    # Hierarchical CP (a2a inside, p2p across): this rank's all-to-all and ring groups, or None.
    hcp_a2a_group: Optional[dist.ProcessGroup] = None
    hcp_p2p_group: Optional[dist.ProcessGroup] = None
    # Expert parallelism: the ranks whose experts together make a layer's (ep), and the ranks holding
    # the same experts (edp: expert data parallel, over which ZeRO partitions them). Without EP the
    # experts are replicated like the dense weights: ep_group None, edp the data x context group.
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None
    ep_ranks: tuple[int, ...] = ()
    edp_group: Optional[dist.ProcessGroup] = None
    edp_ranks: tuple[int, ...] = ()
    # Expert tensor parallelism: the ranks sharing one expert's weights (the TP group when etp = tp,
    # None when 1), and etp x ep (built only when etp differs from tp: the experts' own exchange).
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: Optional[dist.ProcessGroup] = None
    expert_group: Optional[dist.ProcessGroup] = None
    expert_ranks: tuple[int, ...] = ()

    def is_first_stage(self, virtual_rank: Optional[int] = 0) -> bool:
        """First virtual stage: pp rank 0 running chunk ``virtual_rank`` 0 (None ignores the chunk)."""
        return self.pp_rank == 0 and (virtual_rank is None or virtual_rank == 0)

    def is_last_stage(self, virtual_rank: Optional[int] = None) -> bool:
        """Last virtual stage: last pp rank running its last chunk (None ignores the chunk)."""
        last_chunk = virtual_rank is None or virtual_rank == self.virtual_pp_size - 1
        return self.pp_rank == self.pp_size - 1 and last_chunk

    @property
    def in_embedding_group(self) -> bool:
        return self.embedding_group is not None

    @property
    def dp_cp_size(self) -> int:
        """Ranks holding the same parameters: data x context parallel."""
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def mp_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def mp_rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank


def collective_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[datetime.timedelta]:
    """The timeout ``group``'s collectives run under (default: the default group's), as its
    backend holds it (so it reflects a later ``_set_pg_timeout``); None when torch.distributed is
    not initialized or the group's backend keeps no timeout (a fake or custom process group)."""
    if group is None:
        if not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without torch's Options
            continue
    return None


def new_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks, **kwargs)`` with the default group's collective timeout.

    Every process group megazero creates is made here. An explicit ``timeout=`` is kept; without
    one the group gets the timeout the default group runs under (``init_distributed(timeout_s=)``
    or the caller's own ``init_process_group(timeout=)``), where torch would give it the backend's
    default (10 minutes for NCCL, 30 for gloo) and the NCCL watchdog would end a wait the run is
    configured to allow.
    """
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = collective_timeout()
    return dist.new_group(ranks, **kwargs)


# The registry: this process's groups, and its model-parallel RNG streams (mpu.random's
# RNGStatesTracker, made on first use through rng_tracker(); kept here so that one registry holds
# all of the package's mutable state, and outliving destroy_model_parallel as the seeds do).
_GROUPS: Optional[ParallelGroups] = None
_RNG_TRACKER: Any = None


def rng_tracker(create: Callable[[], Any]) -> Any:
    """The registry's RNG tracker, made with ``create()`` the first time it is asked for."""
    global _RNG_TRACKER
    if _RNG_TRACKER is None:
        _RNG_TRACKER = create()
    return _RNG_TRACKER


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    backend: Optional[str] = None,
) -> ParallelGroups:
    """Build the TP/CP/PP/DP/MP and embedding groups (Megatron's layout, tp-cp-dp-pp) and register them.

    ``torch.distributed`` must already be initialized; every rank must call this
    with the same sizes, because creating a group is a collective call. Every group
    gets the default group's collective timeout (:func:`new_group`).
    """
    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "(or megazero.mpu.init_distributed()) before initialize_model_parallel"
        )
    if _GROUPS is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    vpp = virtual_pipeline_model_parallel_size or 1
    if vpp < 1 or (vpp > 1 and pp < 2):
        raise ValueError(f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                         f"(got {pp}); leave it unset without a pipeline")
    cp = context_parallel_size
    hcp = tuple(hierarchical_context_parallel_sizes) if hierarchical_context_parallel_sizes else None
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    layout = group_ranks(world, tp, pp, cp, hcp, ep, etp)
    dp = world // (tp * pp * cp)

    built: dict[str, tuple[Optional[dist.ProcessGroup], tuple[int, ...]]] = {}
    kinds = ("tp", "dp", "pp", "mp", "embedding", "position_embedding") + (("cp", "dp_cp") if cp > 1 else ())
    kinds += (("hcp_a2a", "hcp_p2p") if hcp and cp > 1 else ()) + _expert_kinds(tp, ep, etp)
    for kind in kinds:
        # Every rank creates every group, in the same order (new_group is collective).
        for line in layout[kind]:
            g = new_group(line, backend=backend)
            if rank in line:
                built[kind] = (g, tuple(line))
    (tp_group, tp_ranks), (dp_group, dp_ranks) = built["tp"], built["dp"]
    (pp_group, pp_ranks), (mp_group, mp_ranks) = built["pp"], built["mp"]
    emb_group, emb_ranks = built.get("embedding", (None, ()))
    pos_group, pos_ranks = built.get("position_embedding", (None, ()))

    pp_rank, dp_rank, tp_rank = rank_coordinates(rank, world, tp, pp, cp)
    cp_group, cp_ranks = built.get("cp", (None, (rank,)))
    dp_cp_group, dp_cp_ranks = built.get("dp_cp", (dp_group, dp_ranks))
    _GROUPS = ParallelGroups(
        tp_size=tp, pp_size=pp, dp_size=dp,
        tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
        tp_group=tp_group, pp_group=pp_group, dp_group=dp_group, mp_group=mp_group,
        tp_ranks=tp_ranks, pp_ranks=pp_ranks, dp_ranks=dp_ranks, mp_ranks=mp_ranks,
        embedding_group=emb_group, embedding_ranks=emb_ranks,
        position_embedding_group=pos_group, position_embedding_ranks=pos_ranks,
        virtual_pp_size=vpp,
        cp_size=cp, cp_rank=context_parallel_rank(rank, tp, cp), cp_group=cp_group, cp_ranks=cp_ranks,
        dp_cp_group=dp_cp_group, dp_cp_ranks=dp_cp_ranks,
        hcp_a2a_group=built.get("hcp_a2a", (None,))[0], hcp_p2p_group=built.get("hcp_p2p", (None,))[0],
        ep_size=ep, ep_rank=built["ep"][1].index(rank) if ep > 1 else 0,
        ep_group=built.get("ep", (None,))[0], ep_ranks=built.get("ep", (None, (rank,)))[1],
        edp_group=built.get("edp", (dp_cp_group,))[0], edp_ranks=built.get("edp", (None, dp_cp_ranks))[1],
        **_expert_tensor_fields(built, rank, tp, etp, tp_group),
    )
    return _GROUPS


def _expert_kinds(tp: int, ep: int, etp: int) -> tuple[str, ...]:
    """The expert groups a launch builds: none without experts' own layout; the etp and etp x ep groups
    only where they are not the TP or EP groups already built."""
    if ep == 1 and etp == tp:
        return ()
    own = etp != tp and etp > 1
    return (("etp",) if own else ()) + (("ep",) if ep > 1 else ()) + (("expert",) if own and ep > 1 else ()) \
        + ("edp",)


def _expert_tensor_fields(built: dict, rank: int, tp: int, etp: int, tp_group) -> dict:
    """ParallelGroups' expert tensor-parallel fields from the groups built."""
    if etp == tp:
        return dict(etp_size=tp, etp_rank=rank % tp, etp_group=tp_group)
    etp_group = built.get("etp", (None,))[0]
    expert_group, expert_ranks = built.get("expert", built.get("ep", built.get("etp", (None, (rank,)))))
    return dict(etp_size=etp, etp_rank=rank % etp, etp_group=etp_group, expert_group=expert_group,
                expert_ranks=expert_ranks)


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def destroy_model_parallel() -> None:
    """Forget (and destroy) the registered groups; safe to call when none exist."""
    global _GROUPS
    groups, _GROUPS = _GROUPS, None
    if groups is None or not dist.is_initialized():
        return
    for g in {groups.tp_group, groups.pp_group, groups.dp_group, groups.mp_group, groups.embedding_group,
              groups.position_embedding_group, groups.cp_group, groups.dp_cp_group, groups.hcp_a2a_group,
              groups.hcp_p2p_group, groups.ep_group, groups.edp_group, groups.etp_group, groups.expert_group}:
        if g is not None:
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError):  # already gone with the default group
                pass


def get_parallel_groups() -> ParallelGroups:
    """The registered groups; raises a clear error when none were initialized."""
    if _GROUPS is None:
        raise RuntimeError("model parallel groups are not initialized: call megazero.mpu.initialize_model_parallel(tp, pp)")
    return _GROUPS


def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_groups().tp_group


def get_tensor_model_parallel_rank() -> int:
    return _GROUPS.tp_rank if _GROUPS is not None else 0


def get_tensor_model_parallel_world_size() -> int:
    return _GROUPS.tp_size if _GROUPS is not None else 1


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (used for broadcasts)."""
    return get_parallel_groups().tp_ranks[0]


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_groups().pp_group


def get_pipeline_model_parallel_rank() -> int:
    return _GROUPS.pp_rank if _GROUPS is not None else 0


def get_pipeline_model_parallel_world_size() -> int:
    return _GROUPS.pp_size if _GROUPS is not None else 1


def is_pipeline_first_stage(ignore_virtual: bool = True, *, virtual_rank: int = 0) -> bool:
    """First pipeline stage; with ``ignore_virtual=False`` also model chunk ``virtual_rank`` 0."""
    if _GROUPS is None:
        return True
    return _GROUPS.is_first_stage(None if ignore_virtual else virtual_rank)


def is_pipeline_last_stage(ignore_virtual: bool = True, *, virtual_rank: Optional[int] = None) -> bool:
    """Last pipeline stage; with ``ignore_virtual=False`` also its last model chunk."""
    if _GROUPS is None:
        return True
    if ignore_virtual:
        return _GROUPS.is_last_stage(None)
    return _GROUPS.is_last_stage(_GROUPS.virtual_pp_size - 1 if virtual_rank is None else virtual_rank)


def get_virtual_pipeline_model_parallel_world_size() -> int:
    return _GROUPS.virtual_pp_size if _GROUPS is not None else 1


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last stage of this rank's pipeline; None on a middle stage."""
    return get_parallel_groups().embedding_group


def get_embedding_ranks() -> tuple[int, ...]:
    return get_parallel_groups().embedding_ranks


def is_rank_in_embedding_group() -> bool:
    return _GROUPS is None or _GROUPS.in_embedding_group


def get_position_embedding_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_groups().position_embedding_group


def is_rank_in_position_embedding_group() -> bool:
    return _GROUPS is None or _GROUPS.position_embedding_group is not None


def get_data_parallel_group(with_context_parallel: bool = False) -> Optional[dist.ProcessGroup]:
    """The data-parallel group; ``with_context_parallel``: data x context (Megatron's keyword)."""
    g = get_parallel_groups()
    return g.dp_cp_group if with_context_parallel else g.dp_group


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    if _GROUPS is None:
        return 0
    return _GROUPS.dp_cp_rank if with_context_parallel else _GROUPS.dp_rank


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if _GROUPS is None:
        return 1
    return _GROUPS.dp_cp_size if with_context_parallel else _GROUPS.dp_size


def get_context_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_groups().cp_group


def get_hierarchical_context_parallel_groups() -> Optional[list[dist.ProcessGroup]]:
    """Megatron's name: [all-to-all group, ring group] of hierarchical CP, or None without it."""
    g = get_parallel_groups()
    return [g.hcp_a2a_group, g.hcp_p2p_group] if g.hcp_a2a_group is not None else None


def get_expert_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_groups().ep_group


def get_expert_model_parallel_world_size() -> int:
    return _GROUPS.ep_size if _GROUPS is not None else 1


def get_expert_model_parallel_rank() -> int:
    return _GROUPS.ep_rank if _GROUPS is not None else 0


def get_expert_tensor_parallel_group() -> Optional[dist.ProcessGroup]:
    """The ranks sharing one expert's weights (the TP group when etp = tp; None when etp = 1)."""
    return get_parallel_groups().etp_group


def get_expert_tensor_parallel_world_size() -> int:
    return _GROUPS.etp_size if _GROUPS is not None else 1


def get_expert_tensor_parallel_rank() -> int:
    return _GROUPS.etp_rank if _GROUPS is not None else 0


def get_expert_tensor_and_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """etp x ep: the ranks that together hold every expert once (built when etp differs from tp)."""
    return get_parallel_groups().expert_group


def get_expert_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """The ranks holding the same experts (ZeRO partitions the experts over them)."""
    return get_parallel_groups().edp_group


def get_expert_data_parallel_world_size() -> int:
    return len(get_parallel_groups().edp_ranks) if _GROUPS is not None else 1


def get_expert_data_parallel_rank() -> int:
    g = get_parallel_groups()
    return g.edp_ranks.index(dist.get_rank()) if g.edp_ranks else 0


def get_context_parallel_rank() -> int:
    return _GROUPS.cp_rank if _GROUPS is not None else 0


def get_context_parallel_world_size() -> int:
    return _GROUPS.cp_size if _GROUPS is not None else 1


def get_context_parallel_global_ranks() -> list[int]:
    return list(get_parallel_groups().cp_ranks)


def get_data_parallel_src_rank() -> int:
    return get_parallel_groups().dp_ranks[0]


# DeepSpeed's `mpu` contract: "model parallel" means tensor x pipeline.
def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return get_parallel_groups().mp_group


def get_model_parallel_rank() -> int:
    return _GROUPS.mp_rank if _GROUPS is not None else 0


def get_model_parallel_world_size() -> int:
    return _GROUPS.mp_size if _GROUPS is not None else 1


def get_device() -> torch.device:
    """The compute device of this rank: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
