"""One pre-norm layer: a token mixer (attention, Gated DeltaNet, Mamba-2) and an MLP, from its :class:`LayerSpec`.

Activations are ``[s, b, h]`` (``[s/tp, b, h]`` between the parallel linears under sequence
parallelism). Each rank owns ``heads/tp`` attention heads and ``ffn/tp`` MLP columns; the only
communication is inside the mpu linears (and a mixture of experts' token exchange).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu

from .config import GPTConfig
from .forward_context import ForwardContext
from .keyed_dropout import DropoutKey, keyed_dropout
from .layer_spec import ExpertParallel, LayerSpec, layer_spec
from .norms import build_norm

__all__ = ["TransformerLayer", "dropout"]


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


class TransformerLayer(torch.nn.Module):
    """Pre-norm block: x + drop(mixer(norm(x))), then x + drop(mlp(norm(x))), its mixer and MLP built from
    ``spec`` (default: :func:`~megazero.model.layer_spec.layer_spec` of the config). A hybrid stack's layer has
    one of the two (and only its norm); a Mamba layer names them ``norm`` and ``mixer`` (Megatron-core's)."""

    def __init__(self, config: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
                 number: int = 0, experts: Optional[ExpertParallel] = None, spec: Optional[LayerSpec] = None) -> None:
        """``number``: the layer's index in the whole model (its keyed-dropout sites are 2n+1 and 2n+2);
        ``experts``: where a mixture-of-experts MLP's experts live."""
        super().__init__()
        kw = dict(tp_group=tp_group, tp_size=tp_size, device=device)
        spec = spec or layer_spec(config, number)
        self.number = number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        self._norm_name, self._mixer_name = spec.names
        if spec.attention is not None:
            setattr(self, self._norm_name, build_norm(config, **kw))
            setattr(self, self._mixer_name, spec.attention(config, number=number, experts=experts, **kw))
        if spec.mlp is not None:
            self.pre_mlp_layernorm = build_norm(config, **kw)
            self.mlp = spec.mlp(config, number=number, experts=experts, **kw)
        self.has_mixer, self.has_mlp = spec.attention is not None, spec.mlp is not None
        self.mlp_context_parallel = spec.mlp_context_parallel

    def forward(self, x: torch.Tensor, context: ForwardContext = ForwardContext()) -> torch.Tensor:
        """``x`` ``[s(/tp), b, h]`` -> the same shape; ``context``: what the forward's layers share."""
        def drop(t: torch.Tensor, site: int) -> torch.Tensor:
            return dropout(t, self.hidden_dropout, self.training, self.sequence_parallel, context.dropout_key, site)

        if self.has_mixer:
            norm, mixer = getattr(self, self._norm_name), getattr(self, self._mixer_name)
            x = x + drop(mixer(norm(x), context), 2 * self.number + 1)
        if not self.has_mlp:
            return x
        h = self.pre_mlp_layernorm(x)
        return x + drop(self.mlp(h, context.cp) if self.mlp_context_parallel else self.mlp(h), 2 * self.number + 2)
