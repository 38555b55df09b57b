"""Standard (multi-head or grouped-query) causal self-attention with one fused QKV projection, and
:class:`CausalAttention`, the core-attention path it shares with multi-latent attention.

Weight layouts (full, i.e. tp=1, shapes; the converters depend on them):

* ``linear_qkv.weight`` ``[(heads + 2*groups) * d, h]``: one block per query group ``g`` (``groups``
  blocks, in order), each ``[q heads of g (heads/groups * d rows); k_g (d rows); v_g (d rows)]``
  (Megatron's layout). Contiguous TP chunks therefore give every rank whole groups: its own heads'
  q, k and v. The bias follows the same rows.
* ``q_layernorm`` / ``k_layernorm`` (``qk_layernorm``): ``[d]``, replicated; each TP rank normalizes
  only its own heads, so their gradients are summed over TP.

The head dimension ``d`` is ``config.head_dim`` (``kv_channels``), which need not be ``hidden / heads``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megazero import mpu

from ..config import GPTConfig
from ..decode_cache import DecodeCache
from ..forward_context import ForwardContext
from ..init import init_methods
from ..keyed_dropout import AttentionDropout, DropoutKey
from ..norms import build_norm
from .core import core_attention
from .cp.context import ContextParallel, context_parallel_attention
from .max_logit import max_attention_logit
from .rope import apply_rotary
from .sinks import LearnableSinks
from .tiled import block_attention

__all__ = ["CausalAttention", "SelfAttention", "row_factors"]



class CausalAttention(torch.nn.Module):
    """What every attention of a layer shares once its q, k and v are made: the core attention of this
    rank's heads (a backend, or the context-parallel exchange of layer ``number``), its dropout (keyed
    by position when the samples' keys are given, else the kernels' own) and selective recompute. A subclass sets ``config``,
    ``number`` and a row-parallel ``linear_proj`` (whose TP rank says which heads this rank holds)."""

    config: GPTConfig
    number: int
    # [heads/tp]: the largest logit of each of this rank's heads since it was last taken (track_max_attention_logit)
    max_logit: Optional[torch.Tensor] = None
    window: Optional[int] = None  # a query sees this many keys before it (None: all); the layer's pattern

    def init_softmax(self, heads: int, *, tp_rank: int, tp_size: int, device=None) -> None:
        """The layer's window (``config.layer_window``) and, with ``softmax_type`` 'learnable', its sink
        logits (``core_attention.softmax_offset``, ``heads / tp_size`` of them); call at the end of ``__init__``."""
        c = self.config
        self.window = c.layer_window(self.number)
        if c.softmax_type == "learnable":
            self.core_attention = LearnableSinks(heads, tp_rank=tp_rank, tp_size=tp_size,
                                                 init_method=init_methods(c)[0], params_dtype=c.params_dtype,
                                                 device=device)

    def sinks(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's heads' sink logits ``[heads/tp]`` for queries ``q`` (None: a plain softmax)."""
        if self.config.softmax_type == "learnable":
            return self.core_attention.softmax_offset
        if self.config.softmax_type == "off-by-one":
            return q.new_zeros(q.size(2))
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask,
               cp: Optional[ContextParallel] = None, key: Optional[DropoutKey] = None,
               cache: Optional[DecodeCache] = None) -> torch.Tensor:
        """q ``[s, b, heads/tp, dqk]``, k ``[s, b, groups/tp, dqk]``, v ``[s, b, groups/tp, dv]`` ->
        ``[s, b, heads/tp * dv]``, recomputed in backward under selective recompute. With a decoding ``cache``
        the new tokens' k and v join the layer's cached ones and the queries attend over both."""
        if cache is not None:
            return self._attend_cached(q, k, v, cache)
        if self.config.track_max_attention_logit and self.training:
            if cp is not None:
                raise ValueError("the largest attention logit (QK-clip) needs each query's whole sequence of keys; "
                                 "with context parallelism a rank holds a part of it: use context parallel size 1")
            m = max_attention_logit(q, k, attention_mask, self.window)
            self.max_logit = m if self.max_logit is None else torch.maximum(self.max_logit, m)
        if self.config.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            return mpu.checkpoint(lambda q_, k_, v_: self._core(q_, k_, v_, attention_mask, cp, key), q, k, v)
        return self._core(q, k, v, attention_mask, cp, key)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask,
              cp: Optional[ContextParallel] = None, key: Optional[DropoutKey] = None) -> torch.Tensor:
        p = self.config.attention_dropout if self.training else 0.0
        keyed = self._keyed_dropout(p, q, key)
        mask = dict(window=self.window, sinks=self.sinks(q))
        if cp is not None:
            return context_parallel_attention(q, k, v, cp, layer=self.number, backend=self.config.attention_backend,
                                              attention_mask=attention_mask, dropout=keyed,
                                              dropout_p=0.0 if keyed else p, **mask)
        return core_attention(q, k, v, backend=self.config.attention_backend, dropout_p=0.0 if keyed else p,
                              attention_mask=attention_mask, dropout=keyed, **mask)

    def _attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """Queries at positions ``cache.length ..`` against the layer's cached keys and the new ones, under the
        causal mask and the window offset by the cached length (and the sinks): the core attention of the new
        block when nothing is cached, else the block kernels over (cached, new) keys."""
        if self.training and self.config.attention_dropout > 0.0:
            raise ValueError("a decoding cache runs in eval mode (model.eval()): attention dropout is on in training")
        position, n = cache.length, q.size(0)
        keys, values, first = cache.keys_values(self.number, self.window).extend(k, v, position)
        sinks = self.sinks(q)
        if first == position:  # the prefill: plain causal attention of the new tokens
            return core_attention(q, k, v, backend=self.config.attention_backend, window=self.window, sinks=sinks)
        q_runs, k_runs = ((0, position, n),), ((0, first, position - first), (0, position, n))
        return block_attention(q, keys, values, q_runs, k_runs, window=self.window, sinks=sinks)

    def _keyed_dropout(self, p: float, q: torch.Tensor, key: Optional[DropoutKey]) -> Optional[AttentionDropout]:
        """Attention dropout of this rank's heads ``q`` ``[s, b, heads/tp, d]`` keyed by position by the
        samples' keys (``key``, --dropout-rng position: the same masks at every layout). None: the kernels
        draw their own masks from the model-parallel stream (Megatron's: under context parallelism they
        depend on the layout), or there is no dropout."""
        if p == 0.0 or key is None:
            return None
        first = self.linear_proj.tp_rank * q.size(2)  # TP ranks hold consecutive query heads
        return AttentionDropout(p, key.samples, torch.arange(first, first + q.size(2), device=q.device), self.number)

    def qk_clip_scales(self, eta: torch.Tensor, alpha: float) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """QK-clip (Kimi K2's MuonClip): for ``eta`` ``[heads/tp]`` (<= 1, the threshold over each head's
        largest logit), the factor of every row of the weights that make queries and keys, such that the
        head's logits shrink by ``eta``: ``(weight, factors of its rows)`` for this rank's TP shards."""
        raise NotImplementedError


