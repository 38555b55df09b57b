"""Kimi Delta Attention (KDA) as Kimi Linear mixes tokens (transformers' ``KimiLinearDeltaAttention``), over this
rank's heads.

q, k and v are projected, pass a short causal convolution and SiLU; q and k are normalised
(``x * rsqrt(sum x^2 + 1e-6)``, scaled by dk^-1/2 in the rule). The decay is one per key channel,
``g = -exp(A_log[head]) * softplus(f + dt_bias)`` with ``f`` projected from the layer's input (through a rank of
``kda_f_lora_rank``: Kimi Linear's f_a/f_b, or full rank when None); ``beta = sigmoid(b)``. The chunked KDA rule
(``kda_rule.py``) runs with its state in fp32; the output is normalised per head and multiplied by
``sigmoid(gate)``, the gate projected from the input like f (``kda_gate_lora_rank``), then projected back.

Tensor parallelism splits the heads: ``in_proj_qk`` is column-parallel with two equal parts (rank r holds
``[q_r; k_r]``), ``in_proj_v``, ``in_proj_b``, ``f_b_proj`` / ``f_proj`` and ``g_b_proj`` / ``g_proj``
column-parallel, ``out_proj`` row-parallel. The low-rank down projections (``f_a_proj``, ``g_a_proj``) are whole
on every rank, run on this rank's tokens (the up projection gathers the sequence under SP), as multi-latent
attention's; the small weights (the convolution over the ``[q; k; v]`` channels, ``A_log``, ``dt_bias``, the norm's
weight) are whole on every rank, each rank using its heads' slice, their gradients summed over TP. Packed documents
and context parallelism (state passing, or Megatron's heads all-to-all) are the driver's (``sequence.py``).
Incremental decoding (``context.cache``) keeps the convolution's last K-1 inputs and the rule's state per layer,
and runs one recurrent step per new token.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu

from ..attention.mla import ReplicatedLinear
from ..config import GPTConfig
from ..forward_context import ForwardContext
from ..init import init_methods, keyed_uniform
from ..mlp import GatedColumnParallelLinear
from .gated_delta_net import A_INIT_RANGE, l2norm
from .gated_norm import sigmoid_gated_rms_norm
from .kda_rule import chunk_kda_rule, kda_transition, recurrent_kda_rule
from .replicated import as_used, replicated_parameter
from .sequence import HeadsExchange, delta_scan, recurrent_scan, short_convolution

__all__ = ["KimiDeltaAttention", "KDA_SCAN"]

DT_RANGE, DT_FLOOR = (1e-3, 1e-1), 1e-4  # FLA's and Megatron's: softplus(dt_bias) log-uniform in the range


KDA_SCAN = delta_scan(chunk_kda_rule, kda_transition)


class KimiDeltaAttention(torch.nn.Module):
    """Kimi Delta Attention over ``linear_num_key_heads / tp`` heads of this rank."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 number: int = 0) -> None:
        super().__init__()
        c = config
        self.number, self.tp_size = number, tp_size
        self.heads, self.dk, self.dv = c.linear_num_key_heads // tp_size, c.linear_key_head_dim, c.linear_value_head_dim
        self.eps = c.layernorm_epsilon
        self.heads_exchange = c.linear_cp_comm_type == "a2a"
        init, output_init = init_methods(c)
        common = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device,
                      sequence_parallel=c.sequence_parallel)
        column = dict(gather_output=False, init_method=init, **common)
        key_dim, value_dim = c.linear_num_key_heads * self.dk, c.linear_num_key_heads * self.dv
        self.in_proj_qk = GatedColumnParallelLinear(c.hidden_size, key_dim, init_method=init, bias=c.add_bias_linear,
                                                    **common)
        self.in_proj_v = mpu.ColumnParallelLinear(c.hidden_size, value_dim, bias=c.add_bias_linear, **column)
        self.in_proj_b = mpu.ColumnParallelLinear(c.hidden_size, c.linear_num_key_heads, bias=c.add_bias_linear,
                                                  **column)
        whole = dict(bias=False, init_method=init, partial_grads=c.sequence_parallel and tp_size > 1,
                     tp_group=tp_group, params_dtype=c.params_dtype, device=device)
        for name, width, rank in (("f", key_dim, c.kda_f_lora_rank), ("g", value_dim, c.kda_gate_lora_rank)):
            if rank is None:  # Megatron's default: one full-rank projection
                setattr(self, f"{name}_proj", mpu.ColumnParallelLinear(c.hidden_size, width, bias=False, **column))
            else:  # Kimi Linear's: hidden -> rank (whole on every rank) -> heads (split)
                setattr(self, f"{name}_a_proj", ReplicatedLinear(c.hidden_size, rank, **whole))
                setattr(self, f"{name}_b_proj", mpu.ColumnParallelLinear(rank, width, bias=False, **column))
        self.out_proj = mpu.RowParallelLinear(value_dim, c.hidden_size, input_is_parallel=True,
                                              init_method=output_init, bias=c.add_bias_linear, **common)
        self.tp_rank = self.out_proj.tp_rank
        kw = dict(tp_size=tp_size, dtype=c.params_dtype, device=device)
        self.conv1d_weight = replicated_parameter(2 * key_dim + value_dim, c.linear_conv_kernel_dim, **kw)
        self.conv1d_weight.use_muon = False  # a bank of per-channel filters, not a matrix
        self.A_log = replicated_parameter(c.linear_num_key_heads, **kw)
        self.dt_bias = replicated_parameter(key_dim, **kw)
        self.norm_weight = replicated_parameter(self.dv, **kw)
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The layer's own small weights (the projections initialise themselves), drawn by name: the convolution
        as ``nn.Conv1d``'s default (U(+-1/sqrt(K))), A from U(1, 16), dt_bias the inverse softplus of a dt
        log-uniform in [1e-3, 1e-1] (floored at 1e-4; FLA's and Megatron's), the norm's weight ones."""
        bound = 1.0 / math.sqrt(self.conv1d_weight.size(1))
        self.conv1d_weight.copy_(keyed_uniform(self.conv1d_weight) * (2 * bound) - bound)
        lo, hi = A_INIT_RANGE
        self.A_log.copy_(torch.log(lo + (hi - lo) * keyed_uniform(self.A_log)))
        log_lo, log_hi = (math.log(d) for d in DT_RANGE)
        dt = torch.exp(log_lo + (log_hi - log_lo) * keyed_uniform(self.dt_bias)).clamp(min=DT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.norm_weight.fill_(1.0)

    def _conv_weight(self, w: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """The rows of the convolution ``w`` of heads ``first .. first + count`` of the full ``[q; k; v]``
        channels."""
        dk, dv = self.dk, self.dv
        key_dim = self.heads * self.tp_size * dk
        return torch.cat([w[first * dk:(first + count) * dk], w[key_dim + first * dk:key_dim + (first + count) * dk],
                          w[2 * key_dim + first * dv:2 * key_dim + (first + count) * dv]])

    def _replicated(self) -> tuple[torch.Tensor, ...]:
        """The whole small weights as this forward uses them: under TP through the copy whose backward sums the
        gradient over the ranks (each used only its heads' slice)."""
        ws = (self.conv1d_weight, self.A_log, self.dt_bias, self.norm_weight)
        return as_used(ws, self.tp_size, self.out_proj.tp_group)

    def _projected(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The decay's (``name`` 'f') or the output gate's ('g') projection of ``x``: ``[s, b, heads/tp * dim]``."""
        full = getattr(self, f"{name}_proj", None)
        if full is not None:
            return full(x)[0]
        return getattr(self, f"{name}_b_proj")(getattr(self, f"{name}_a_proj")(x))[0]

    def forward(self, x: torch.Tensor, context: ForwardContext = ForwardContext()) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]``; ``context``: document starts and context parallelism."""
        (qk, _), (v, _), (beta, _) = self.in_proj_qk(x), self.in_proj_v(x), self.in_proj_b(x)  # [s, b, ...]
        f, gate = self._projected("f", x), self._projected("g", x)
        qk, v, beta, f, gate = (t.transpose(0, 1) for t in (qk, v, beta, f, gate))  # batch first: [b, s, ...]
        b, s, n = qk.size(0), qk.size(1), self.heads
        q, k = (t.reshape(b, s, n, self.dk) for t in qk.chunk(2, dim=-1))
        v, f, beta = v.reshape(b, s, n, self.dv), f.reshape(b, s, n, self.dk), beta.unsqueeze(-1)  # beta [b, s, n, 1]
        first, weights = self.tp_rank * n, self._replicated()
        if context.cp is not None and self.heads_exchange:  # Megatron's: the whole sequence for 1/P of the heads
            ex = HeadsExchange.of(context)
            q, k, v, beta, f = (ex.to_heads(t) for t in (q, k, v, beta, f))
            o = ex.to_sequence(self._mix(q, k, v, beta, f, first + ex.rank * q.size(2), weights, ex.context))
        else:
            o = self._mix(q, k, v, beta, f, first, weights, context)
        y = sigmoid_gated_rms_norm(o, gate.reshape(b, s, n, self.dv), weights[3], eps=self.eps)
        out, _ = self.out_proj(y.reshape(b, s, -1).transpose(0, 1))
        return out

    def _mix(self, q, k, v, beta, f, first: int, weights: tuple, context: ForwardContext) -> torch.Tensor:
        """Convolution, gates and the rule over heads ``first ..`` (``q``, ``k``, ``f`` ``[b, s, n', dk]``; ``v``
        ``[b, s, n', dv]``; ``beta`` ``[b, s, n', 1]``, before their activations) -> ``[b, s, n', dv]``;
        ``weights``: the convolution, A_log and dt_bias (and the norm's weight) as :meth:`_replicated` gives them."""
        b, s, n = q.shape[:3]
        conv, a_log, dt_bias = weights[:3]
        flat = torch.cat([t.reshape(b, s, -1) for t in (q, k, v)], dim=-1)
        cached = context.cache.recurrent(self.number) if context.cache is not None else None
        weight = self._conv_weight(conv, first, n)
        halo = cached.convolution_halo(flat, weight.size(1) - 1) if cached is not None else None
        mixed = short_convolution(flat, weight, None, context, halo=halo)
        q, k, v = mixed.split([n * self.dk, n * self.dk, n * self.dv], dim=-1)
        q, k = l2norm(q.reshape(b, s, n, self.dk)), l2norm(k.reshape(b, s, n, self.dk))
        decay_rate = a_log[first:first + n].float().exp().unsqueeze(-1)  # [n, 1]
        bias = dt_bias[first * self.dk:(first + n) * self.dk].float().view(n, self.dk)
        g = -decay_rate * F.softplus(f.float() + bias)  # [b, s, n, dk], <= 0
        beta = torch.sigmoid(beta.squeeze(-1).float())
        v = v.reshape(b, s, n, self.dv)
        if cached is None:
            return recurrent_scan(KDA_SCAN, [q, k, v, g, beta], context)
        # Decoding: from the cached state, one step per token (or the chunks of a prompt); no documents, no CP
        rule = recurrent_kda_rule if s == 1 else chunk_kda_rule
        o, cached.state = rule(q, k, v, g, beta, initial_state=cached.state, starts=context.starts)
        return o
