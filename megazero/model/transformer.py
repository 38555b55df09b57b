"""One pre-norm transformer layer (attention + MLP) built from tensor-parallel linears.

Activations are ``[s, b, h]`` (``[s/tp, b, h]`` between the parallel linears under
sequence parallelism). Each rank owns ``heads/tp`` attention heads and ``ffn/tp``
MLP columns; the only communication is inside the mpu linears.

Weight layouts (full, i.e. tp=1, shapes; the converters depend on them):

* ``self_attention.linear_qkv.weight`` ``[(heads + 2*groups) * d, h]``: one block per
  query group ``g`` (``groups`` blocks, in order), each ``[q heads of g (heads/groups * d rows);
  k_g (d rows); v_g (d rows)]`` (Megatron's layout). Contiguous TP chunks therefore give
  every rank whole groups: its own heads' q, k and v. The bias follows the same rows.
* ``mlp.linear_fc1.weight`` for SwiGLU ``[2*ffn, h]`` is logically ``[gate; up]``; rank ``r``
  holds ``[gate_r; up_r]`` (rows of its own ffn slice of each), so ``partition_stride=2``.
* ``self_attention.q_layernorm`` / ``k_layernorm`` (``qk_layernorm``): ``[d]``, replicated; each
  TP rank normalizes only its own heads, so their gradients are summed over TP.

The head dimension ``d`` is ``config.head_dim`` (``kv_channels``), which need not be
``hidden / heads``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import init_method_normal, initialize_sharded_, scaled_init_method_normal

from .attention.core import core_attention
from .attention.cp_context import ContextParallel, context_parallel_attention
from .config import GPTConfig
from .norms import build_norm
from .keyed_dropout import AttentionDropout, DropoutKey, keyed_dropout
from .moe.layer import AuxLossScale, MoELayer, is_moe_layer
from .attention.rope import apply_rotary

__all__ = ["SelfAttention", "MLP", "TransformerLayer", "GatedColumnParallelLinear", "dropout", "init_methods"]

Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ExpertParallel:
    """Where a model's experts live: the expert-parallel ``group`` (None: one rank holds them all), its
    ``size`` and this rank's place, and the model's :class:`~megazero.model.moe.AuxLossScale`. Expert
    tensor parallelism: ``tensor_size`` None is the model's TP (the experts sharded over its group);
    otherwise the experts are sharded over ``tensor_group`` (``tensor_rank`` of ``tensor_size``) and the
    tokens travel over ``exchange_group`` (etp x ep)."""

    group: Optional[dist.ProcessGroup] = None
    size: int = 1
    rank: int = 0
    aux_scale: AuxLossScale = field(default_factory=AuxLossScale)
    tensor_group: Optional[dist.ProcessGroup] = None
    tensor_size: Optional[int] = None
    tensor_rank: int = 0
    exchange_group: Optional[dist.ProcessGroup] = None


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool,
            key: Optional[DropoutKey] = None, site: int = 0) -> torch.Tensor:
    """Hidden dropout. With ``key``, keyed by position at ``site`` (``keyed_dropout.py``). Otherwise
    sequence-parallel shards hold different tokens on each TP rank, so their masks come from the
    model-parallel RNG stream; replicated activations use the default generator (identical on all
    TP ranks, as the math requires)."""
    if not training or p == 0.0:
        return x
    if key is not None:
        return keyed_dropout(x, p, key, site)
    with mpu.get_rng_tracker().fork(device=x.device) if sequence_parallel else contextlib.nullcontext():
        return F.dropout(x, p)


def init_methods(config: GPTConfig):
    """``(init, output_init)``: for ordinary weights and for the residual-output projections
    (linear_proj, linear_fc2). Both draw from the full weight's shape (TP-invariant)."""
    if config.init_method == "xavier_uniform":
        return torch.nn.init.xavier_uniform_, torch.nn.init.xavier_uniform_
    return (init_method_normal(config.init_method_std),
            scaled_init_method_normal(config.init_method_std, config.num_layers))


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


