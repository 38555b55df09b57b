"""Gated DeltaNet (Yang et al. 2024) as Qwen3-Next and Qwen3.5 mix tokens, over this rank's key heads.

q, k and v are projected, pass a short causal convolution and SiLU; q and k are normalised
(``x * rsqrt(sum x^2 + 1e-6)``, scaled by dk^-1/2 in the rule) and repeated to the value heads; the gates are
``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; the chunked gated delta rule
(``delta_rule.py``) runs with its state in fp32; the output is normalised per head and multiplied by silu(z)
(the gated RMSNorm), then projected back.

Tensor parallelism splits the key heads (and with them their value heads): ``in_proj_qk``, ``in_proj_vz`` and
``in_proj_ba`` are column-parallel with two equal parts each (rank r holds ``[q_r; k_r]``, ``[v_r; z_r]``,
``[b_r; a_r]``), ``out_proj`` row-parallel. The small weights (the convolution over the ``[q; k; v]`` channels,
``A_log``, ``dt_bias``, the norm's weight) are whole on every rank, each rank using its heads' slice, their
gradients summed over TP. Packed documents and context parallelism are the driver's (``sequence.py``). Incremental
decoding (``context.cache``) keeps the convolution's last K-1 inputs and the rule's state per layer, and runs one
recurrent step per new token.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu

from ..config import GPTConfig
from ..forward_context import ForwardContext
from ..init import init_methods, keyed_uniform
from ..mlp import GatedColumnParallelLinear
from .delta_rule import gated_delta_transition, recurrent_gated_delta_rule
from .gated_norm import gated_rms_norm
from .kernels import gated_delta_rule
from .replicated import as_used, replicated_parameter
from .sequence import HeadsExchange, delta_scan, recurrent_scan, short_convolution

__all__ = ["GatedDeltaNet", "GATED_DELTA_SCAN", "l2norm"]

A_INIT_RANGE = (1.0, 16.0)  # Megatron-core's: A = exp(A_log) drawn from U(1, 16)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dimension, in fp32 (FLA's and transformers' form)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


GATED_DELTA_SCAN = delta_scan(gated_delta_rule, gated_delta_transition)


class GatedDeltaNet(torch.nn.Module):
    """Gated DeltaNet over ``linear_num_key_heads / tp`` key heads and their value heads of this rank."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 number: int = 0) -> None:
        super().__init__()
        c = config
        self.number, self.tp_size = number, tp_size
        self.nk, self.nv = c.linear_num_key_heads // tp_size, c.linear_num_value_heads // tp_size
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.eps = c.layernorm_epsilon
        self.heads_exchange = c.linear_cp_comm_type == "a2a"
        init, output_init = init_methods(c)
        common = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device,
                      sequence_parallel=c.sequence_parallel, bias=c.add_bias_linear)
        key_dim, value_dim = c.linear_num_key_heads * self.dk, c.linear_num_value_heads * self.dv
        self.in_proj_qk = GatedColumnParallelLinear(c.hidden_size, key_dim, init_method=init, **common)
        self.in_proj_vz = GatedColumnParallelLinear(c.hidden_size, value_dim, init_method=init, **common)
        self.in_proj_ba = GatedColumnParallelLinear(c.hidden_size, c.linear_num_value_heads, init_method=init, **common)
        self.out_proj = mpu.RowParallelLinear(value_dim, c.hidden_size, input_is_parallel=True,
                                              init_method=output_init, **common)
        self.tp_rank = self.out_proj.tp_rank
        kw = dict(tp_size=tp_size, dtype=c.params_dtype, device=device)
        self.conv1d_weight = replicated_parameter(2 * key_dim + value_dim, c.linear_conv_kernel_dim, **kw)
        self.A_log = replicated_parameter(c.linear_num_value_heads, **kw)
        self.dt_bias = replicated_parameter(c.linear_num_value_heads, **kw)
        self.norm_weight = replicated_parameter(self.dv, **kw)
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters()

    def _conv_weight(self, w: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """The rows of the convolution ``w`` of key heads ``first .. first + count`` (and their value heads) of the
        full ``[q; k; v]`` channels."""
        dk, dv, r = self.dk, self.dv, self.nv // self.nk
        key_dim = self.nk * self.tp_size * dk
        return torch.cat([w[first * dk:(first + count) * dk], w[key_dim + first * dk:key_dim + (first + count) * dk],
                          w[2 * key_dim + first * r * dv:2 * key_dim + (first + count) * r * dv]])

    def reset_parameters(self) -> None:
        """The layer's own small weights (the projections initialise themselves): the convolution as
        ``nn.Conv1d``'s default (U(+-1/sqrt(K))), A from U(1, 16), dt_bias and the norm's weight ones."""
        bound = 1.0 / self.conv1d_weight.size(1) ** 0.5
        lo, hi = A_INIT_RANGE
        with torch.no_grad():
            self.conv1d_weight.copy_(keyed_uniform(self.conv1d_weight) * (2 * bound) - bound)
            self.A_log.copy_(torch.log(lo + (hi - lo) * keyed_uniform(self.A_log)))
            self.dt_bias.fill_(1.0)
            self.norm_weight.fill_(1.0)

    def _replicated(self) -> tuple[torch.Tensor, ...]:
        """The whole small weights as this forward uses them: under TP through the copy whose backward sums the
        gradient over the ranks (each used only its heads' slice), as the norms' weights are."""
        ws = (self.conv1d_weight, self.A_log, self.dt_bias, self.norm_weight)
        return as_used(ws, self.tp_size, self.out_proj.tp_group)

    def forward(self, x: torch.Tensor, context: ForwardContext = ForwardContext()) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]``; ``context``: document starts and context parallelism."""
        (qk, _), (vz, _), (ba, _) = self.in_proj_qk(x), self.in_proj_vz(x), self.in_proj_ba(x)  # [s, b, 2 * ...]
        qk, vz, ba = (t.transpose(0, 1) for t in (qk, vz, ba))  # batch first: [b, s, ...]
        b, s = qk.shape[:2]
        q, k = (t.reshape(b, s, self.nk, self.dk) for t in qk.chunk(2, dim=-1))
        v, z = (t.reshape(b, s, self.nv, self.dv) for t in vz.chunk(2, dim=-1))
        beta, a = (t.unsqueeze(-1) for t in ba.chunk(2, dim=-1))  # [b, s, nv, 1]
        first, weights = self.tp_rank * self.nk, self._replicated()
        if context.cp is not None and self.heads_exchange:  # Megatron's: the whole sequence for 1/P of the heads
            ex = HeadsExchange.of(context)
            q, k, v, beta, a = (ex.to_heads(t) for t in (q, k, v, beta, a))
            o = ex.to_sequence(self._mix(q, k, v, beta, a, first + ex.rank * q.size(2), weights, ex.context))
        else:
            o = self._mix(q, k, v, beta, a, first, weights, context)
        y = gated_rms_norm(o, z, weights[3], eps=self.eps, norm_before_gate=True)
        out, _ = self.out_proj(y.reshape(b, s, -1).transpose(0, 1))
        return out

    def _mix(self, q, k, v, beta, a, first: int, weights: tuple, context: ForwardContext) -> torch.Tensor:
        """Convolution, gates and the rule over key heads ``first ..`` (``q``, ``k`` ``[b, s, nk', dk]``; ``v``
        ``[b, s, nv', dv]``; ``beta``, ``a`` ``[b, s, nv', 1]``, before their activations) -> ``[b, s, nv', dv]``;
        ``weights``: the convolution, A_log and dt_bias (and the norm's weight) as :meth:`_replicated` gives them."""
        b, s, nk, nv = q.size(0), q.size(1), q.size(2), v.size(2)
        conv, a_log, dt_bias = weights[:3]
        flat = torch.cat([t.reshape(b, s, -1) for t in (q, k, v)], dim=-1)
        cached = context.cache.recurrent(self.number) if context.cache is not None else None
        weight = self._conv_weight(conv, first, nk)
        halo = cached.convolution_halo(flat, weight.size(1) - 1) if cached is not None else None
        mixed = short_convolution(flat, weight, None, context, halo=halo)
        q, k, v = mixed.split([nk * self.dk, nk * self.dk, nv * self.dv], dim=-1)
        q = l2norm(q.reshape(b, s, nk, self.dk)).repeat_interleave(nv // nk, dim=2)
        k = l2norm(k.reshape(b, s, nk, self.dk)).repeat_interleave(nv // nk, dim=2)
        heads = slice(first * (nv // nk), first * (nv // nk) + nv)
        g = -a_log[heads].float().exp() * F.softplus(a.squeeze(-1).float() + dt_bias[heads].float())
        beta = torch.sigmoid(beta.squeeze(-1).float())
        v = v.reshape(b, s, nv, self.dv)
        if cached is None:
            return recurrent_scan(GATED_DELTA_SCAN, [q, k, v, g, beta], context)
        # Decoding: from the cached state, one step per token (or the chunks of a prompt); no documents, no CP
        rule = recurrent_gated_delta_rule if s == 1 else gated_delta_rule
        o, cached.state = rule(q, k, v, g, beta, initial_state=cached.state, starts=context.starts)
        return o
