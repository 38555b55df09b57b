"""The routed experts of a mixture of experts on one rank (Megatron-core's SequentialMLP and GroupedMLP):
this rank's experts over the rows dispatched to them, each expert's rows consecutive.

Each expert is an MLP sharded over the expert tensor-parallel (ETP) group whose ``partial(x)`` skips
its reduction, so the outputs are partial sums over ETP. The experts are children named by their
global index (``experts.<e>.linear_fc1.weight``), so initial weights, checkpoints and the converters
do not depend on expert parallelism. With ``moe_grouped_gemm`` (where the dtype, device and widths
allow) they run as two grouped matmuls over all of them, the same bits as the loop without biases; each
expert's biases are then added to its own rows, fc2's once per expert (:meth:`MLP.partial_output_bias`).

Every parameter of an expert is marked ``is_expert = True`` and ``allreduce = False`` (Megatron's
marker: its gradient is not summed over the whole data-parallel group, only over the ranks holding the
expert); :func:`is_expert_parameter` reads the mark.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from .grouped_linear import group_offsets, grouped_linear, grouped_matmul_available

__all__ = ["Experts", "is_expert_parameter", "mark_expert_parameter"]


def mark_expert_parameter(param: torch.Tensor) -> None:
    """Mark ``param`` as a routed expert's: ZeRO partitions it over the expert-data-parallel ranks."""
    param.is_expert, param.allreduce = True, False


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether a parameter belongs to a routed expert: its ``is_expert`` mark, set when the experts are
    built (Megatron's ``allreduce = False`` comes with it)."""
    return bool(getattr(param, "is_expert", False))


class Experts(torch.nn.ModuleDict):
    """This rank's routed experts ``local`` (global indices), each built by ``build()``, keyed by
    ``str(index)``. ``etp_rank``/``etp_size``/``etp_group``: the expert tensor-parallel shard each
    holds; ``tp_size``: the layer's TP (a whole expert's bias under TP is then this rank's own)."""

    def __init__(self, config: GPTConfig, build: Callable[[], torch.nn.Module], local: range, *, tp_size: int,
                 etp_size: int, etp_rank: int, etp_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__({str(e): build() for e in local})
        self.config, self.local = config, local
        for p in self.parameters():  # the shard each holds (engine and checkpoints read it)
            p.tp_shard, p.tp_shard_group = (etp_rank, etp_size), (etp_group if etp_size > 1 else None)
            if etp_size == 1 and tp_size > 1 and not getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel, p.partition_dim = True, 0  # a whole expert's bias: this rank's own
            mark_expert_parameter(p)

    def forward(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """This rank's experts over ``rows`` (``per_expert[i]`` consecutive rows for local expert i, counts
        on the host): ``[N, h]``, partial sums over ETP."""
        if self.grouped(rows):
            return self._grouped_mlp(rows, per_expert)
        return torch.cat([self[str(e)].partial(chunk) for e, chunk in zip(self.local, rows.split(per_expert))])

    def grouped(self, rows: torch.Tensor) -> bool:
        """Whether the experts run as grouped matmuls (asked, available, the dtype and widths allow)."""
        if not self.config.moe_grouped_gemm or not grouped_matmul_available(rows.dtype, rows.device):
            return False
        fc2 = self[str(self.local.start)].linear_fc2.weight
        size = rows.element_size()
        return (rows.size(-1) * size) % 16 == 0 and (fc2.size(1) * size) % 16 == 0

    def _grouped_mlp(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """Every local expert's MLP over its rows in two grouped matmuls (the same bits as the loop without
        biases), each expert's biases added to its rows."""
        experts = [self[str(e)] for e in self.local]
        offs = group_offsets(per_expert, rows.device)
        h = grouped_linear(rows, offs, [m.linear_fc1.weight for m in experts])
        if self.config.add_bias_linear:
            h = h + _rows_of(per_expert, [m.linear_fc1.bias for m in experts])
        out = grouped_linear(experts[0]._act(h), offs, [m.linear_fc2.weight for m in experts])
        if self.config.add_bias_linear:
            out = out + _rows_of(per_expert, [m.partial_output_bias() for m in experts])
        return out


def _rows_of(per_expert: list, biases: list) -> torch.Tensor:
    """``[N, out]``: each expert's bias repeated over its ``per_expert`` rows (its gradient: their sum)."""
    return torch.cat([b.expand(n, -1) for b, n in zip(biases, per_expert)])