def row_factors(*blocks: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Per-row factors from blocks ``(factor per unit [u], rows per unit)``, interleaved unit by unit."""
    return torch.cat([f.view(-1, 1).expand(-1, n) for f, n in blocks], dim=1).reshape(-1)


class SelfAttention(CausalAttention):
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
        # With an output gate (Qwen3-Next's), each query head has a gate head projected beside it.
        self.gated = c.attention_output_gate
        per_group = self.heads_per_group * (2 if self.gated else 1)
        qkv_size = (per_group + 2) * c.query_groups * c.head_dim
        self.linear_qkv = mpu.ColumnParallelLinear(c.hidden_size, qkv_size, gather_output=False, init_method=init,
                                                   **{**common, "bias": c.add_bias_linear or c.add_qkv_bias})
        # The weight's rows repeat per query group as (its queries[, their gates], a key, a value): matrices
        # fused into one, as an optimizer that works per matrix (Muon's QKV split) must know.
        queries = (self.heads_per_group * c.head_dim,) * (2 if self.gated else 1)
        self.linear_qkv.weight.fused_matrices = (*queries, c.head_dim, c.head_dim)
        self.linear_proj = mpu.RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                                 input_is_parallel=True, init_method=output_init, **common)
        if c.qk_layernorm:
            kw = dict(tp_group=tp_group, tp_size=tp_size, device=device, size=c.head_dim, partial_grads=tp_size > 1)
            self.q_layernorm, self.k_layernorm = build_norm(c, **kw), build_norm(c, **kw)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.init_softmax(c.num_attention_heads, tp_rank=self.linear_proj.tp_rank, tp_size=tp_size, device=device)

    def qk_clip_scales(self, eta: torch.Tensor, alpha: float) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """A query group's keys serve all its heads: the group takes its smallest ``eta`` (Megatron's GQA
        rule); its queries' rows scale by ``eta^alpha``, its key's by ``eta^(1 - alpha)``, V's stay."""
        g = eta.view(self.groups_per_rank, self.heads_per_group).amin(dim=1)
        d, one = self.kv_channels, torch.ones_like(g)
        gates = ((one, self.heads_per_group * d),) if self.gated else ()
        return [(self.linear_qkv.weight, row_factors((g.pow(alpha), self.heads_per_group * d), *gates,
                                                     (g.pow(1 - alpha), d), (one, d)))]

    def forward(self, x: torch.Tensor, context: ForwardContext = ForwardContext()) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]``; ``context``: the forward's rotary, mask, CP and dropout key."""
        qkv, _ = self.linear_qkv(x)  # [s, b, (heads + 2*groups)/tp * d], full s even under SP
        s, b = qkv.shape[:2]
        hpg = self.heads_per_group
        qkv = qkv.view(s, b, self.groups_per_rank, hpg * (2 if self.gated else 1) + 2, self.kv_channels)
        # One split, as Megatron-core does: its backward writes the three gradients into one fresh
        # buffer. A slice and two selects would each allocate a zero-filled qkv-sized gradient in
        # backward, and autograd would then add the three (3 fills, 3 copies, 2 adds per layer).
        if self.gated:
            q, gate, k, v = torch.split(qkv, [hpg, hpg, 1, 1], dim=3)
        else:
            (q, k, v), gate = torch.split(qkv, [hpg, 1, 1], dim=3), None
        q = q.reshape(s, b, -1, self.kv_channels)  # [s, b, heads/tp, d]
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, groups/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if context.rotary is not None:
            q, k = apply_rotary(q, *context.rotary), apply_rotary(k, *context.rotary)
        ctx = self.attend(q, k, v, context.attention_mask, context.cp, context.dropout_key,
                          context.cache)  # [s, b, heads/tp * d]
        if gate is not None:
            ctx = ctx * torch.sigmoid(gate.reshape(ctx.shape))
        out, _ = self.linear_proj(ctx)  # [s(/tp), b, h]
        return out
