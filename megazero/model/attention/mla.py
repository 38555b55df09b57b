"""Multi-latent attention (DeepSeek-V2/V3; Megatron-core's MLASelfAttention) over this rank's heads.

Queries come from ``h`` directly or through a low-rank latent (``q_lora_rank``); keys and values
from one latent of ``kv_lora_rank`` per token. Each query/key head is a no-position part
(``qk_head_dim``) and a RoPE part (``qk_pos_emb_head_dim``); the key's RoPE part is one per token,
projected straight from ``h`` and shared by all heads. Values are ``v_head_dim`` wide.

Weight layouts (full, i.e. tp=1, shapes; the converters depend on them), ``n`` heads, qk, rope, v:

* without query LoRA: ``linear_q_proj.weight`` ``[n*(qk+rope), h]``; with it: ``linear_q_down_proj.weight``
  ``[q_lora, h]``, ``q_layernorm.weight`` ``[q_lora]``, ``linear_q_up_proj.weight`` ``[n*(qk+rope), q_lora]``;
  per head its rows are q_nope (qk) then q_rope (rope).
* ``linear_kv_down_proj.weight`` ``[kv_lora + rope, h]`` (the latent's rows, then the shared RoPE key's),
  ``kv_layernorm.weight`` ``[kv_lora]``, ``linear_kv_up_proj.weight`` ``[n*(qk+v), kv_lora]`` (per head:
  k_nope then v), ``linear_proj.weight`` ``[h, n*v]``. Biases only with ``add_bias_linear``.
* The RoPE parts are stored interleaved (DeepSeek's pairs, HF ``rope_interleave=True``): they are
  de-interleaved before the rotation, as Megatron-core's MLA does.

Tensor parallelism: the up-projections (and ``linear_q_proj``) are column-parallel over heads,
``linear_proj`` row-parallel; the down-projections and their norms are replicated, drawn from their
full shapes. The shared RoPE key feeds only this rank's heads, so its gradient is summed over TP.
Under sequence parallelism the down-projections run on this rank's tokens (their weights' gradients,
partial, are summed over TP as the norms' are) and the up-projections gather the sequence.

The softmax scale is ``1/sqrt(qk+rope)``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN. With
``position_embedding_type='none'`` (Kimi Linear's NoPE attention) the RoPE parts stay as they are: no rotation.

Incremental decoding (a :class:`~megazero.model.decode_cache.DecodeCache` in the context) caches each token's
keys and values after the up-projection (``heads/tp * (qk + rope + v)`` numbers per token and layer, the RoPE key
repeated per head), not the latent: simple, and more memory than DeepSeek's absorbed form.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import initialize_sharded_

from ..config import GPTConfig
from ..forward_context import ForwardContext
from ..init import init_methods
from ..norms import build_norm
from .rope import apply_rotary, deinterleave, softmax_mscale
from .self_attention import CausalAttention, row_factors

__all__ = ["MultiLatentAttention", "ReplicatedLinear", "multi_latent_attention"]


class ReplicatedLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` with the whole weight on every TP rank, drawn from its full shape.

    ``partial_grads``: each TP rank sees only its own tokens (sequence parallelism), so the weight's
    gradient is summed over TP in backward (``copy_to_tensor_model_parallel_region``, as the norms do)
    and the parameters are marked ``sequence_parallel``."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, init_method, partial_grads: bool,
                 tp_group: Optional[dist.ProcessGroup], params_dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.input_size, self.output_size, self.init_method = input_size, output_size, init_method
        self.partial_grads, self.tp_group = partial_grads, tp_group
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
                     if bias else None)
        for p in self.parameters(recurse=False):
            p.sequence_parallel = partial_grads
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_sharded_(self.weight, (self.output_size, self.input_size), 0, 0, 1, self.init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.partial_grads:
            w = mpu.copy_to_tensor_model_parallel_region(w, self.tp_group)
            b = None if b is None else mpu.copy_to_tensor_model_parallel_region(b, self.tp_group)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"partial_grads={self.partial_grads}")


class MultiLatentAttention(CausalAttention):
    """Multi-latent causal self-attention over this rank's ``heads/tp`` heads (see the module's doc)."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 number: int = 0) -> None:
        super().__init__()
        c = config
        self.config, self.number = c, number  # number: the layer's index, its context-parallel exchange
        self.tp_group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = c.sequence_parallel and tp_size > 1
        self.heads = c.num_attention_heads // tp_size
        self.qk, self.rope, self.v = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        n, h = c.num_attention_heads, c.hidden_size
        init, output_init = init_methods(c)
        column = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device, bias=c.add_bias_linear,
                      gather_output=False, init_method=init, sequence_parallel=c.sequence_parallel)
        whole = dict(tp_group=tp_group, params_dtype=c.params_dtype, device=device, bias=c.add_bias_linear,
                     init_method=init, partial_grads=self.sequence_parallel)
        norm = dict(tp_group=tp_group, tp_size=tp_size, device=device)  # partial grads exactly under SP
        latent = c.replace(layernorm_epsilon=c.latent_norm_epsilon)  # the latent norms' own epsilon
        q_out = n * (self.qk + self.rope)
        if c.q_lora_rank is None:
            self.linear_q_proj = mpu.ColumnParallelLinear(h, q_out, **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, c.q_lora_rank, **whole)
            self.q_layernorm = build_norm(latent, size=c.q_lora_rank, **norm)
            self.linear_q_up_proj = mpu.ColumnParallelLinear(c.q_lora_rank, q_out, **column)
        self.linear_kv_down_proj = ReplicatedLinear(h, c.kv_lora_rank + self.rope, **whole)
        self.kv_layernorm = build_norm(latent, size=c.kv_lora_rank, **norm)
        self.linear_kv_up_proj = mpu.ColumnParallelLinear(c.kv_lora_rank, n * (self.qk + self.v), **column)
        self.linear_proj = mpu.RowParallelLinear(n * self.v, h, input_is_parallel=True, init_method=output_init,
                                                 tp_group=tp_group, params_dtype=c.params_dtype, device=device,
                                                 bias=c.add_bias_linear, sequence_parallel=c.sequence_parallel)
        # core attention scales by 1/sqrt(qk+rope); YaRN's extra factor goes onto q
        self.q_scale = softmax_mscale(c)
        self.init_softmax(n, tp_rank=self.linear_proj.tp_rank, tp_size=tp_size, device=device)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, heads/tp, qk+rope]`` (the whole sequence under SP)."""
        if self.config.q_lora_rank is None:
            q, _ = self.linear_q_proj(x)
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        return q.view(q.size(0), q.size(1), self.heads, self.qk + self.rope)

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k_nope ``[s, b, heads/tp, qk]``, v ``[s, b, heads/tp, v]`` and the shared RoPE key ``[s, b, 1, rope]``."""
        latent, k_pe = torch.split(self.linear_kv_down_proj(x), [self.config.kv_lora_rank, self.rope], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(latent))  # gathers the sequence under SP
        if self.sequence_parallel:
            k_pe = mpu.gather_from_sequence_parallel_region(k_pe, self.tp_group)
        elif self.tp_size > 1:  # it feeds only this rank's heads: sum its gradient over TP
            k_pe = mpu.copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        kv = kv.view(kv.size(0), kv.size(1), self.heads, self.qk + self.v)
        k_nope, v = torch.split(kv, [self.qk, self.v], dim=-1)
        return k_nope, v, k_pe.unsqueeze(2)

    def qk_clip_scales(self, eta: torch.Tensor, alpha: float) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Per head (Kimi K2's MLA rule, as Megatron's): q_nope rows by ``eta^alpha``, q_pe rows by ``eta``
        (the shared RoPE key is left alone), k_nope rows of the up-projection by ``eta^(1 - alpha)``."""
        q = self.linear_q_proj if self.config.q_lora_rank is None else self.linear_q_up_proj
        ones = torch.ones_like(eta)
        return [(q.weight, row_factors((eta.pow(alpha), self.qk), (eta, self.rope))),
                (self.linear_kv_up_proj.weight, row_factors((eta.pow(1 - alpha), self.qk), (ones, self.v)))]

    def forward(self, x: torch.Tensor, context: ForwardContext = ForwardContext()) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]``; ``context``: the forward's rotary, mask, CP and dropout key."""
        rotary = context.rotary
        if rotary is None and self.config.position_embedding_type == "rope":
            raise ValueError("multi-latent attention needs RoPE tables (position_embedding_type='rope')")
        q_nope, q_pe = torch.split(self._queries(x), [self.qk, self.rope], dim=-1)
        k_nope, v, k_pe = self._keys_values(x)
        if self.config.position_embedding_type == "rope":  # 'none' (Kimi Linear's NoPE): the parts unrotated
            q_pe, k_pe = apply_rotary(deinterleave(q_pe), *rotary), apply_rotary(deinterleave(k_pe), *rotary)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        ctx = self.attend(q, k, v, context.attention_mask, context.cp, context.dropout_key,
                          context.cache)  # [s, b, heads/tp * v]
        out, _ = self.linear_proj(ctx)  # [s(/tp), b, h]
        return out


def multi_latent_attention(config: GPTConfig, *, number: int, tp_group: Optional[dist.ProcessGroup], tp_size: int,
                           device=None, experts=None) -> MultiLatentAttention:
    """The layer builder (:mod:`megazero.model.layer_spec`'s signature; ``experts`` does not apply)."""
    return MultiLatentAttention(config, number=number, tp_group=tp_group, tp_size=tp_size, device=device)