class SelfAttention(torch.nn.Module):
    """Fused-QKV causal self-attention over this rank's heads (optionally GQA and RoPE)."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 number: int = 0) -> None:
        super().__init__()
        c = config
        self.config = c
        self.number = number  # the layer's index in the whole model: its context-parallel exchange
        self.kv_channels = c.head_dim
        self.groups_per_rank = c.query_groups // tp_size
        self.heads_per_group = c.num_attention_heads // c.query_groups
        sp = c.sequence_parallel
        common = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device, sequence_parallel=sp,
                      bias=c.add_bias_linear)
        init, output_init = init_methods(c)
        qkv_size = (c.num_attention_heads + 2 * c.query_groups) * c.head_dim
        self.linear_qkv = mpu.ColumnParallelLinear(c.hidden_size, qkv_size, gather_output=False, init_method=init,
                                                   **{**common, "bias": c.add_bias_linear or c.add_qkv_bias})
        self.linear_proj = mpu.RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                                 input_is_parallel=True, init_method=output_init, **common)
        if c.qk_layernorm:
            kw = dict(tp_group=tp_group, tp_size=tp_size, device=device, size=c.head_dim, partial_grads=tp_size > 1)
            self.q_layernorm, self.k_layernorm = build_norm(c, **kw), build_norm(c, **kw)
        else:
            self.q_layernorm = self.k_layernorm = None

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask,
              cp: Optional[ContextParallel] = None, key: Optional[DropoutKey] = None) -> torch.Tensor:
        p = self.config.attention_dropout if self.training else 0.0
        keyed = self._keyed_dropout(p, q, key, cp)
        if cp is not None:
            return context_parallel_attention(q, k, v, cp, layer=self.number, backend=self.config.attention_backend,
                                              attention_mask=attention_mask, dropout=keyed,
                                              dropout_p=0.0 if keyed else p)
        return core_attention(q, k, v, backend=self.config.attention_backend, dropout_p=0.0 if keyed else p,
                              attention_mask=attention_mask, dropout=keyed)

    def _keyed_dropout(self, p: float, q: torch.Tensor, key: Optional[DropoutKey],
                       cp: Optional[ContextParallel]) -> Optional[AttentionDropout]:
        """Attention dropout of this rank's heads ``q`` ``[s, b, heads/tp, d]`` keyed by position: by the
        samples' keys (``key``, --dropout-rng position: the same masks at every layout) or, under context
        parallelism without them, by keys drawn from the model-parallel stream (masks that depend on the
        layout, as the fused kernels' do). None: the backend draws its own masks (one process, and the
        all-to-all exchange, which runs it on the whole sequence), or there is no dropout."""
        if p == 0.0 or (key is None and (cp is None or cp.comm_type_of(self.number) == "a2a")):
            return None
        if key is not None:
            samples = key.samples
        else:
            with mpu.get_rng_tracker().fork(device=q.device):
                samples = torch.randint(0, 1 << 32, (q.size(1),), dtype=torch.int64, device=q.device)
        first = self.linear_qkv.tp_rank * q.size(2)  # TP ranks hold consecutive query heads
        return AttentionDropout(p, samples, torch.arange(first, first + q.size(2), device=q.device), self.number)

    def forward(self, x: torch.Tensor, rotary: Rotary = None, attention_mask: Optional[torch.Tensor] = None,
                cp: Optional[ContextParallel] = None, dropout_key: Optional[DropoutKey] = None) -> torch.Tensor:
        qkv, _ = self.linear_qkv(x)  # [s, b, (heads + 2*groups)/tp * d], full s even under SP
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_per_rank, self.heads_per_group + 2, self.kv_channels)
        # One split, as Megatron-core does: its backward writes the three gradients into one fresh
        # buffer. A slice and two selects would each allocate a zero-filled qkv-sized gradient in
        # backward, and autograd would then add the three (3 fills, 3 copies, 2 adds per layer).
        q, k, v = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, -1, self.kv_channels)  # [s, b, heads/tp, d]
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, groups/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.config.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            ctx = mpu.checkpoint(lambda q_, k_, v_: self._core(q_, k_, v_, attention_mask, cp, dropout_key), q, k, v)
        else:
            ctx = self._core(q, k, v, attention_mask, cp, dropout_key)  # [s, b, heads/tp * d]
        out, _ = self.linear_proj(ctx)  # [s(/tp), b, h]
        return out


class MLP(torch.nn.Module):
    """h -> ffn -> h with GeLU (tanh approximation, = HF 'gelu_new'), SwiGLU or squared ReLU."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 expert: bool = False, ffn_size: Optional[int] = None) -> None:
        """``expert``: one expert of a mixture (moe.py): ``moe_ffn_size`` wide (or ``ffn_size``: a shared
        expert), no sequence parallelism (the layer gathers the tokens), run through :meth:`partial`."""
        super().__init__()
        c = config
        self.activation = c.activation
        self.swiglu = c.activation == "swiglu"
        ffn = ffn_size or (c.moe_ffn_size if expert else c.ffn_size)
        common = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device,
                      sequence_parallel=c.sequence_parallel and not expert, bias=c.add_bias_linear)
        init, output_init = init_methods(c)
        if self.swiglu:
            self.linear_fc1 = GatedColumnParallelLinear(c.hidden_size, ffn, init_method=init, **common)
        else:
            self.linear_fc1 = mpu.ColumnParallelLinear(c.hidden_size, ffn, gather_output=False, init_method=init, **common)
        self.linear_fc2 = mpu.RowParallelLinear(ffn, c.hidden_size, input_is_parallel=True,
                                                init_method=output_init, **common)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.activation == "squared_relu":
            return torch.square(F.relu(h))
        return F.gelu(h, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        if fc2.bias is None:
            return out
        if fc2.tp_size == 1:
            return out + fc2.bias
        bias = mpu.copy_to_tensor_model_parallel_region(fc2.bias, fc2.tp_group)
        return out + bias * (1.0 if fc2.tp_rank == 0 else 0.0)


class TransformerLayer(torch.nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 number: int = 0, experts: Optional[ExpertParallel] = None) -> None:
        """``number``: the layer's index in the whole model (its keyed-dropout sites are 2n+1 and 2n+2);
        ``experts``: where a mixture-of-experts layer's experts live (its MLP is one when
        :func:`~megazero.model.moe.is_moe_layer`)."""
        super().__init__()
        kw = dict(tp_group=tp_group, tp_size=tp_size, device=device)
        self.number = number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        self.input_layernorm = build_norm(config, **kw)
        self.self_attention = SelfAttention(config, number=number, **kw)
        self.pre_mlp_layernorm = build_norm(config, **kw)
        if is_moe_layer(config, number):
            ep = experts or ExpertParallel()
            shared = config.moe_shared_expert_intermediate_size
            own = ep.tensor_size is not None and ep.tensor_size != tp_size  # experts sharded over a group of their own
            ekw = dict(tp_group=ep.tensor_group if ep.tensor_size > 1 else mpu.NO_GROUP, tp_size=ep.tensor_size,
                       device=device) if own else kw
            self.mlp = MoELayer(config, lambda: MLP(config, expert=True, **ekw), tp_group=tp_group, tp_size=tp_size,
                                ep_group=ep.group, ep_size=ep.size, ep_rank=ep.rank, aux_scale=ep.aux_scale,
                                init_method=init_methods(config)[0], device=device,
                                shared=(lambda: MLP(config, expert=True, ffn_size=shared, **kw)) if shared else None,
                                etp_group=ep.tensor_group if own else tp_group,
                                etp_size=ep.tensor_size if own else tp_size,
                                etp_rank=ep.tensor_rank if own else mpu.utils.group_rank(tp_group) if tp_size > 1 else 0,
                                exchange_group=ep.exchange_group)
        else:
            self.mlp = MLP(config, **kw)

    def forward(self, x: torch.Tensor, rotary: Rotary = None, attention_mask: Optional[torch.Tensor] = None,
                cp: Optional[ContextParallel] = None, dropout_key: Optional[DropoutKey] = None) -> torch.Tensor:
        def drop(t: torch.Tensor, site: int) -> torch.Tensor:
            return dropout(t, self.hidden_dropout, self.training, self.sequence_parallel, dropout_key, site)

        x = x + drop(self.self_attention(self.input_layernorm(x), rotary, attention_mask, cp, dropout_key),
                     2 * self.number + 1)
        h = self.pre_mlp_layernorm(x)
        h = self.mlp(h, cp) if isinstance(self.mlp, MoELayer) else self.mlp(h)
        return x + drop(h, 2 * self.number + 2)
