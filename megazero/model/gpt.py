"""GPTModel: a decoder-only transformer made of megazero.mpu layers, for any TP size.

The model takes a tensor-parallel group and nothing else about parallelism: data
parallelism and ZeRO wrap it from outside. Internally activations are
``[s, b, h]`` (Megatron's layout); sequence parallelism splits dim 0.

Initialization contract (partitioned construction relies on it): every module that
owns parameters has ``reset_parameters()`` initializing only its own parameters from
the default generator, and a freshly built model equals
``mpu.reset_parameters_in_order(model)`` after seeding. The constructor builds on the
meta device, materializes, and runs exactly that, so a model built on ``meta`` and
materialized module by module (in ``modules()`` order) gets the same numbers. With
the mpu layers drawing full master weights, the gathered weights do not depend on tp.

Vocabulary padding: the embedding has ``padded_vocab_size`` rows (TP-independent), and
logits of the padded ids (>= ``vocab_size``) are set to -inf, so they are never predicted
and the loss equals that of an unpadded model (and of the exported HF model).

Dropout: replicated activations use the default generator; attention dropout and
sequence-parallel hidden dropout use the model-parallel stream, so training with
dropout > 0 needs ``mpu.model_parallel_manual_seed(seed)`` first.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import init_method_normal, initialize_sharded_

from .config import GPTConfig
from .norms import build_norm
from .rope import RotaryEmbedding
from .transformer import TransformerLayer, dropout

__all__ = ["GPTModel", "PositionEmbedding", "materialize_"]


class PositionEmbedding(torch.nn.Module):
    """Learned absolute positions ``[max_positions, h]``, replicated over TP, N(0, std)."""

    def __init__(self, max_positions: int, hidden_size: int, std: float, *, params_dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.std = std
        self.weight = torch.nn.Parameter(torch.empty(max_positions, hidden_size, dtype=params_dtype, device=device))

    def reset_parameters(self) -> None:
        # Drawn on the CPU like the mpu layers, so the numbers do not depend on the device.
        initialize_sharded_(self.weight, tuple(self.weight.shape), 0, 0, 1, init_method_normal(self.std))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


@torch.no_grad()
def materialize_(module: torch.nn.Module, device: torch.device | str, recurse: bool = True) -> torch.nn.Module:
    """Replace meta parameters/buffers by uninitialized ones on ``device``, keeping the
    Python attributes Megatron-style code hangs on parameters (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``, ``sequence_parallel``...).

    ``nn.Module.to_empty`` creates fresh ``Parameter`` objects when moving off ``meta``
    and silently drops those attributes; this does not. Shared parameters stay shared.
    """
    memo: dict[int, torch.Tensor] = {}
    for m in module.modules() if recurse else [module]:
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    new.__dict__.update(t.__dict__)
                    memo[id(t)] = new
                store[name] = memo[id(t)]
    return module


class GPTModel(torch.nn.Module):
    """GPT over ``config`` for the TP group ``tp_group`` (default: the registered mpu group).

    ``device='meta'`` builds an allocation-free skeleton (for planning or ZeRO-3).
    """

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        self.tp_group = mpu.mappings.resolve_tp_group(tp_group)
        self.tp_size = mpu.utils.group_size(self.tp_group)
        self.tp_rank = mpu.utils.group_rank(self.tp_group)
        config.validate(self.tp_size)
        self.config = c = config
        self.sequence_parallel = c.sequence_parallel and self.tp_size > 1
        kw = dict(tp_group=self.tp_group, tp_size=self.tp_size, device="meta")
        std = c.init_method_std

        self.embedding = mpu.VocabParallelEmbedding(c.padded_vocab_size, c.hidden_size, init_method=init_method_normal(std),
                                                    tp_group=self.tp_group, params_dtype=c.params_dtype, device="meta")
        self.position_embeddings = (PositionEmbedding(c.max_position_embeddings, c.hidden_size, std,
                                                      params_dtype=c.params_dtype, device="meta")
                                    if c.position_embedding_type == "learned" else None)
        self.rotary = RotaryEmbedding(c.kv_channels, c.rotary_base) if c.position_embedding_type == "rope" else None
        self.layers = torch.nn.ModuleList(TransformerLayer(c, **kw) for _ in range(c.num_layers))
        self.final_norm = build_norm(c, **kw)
        # Tied: the output layer owns no weight and is handed the embedding's (Megatron-core's way).
        self.output_layer = mpu.ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, bias=False, gather_output=False, init_method=init_method_normal(std),
            sequence_parallel=c.sequence_parallel, tp_group=self.tp_group, params_dtype=c.params_dtype, device="meta",
            skip_weight_param_allocation=c.tie_embeddings)

        # Padded vocabulary entries (ids >= vocab_size) are never predicted: their logits are -inf.
        per_rank = c.padded_vocab_size // self.tp_size
        self._first_padded_col = min(max(c.vocab_size - self.tp_rank * per_rank, 0), per_rank)

        if device is None or torch.device(device).type != "meta":
            materialize_(self, device if device is not None else "cpu")
            mpu.reset_parameters_in_order(self)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids`` ``[b, s]`` -> per-token fp32 loss ``[b, s]`` if ``labels`` (``-100`` = ignored),
        else this rank's vocab-parallel logits ``[b, s, padded_vocab/tp]``.

        ``position_ids``: ``[s]`` or ``[b, s]``, default ``0..s-1``. ``attention_mask``: optional
        boolean ``[b, 1, s, s]`` or ``[s, s]``, True = masked out, on top of the causal mask.
        """
        c = self.config
        b, s = input_ids.shape
        if c.position_embedding_type == "learned" and s > c.max_position_embeddings:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings ({c.max_position_embeddings})")
        if self.sequence_parallel and s % self.tp_size:
            raise ValueError(f"sequence parallelism needs the sequence length ({s}) divisible by tp ({self.tp_size})")
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)

        x = self.embedding(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            x = mpu.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        x = dropout(x, c.hidden_dropout, self.training, self.sequence_parallel)
        rotary = self.rotary(position_ids) if self.rotary is not None else None

        x = self._run_layers(x, rotary, attention_mask)
        x = self.final_norm(x)
        logits = self._logits(x)  # [s, b, padded_vocab/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = mpu.vocab_parallel_cross_entropy(logits, labels.t(), c.label_smoothing, group=self.tp_group,
                                                vocab_size=c.vocab_size)  # [s, b] fp32
        return loss.t().contiguous()

    def _run_layers(self, x: torch.Tensor, rotary, attention_mask) -> torch.Tensor:
        c = self.config

        def run(layers, h):
            for layer in layers:
                h = layer(h, rotary, attention_mask)
            return h

        if not (c.recompute_granularity == "full" and self.training and torch.is_grad_enabled()):
            return run(self.layers, x)
        k = c.recompute_num_layers
        if c.recompute_method == "uniform":  # checkpoint chunks of k consecutive layers
            for start in range(0, len(self.layers), k):
                chunk = self.layers[start:start + k]
                x = mpu.checkpoint(lambda h, chunk=chunk: run(chunk, h), x)
            return x
        for i, layer in enumerate(self.layers):  # 'block': checkpoint only the first k layers
            x = mpu.checkpoint(lambda h, layer=layer: run([layer], h), x) if i < k else layer(x, rotary, attention_mask)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> ``[s, b, padded_vocab/tp]`` (Megatron's parallel_lm_logits)."""
        logits, _ = self.output_layer(x, weight=self.embedding.weight if self.config.tie_embeddings else None)
        if self._first_padded_col < logits.size(-1):
            padded = torch.arange(logits.size(-1), device=logits.device) >= self._first_padded_col
            logits = logits.masked_fill(padded, float("-inf"))
        return logits
