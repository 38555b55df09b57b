"""The dense MLP of a transformer layer (also one expert of a mixture), from tensor-parallel linears.

``linear_fc1.weight`` of a gated unit (SwiGLU, quick GEGLU) is ``[2*ffn, h]``, logically ``[gate; up]``; rank
``r`` holds ``[gate_r; up_r]`` (rows of its own ffn slice of each), so ``partition_stride=2``. A gated unit is
``act(gate') * (up' + glu_linear_offset)`` with ``gate' = min(gate, c)`` and ``up' = clamp(up, -c, c)`` when
``activation_func_clamp_value`` is ``c`` (Megatron-core's unfused ``glu``; gpt-oss's experts with offset 1, c 7).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import initialize_sharded_

from .config import GPTConfig
from .init import init_methods

__all__ = ["MLP", "GatedColumnParallelLinear", "quick_gelu"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``, the sigmoid approximation of GELU (Megatron-core's ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


class GatedColumnParallelLinear(mpu.ColumnParallelLinear):
    """Column-parallel ``h -> 2*ffn`` whose full weight is ``[gate; up]`` and whose rank-``r``
    chunk is ``[gate_r; up_r]`` (stride-2 partition), so SwiGLU needs no communication."""

    def __init__(self, input_size: int, ffn_size: int, **kw) -> None:
        super().__init__(input_size, 2 * ffn_size, gather_output=False, **kw)
        for p in self.parameters(recurse=False):
            p.partition_stride = 2

    def reset_parameters(self) -> None:
        # The full [gate; up] weight, of which this rank holds [gate_r; up_r] (TP-invariant).
        initialize_sharded_(self.weight, (self.output_size, self.input_size), 0, self.tp_rank, self.tp_size,
                            self.init_method, stride=2)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()


class MLP(torch.nn.Module):
    """h -> ffn -> h with GeLU (tanh approximation, = HF 'gelu_new'), SwiGLU, quick GEGLU or squared ReLU."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 expert: bool = False, ffn_size: Optional[int] = None) -> None:
        """``expert``: one expert of a mixture (moe.py): ``moe_ffn_size`` wide (or ``ffn_size``: a shared
        expert), no sequence parallelism (the layer gathers the tokens), run through :meth:`partial`."""
        super().__init__()
        c = config
        self.activation, self.gated = c.activation, c.gated_linear_unit
        self.glu_offset, self.clamp = c.glu_linear_offset, c.activation_func_clamp_value
        ffn = ffn_size or (c.moe_ffn_size if expert else c.ffn_size)
        common = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device,
                      sequence_parallel=c.sequence_parallel and not expert, bias=c.add_bias_linear)
        init, output_init = init_methods(c)
        if self.gated:
            self.linear_fc1 = GatedColumnParallelLinear(c.hidden_size, ffn, init_method=init, **common)
        else:
            self.linear_fc1 = mpu.ColumnParallelLinear(c.hidden_size, ffn, gather_output=False, init_method=init, **common)
        self.linear_fc2 = mpu.RowParallelLinear(ffn, c.hidden_size, input_is_parallel=True,
                                                init_method=output_init, **common)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            if self.clamp is not None:
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            act = F.silu(gate) if self.activation == "swiglu" else quick_gelu(gate)
            return act * (up + self.glu_offset) if self.glu_offset else act * up
        if self.activation == "squared_relu":
            return torch.square(F.relu(h))
        return F.gelu(h, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]``."""
        h, _ = self.linear_fc1(x)  # [s, b, ffn/tp] (x2 for swiglu)
        out, _ = self.linear_fc2(self._act(h))
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This TP rank's share of the MLP without its collectives: ``x`` is whole on every TP rank and
        the output a partial sum over TP (an expert's: the mixture reduces all experts at once). The
        output bias enters the sum once, from TP rank 0, and its gradient is summed over TP so that
        every rank's copy gets it."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        out = F.linear(self._act(F.linear(x, fc1.weight, fc1.bias)), fc2.weight)
        bias = self.partial_output_bias()
        return out if bias is None else out + bias

    def partial_output_bias(self) -> Optional[torch.Tensor]:
        """fc2's bias as it enters this TP rank's partial sum (:meth:`partial`): whole on TP rank 0, zeros on
        the others, its gradient summed over TP so that every rank's copy gets it; None without a bias."""
        fc2 = self.linear_fc2
        if fc2.bias is None or fc2.tp_size == 1:
            return fc2.bias
        bias = mpu.copy_to_tensor_model_parallel_region(fc2.bias, fc2.tp_group)
        return bias * (1.0 if fc2.tp_rank == 0 else 0.0)
