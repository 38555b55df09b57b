"""Model-wide statistics of ZeRO-partitioned tensors, for --log-params-norm, --log-num-zeros-in-grad
and --log-optimizer-states-to-tensorboard.

Every rank holds a data-parallel partition of its tensor-parallel shard; a model-wide number
counts each element once: partitions are disjoint, TP shards are disjoint, and TP-replicated
parameters (norms, row-parallel biases) are counted on TP rank 0 only (``FlatGroup.norm_ranges``,
the rule the engine's gradient norm uses). The sums are completed over ``groups.dp_group`` (the
partitions) and ``groups.mp_group`` (the TP and PP shards): ``groups`` is the run's
:class:`~megazero.mpu.ParallelGroups`, the one the engine's groups come from.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.mpu import ParallelGroups
from megazero.utils.scopes import scope

__all__ = ["partition_stats", "params_norm", "optimizer_state_stats", "count_zeros_in_grads"]


def _ranges(engine, group):
    return group.norm_ranges(count_replicated=engine.tp_rank == 0)  # copies counted once per partitioning


def _complete(groups: ParallelGroups) -> tuple[Optional[dist.ProcessGroup], ...]:
    """The groups a rank's partial sums are reduced over: ``groups``' DP and model-parallel groups."""
    return groups.dp_group, groups.mp_group


@scope("train.norms")  # what a memory observer labels "step"
def partition_stats(engine, tensor_of: Callable[[object], Optional[torch.Tensor]],
                    groups: ParallelGroups) -> tuple[float, float, float]:
    """(L2 norm, L1 norm, max |x|) over the whole model of ``tensor_of(group)`` (aligned with the
    group's fp32 master partition; None for groups without it). Every rank of ``groups`` calls it."""
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    peak = torch.zeros(1, dtype=torch.float64, device=engine.device)
    for g in engine.groups:
        t = tensor_of(g)
        if t is None:
            continue
        for lo, hi in _ranges(engine, g):
            x = t[lo:hi].double()  # an offloaded master or moment is on the host: its sums come over
            sums[0] += x.pow(2).sum().to(sums.device)
            sums[1] += x.abs().sum().to(sums.device)
            peak = torch.maximum(peak, x.abs().max(dim=0, keepdim=True)[0].to(peak.device)) if hi > lo else peak
    engine.drop_pages()  # the NVMe maps' pages this read (offload)
    for group in _complete(groups):
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return float(sums[0].sqrt()), float(sums[1]), float(peak)


def params_norm(engine, groups: ParallelGroups) -> float:
    """Megatron's 'params-norm': the L2 norm of all (fp32 master) parameters."""
    return partition_stats(engine, lambda g: g.master, groups)[0]


def optimizer_state_stats(engine, groups: ParallelGroups) -> dict[str, float]:
    """Megatron-DeepSpeed's --log-optimizer-states-to-tensorboard scalars: the state the optimizer's
    component names (Adam's momentum, variance and variance_sqrt) and the weights."""
    out: dict[str, float] = {}
    state = engine.optimizer.state
    named = [(name, lambda g, pick=pick: pick(state.get(g.master, {})))
             for name, pick in engine.config.optimizer.component.state_stats()]
    for name, of in (*named, ("weight", lambda g: g.master)):
        l2, l1, peak = partition_stats(engine, of, groups)
        out.update({f"optimizer/{name}_l2": l2, f"optimizer/{name}_l1": l1, f"optimizer/{name}_abs_max": peak})
    return out


class count_zeros_in_grads:
    """--log-num-zeros-in-grad: count the zeros of the (reduced, unscaled) gradient when the
    optimizer steps (the engine's ``before_update`` hook: each elementwise group's gradient is its
    ``master.grad`` then); an offloaded group's gradient never becomes a ``master.grad`` (it streams
    to the host from the engine's partition), so its zeros are counted there (scaling does not change
    which elements are zero)."""

    def __init__(self, engine, groups: ParallelGroups) -> None:
        self.engine, self.groups, self.zeros = engine, groups, None
        engine.before_update.append(self._count)

    def _count(self, engine) -> None:
        local = torch.zeros(1, dtype=torch.float64, device=self.engine.device)
        for g in self.engine.groups:
            grad = self.engine.grad_shard.get(g) if self.engine.is_offloaded(g) else g.master.grad
            if grad is not None:
                for lo, hi in _ranges(self.engine, g):
                    local += (grad[lo:hi] == 0).sum()
        for group in _complete(self.groups):
            dist.all_reduce(local, group=group)
        self.zeros = local  # on the device: read (float) when the log line is written
