"""Mamba-2's token mixer (Nemotron-H's, megatron-core's ``MambaMixer``) over this rank's heads.

``x`` -> z, x, B, C, dt (three column-parallel projections) -> causal depthwise convolution of [x, B, C] and SiLU
-> the selective scan (``ssd.py``; Δ = softplus(dt + dt_bias), A = -exp(A_log), the skip D) -> grouped RMSNorm of
``y * silu(z)`` -> row-parallel ``out_proj``.

Weight layouts (full, i.e. tp=1, shapes; d = heads * head_dim, gN = groups * state):

* ``in_proj_zx.weight`` ``[2d, h]`` = ``[z; x]``, ``in_proj_bc.weight`` ``[2gN, h]`` = ``[B; C]`` (stride-2 partitions:
  rank r holds ``[z_r; x_r]`` and ``[B_r; C_r]``), ``in_proj_dt.weight`` ``[heads, h]``; transformers' and Megatron's
  fused ``in_proj`` is their concatenation ``[z; x; B; C; dt]``. ``out_proj.weight`` ``[h, d]``.
* ``conv_weight`` ``[d + 2gN, K]`` (tap K-1 is the token itself; Megatron's ``conv1d.weight`` ``[C, 1, K]``) and
  ``conv_bias`` over the channels ``[x; B; C]``; ``A_log``, ``D``, ``dt_bias`` ``[heads]``; ``norm_weight`` ``[d]``.
  These are replicated (whole on every TP rank, each using its heads' and groups' slice), their gradients summed
  over TP (``sequence_parallel`` marks them), so they are the same tensors at every TP size.

TP splits by whole groups (``mamba_num_groups % tp == 0``): a rank's heads read only its own groups' B and C, and
the grouped norm never spans two ranks. Under sequence parallelism the projections gather the sequence and
``out_proj`` reduce-scatters it, as attention does. Packed documents and context parallelism are the driver's
(``sequence.py``). Incremental decoding (``context.cache``) keeps the convolution's last K-1 inputs of this rank's
``[x; B; C]`` channels and the scan's state per layer, and runs one recurrent step per new token.

Initialisation (megatron-core's, drawn TP-invariantly, :func:`~megazero.model.init.keyed_uniform`): A uniform in
[1, 16]; Δ log-uniform in [dt_min, dt_max] floored at dt_init_floor, dt_bias its softplus inverse; the convolution's
weight and bias uniform in ±1/sqrt(K) (``nn.Conv1d``'s default, which Megatron keeps); D and the norm weight 1.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu

from ..config import GPTConfig
from ..forward_context import ForwardContext
from ..init import init_methods, keyed_uniform
from ..mlp import GatedColumnParallelLinear
from .gated_norm import gated_rms_norm
from .kernels import ssd_scan
from .replicated import as_used, replicated_parameter
from .sequence import HeadsExchange, Scan, local_runs, recurrent_scan, short_convolution
from .ssd import recurrent_ssd_scan, ssd_transition

__all__ = ["MambaMixer"]

A_INIT_RANGE = (1.0, 16.0)
DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4


class MambaMixer(torch.nn.Module):
    """Mamba-2 mixer of layer ``number`` over this rank's ``heads / tp_size`` heads (see the module's doc).
    ``chunk_size``: the scan's chunk length (megatron-core's default 128; it changes rounding, not the result)."""

    def __init__(self, config: GPTConfig, *, number: int = 0, tp_group: Optional[dist.ProcessGroup], tp_size: int,
                 device=None, chunk_size: int = 128) -> None:
        super().__init__()
        c = config
        self.number, self.chunk_size, self.eps = number, chunk_size, c.layernorm_epsilon
        self.tp_size = tp_size
        self.heads, self.head_dim = c.mamba_heads, c.mamba_head_dim
        self.groups, self.state = c.mamba_num_groups, c.mamba_state_dim
        self.kernel = c.linear_conv_kernel_dim
        self.heads_exchange = c.linear_cp_comm_type == "a2a"
        if self.heads % self.groups or self.groups % tp_size:
            raise ValueError(f"Mamba-2 needs heads ({self.heads}) divisible by mamba_num_groups ({self.groups}) and "
                             f"groups divisible by the tensor parallel size ({tp_size}): lower tp or change the groups")
        self.d_inner, self.bc_width = self.heads * self.head_dim, self.groups * self.state
        common = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device,
                      sequence_parallel=c.sequence_parallel, bias=c.add_bias_linear)
        init, output_init = init_methods(c)
        self.in_proj_zx = GatedColumnParallelLinear(c.hidden_size, self.d_inner, init_method=init, **common)
        self.in_proj_bc = GatedColumnParallelLinear(c.hidden_size, self.bc_width, init_method=init, **common)
        self.in_proj_dt = mpu.ColumnParallelLinear(c.hidden_size, self.heads, gather_output=False, init_method=init,
                                                   **common)
        self.out_proj = mpu.RowParallelLinear(self.d_inner, c.hidden_size, input_is_parallel=True,
                                              init_method=output_init, **common)
        self.tp_group, self.tp_rank = self.out_proj.tp_group, self.out_proj.tp_rank  # resolved (None: registered)
        channels = self.d_inner + 2 * self.bc_width

        def replicated(*shape: int) -> torch.nn.Parameter:
            return replicated_parameter(*shape, tp_size=tp_size, dtype=c.params_dtype, device=device)

        self.conv_weight = replicated(channels, self.kernel)
        self.conv_weight.use_muon = False  # a bank of per-channel filters, not a matrix (Megatron's is 3-D)
        self.conv_bias = replicated(channels)
        self.A_log, self.D, self.dt_bias = replicated(self.heads), replicated(self.heads), replicated(self.heads)
        self.norm_weight = replicated(self.d_inner)
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This module's own parameters (the projections initialise themselves), from their names' draws."""
        bound = 1.0 / math.sqrt(self.kernel)  # kaiming_uniform(a=sqrt(5)) and nn.Conv1d's bias: fan_in = K
        self.conv_weight.copy_(keyed_uniform(self.conv_weight) * (2 * bound) - bound)
        self.conv_bias.copy_(keyed_uniform(self.conv_bias) * (2 * bound) - bound)
        lo, hi = A_INIT_RANGE
        self.A_log.copy_(torch.log(lo + (hi - lo) * keyed_uniform(self.A_log)))
        log_min, log_max = math.log(DT_MIN), math.log(DT_MAX)
        dt = torch.exp(log_min + (log_max - log_min) * keyed_uniform(self.dt_bias)).clamp(min=DT_INIT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.D.fill_(1.0)
        self.norm_weight.fill_(1.0)

    def _replicated(self) -> tuple[torch.Tensor, ...]:
        """The whole small weights as this forward uses them: under TP through the copy whose backward sums the
        gradient over the ranks (each uses only its heads' and groups' rows), as the norms' weights are."""
        ws = (self.conv_weight, self.conv_bias, self.A_log, self.D, self.dt_bias, self.norm_weight)
        return as_used(ws, self.tp_size, self.tp_group)

    def _conv_rows(self, w: torch.Tensor, head: int, heads: int, group: int, groups: int) -> torch.Tensor:
        """Rows of the ``[x; B; C]`` convolution ``w`` of heads ``head ..`` and groups ``group ..``."""
        P, N, d = self.head_dim, self.state, self.d_inner
        return torch.cat([w[head * P:(head + heads) * P], w[d + group * N:d + (group + groups) * N],
                          w[d + self.bc_width + group * N:d + self.bc_width + (group + groups) * N]])

    def _scan(self, A: torch.Tensor, D: torch.Tensor) -> Scan:
        """The SSD scan of inputs ``(x, Δ, B, C)`` with this rank's ``A`` and skip ``D`` (inside the scan, as
        transformers adds it); a state passes a run as ``M[b, H] * S``."""
        def run(x, delta, B, C, *, initial_state, starts):
            return ssd_scan(x, delta, A, B, C, D=D, initial_state=initial_state, starts=starts,
                                  chunk_size=self.chunk_size)

        def transition(x, delta, B, C, *, starts):
            return ssd_transition(delta, A, starts=starts)

        return Scan(run=run, transition=transition, carry=lambda M, S: M[..., None, None] * S)

    def forward(self, x: torch.Tensor, context: ForwardContext = ForwardContext()) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]``; ``context``: the document starts and context parallelism."""
        zx, _ = self.in_proj_zx(x)  # [s, b, 2d/tp] = [z_r, x_r], the whole (CP-local) sequence under SP
        bc, _ = self.in_proj_bc(x)  # [s, b, 2gN/tp] = [B_r, C_r]
        dt, _ = self.in_proj_dt(x)  # [s, b, heads/tp]
        d = self.d_inner // self.tp_size
        z, xs = torch.split(zx.transpose(0, 1), [d, d], dim=-1)  # batch-first for the driver
        B, C = (t.unflatten(-1, (-1, self.state)) for t in bc.transpose(0, 1).chunk(2, dim=-1))  # [b, s, g/tp, N]
        xs, dt = xs.unflatten(-1, (-1, self.head_dim)), dt.transpose(0, 1).unsqueeze(-1)  # [b, s, h/tp, P | 1]
        head, group = self.tp_rank * xs.size(2), self.tp_rank * B.size(2)
        weights = self._replicated()
        if context.cp is not None and self.heads_exchange:  # Megatron's: the whole sequence for 1/P of the groups
            ex = HeadsExchange.of(context)
            xs, dt, B, C = (ex.to_heads(t) for t in (xs, dt, B, C))
            y = self._mix(xs, dt, B, C, head + ex.rank * xs.size(2), group + ex.rank * B.size(2), weights,
                          ex.context)
            y = ex.to_sequence(y)
        else:
            y = self._mix(xs, dt, B, C, head, group, weights, context)  # [b, s, heads/tp, P]
        norm = weights[5][head * self.head_dim:head * self.head_dim + d]
        y = gated_rms_norm(y.flatten(2), z, norm, eps=self.eps, group_size=self.d_inner // self.groups,
                           norm_before_gate=False)
        out, _ = self.out_proj(y.transpose(0, 1).contiguous())  # [s(/tp), b, h]
        return out

    def _mix(self, xs, dt, B, C, head: int, group: int, weights: tuple, context: ForwardContext) -> torch.Tensor:
        """Convolution and scan of heads ``head ..`` and groups ``group ..``: ``xs`` ``[b, s, h', P]``, ``dt``
        ``[b, s, h', 1]`` (before its softplus), ``B``, ``C`` ``[b, s, g', N]`` -> ``y`` ``[b, s, h', P]``."""
        conv_w, conv_b, a_log, skip, dt_bias = weights[:5]
        h, g = xs.size(2), B.size(2)
        xbc = torch.cat([xs.flatten(2), B.flatten(2), C.flatten(2)], dim=-1)  # [b, s, hP + 2gN]
        s = xbc.size(1)
        runs = local_runs(context, s)
        cached = context.cache.recurrent(self.number) if context.cache is not None else None
        halo = cached.convolution_halo(xbc, self.kernel - 1) if cached is not None else None
        xbc = short_convolution(xbc, self._conv_rows(conv_w, head, h, group, g),
                                self._conv_rows(conv_b, head, h, group, g), context, runs=runs, halo=halo)
        xs, B, C = torch.split(xbc, [h * self.head_dim, g * self.state, g * self.state], dim=-1)
        heads = slice(head, head + h)
        delta = F.softplus(dt.squeeze(-1).float() + dt_bias[heads].float())
        A = -torch.exp(a_log[heads].float())
        inputs = [xs.unflatten(-1, (-1, self.head_dim)), delta, B.unflatten(-1, (-1, self.state)),
                  C.unflatten(-1, (-1, self.state))]
        if cached is None:
            return recurrent_scan(self._scan(A, skip[heads]), inputs, context, runs)
        # Decoding: from the cached state, one step per token (or the chunks of a prompt); no documents, no CP
        if s == 1:
            y, cached.state = recurrent_ssd_scan(inputs[0], inputs[1], A, *inputs[2:], D=skip[heads],
                                                 initial_state=cached.state, starts=context.starts)
        else:
            y, cached.state = self._scan(A, skip[heads]).run(*inputs, initial_state=cached.state,
                                                             starts=context.starts)
        return y

    def extra_repr(self) -> str:
        return (f"heads={self.heads} (per rank {self.heads // self.tp_size}), head_dim={self.head_dim}, "
                f"groups={self.groups}, state={self.state}, conv={self.kernel}, chunk_size={self.chunk_size}")
