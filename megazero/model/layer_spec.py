"""What a transformer layer is made of: its attention and its MLP, each chosen from the config.

A :class:`LayerSpec` holds two builders (Megatron-core's ModuleSpec, torchtitan's ``Config.build()``),
each called as ``build(config, number=, tp_group=, tp_size=, device=, experts=)`` and returning a module:

* attention: ``forward(x, context) -> [s(/tp), b, h]`` (a :class:`~megazero.model.forward_context.ForwardContext`:
  rotary, explicit mask, CP and dropout key); its window and sinks come from the config's pattern; standard
  attention (:class:`~megazero.model.attention.self_attention.SelfAttention`) or multi-latent attention;
* MLP: ``forward(x) -> [s(/tp), b, h]``, the dense :class:`~megazero.model.mlp.MLP`; or, with
  ``mlp_context_parallel``, ``forward(x, cp)``: a :class:`~megazero.model.moe.layer.MoELayer`, whose
  routing counts the tokens of the whole sequence under context parallelism.

:func:`layer_spec` picks them for layer ``number`` of a config; a new kind of layer is one more builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero import mpu

from .attention.mla import multi_latent_attention
from .attention.self_attention import SelfAttention
from .config import GPTConfig
from .init import init_methods
from .mlp import MLP
from .moe.layer import AuxLossScale, MoELayer

__all__ = ["LayerSpec", "ExpertParallel", "layer_spec", "ATTENTION_BUILDERS"]

Builder = Callable[..., torch.nn.Module]


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




def _standard_attention(config: GPTConfig, *, number: int, tp_group, tp_size: int, device=None,
                        experts: Optional[ExpertParallel] = None) -> torch.nn.Module:
    return SelfAttention(config, number=number, tp_group=tp_group, tp_size=tp_size, device=device)


def _dense_mlp(config: GPTConfig, *, number: int, tp_group, tp_size: int, device=None,
               experts: Optional[ExpertParallel] = None) -> torch.nn.Module:
    return MLP(config, tp_group=tp_group, tp_size=tp_size, device=device)


def _mixture_of_experts(config: GPTConfig, *, number: int, tp_group, tp_size: int, device=None,
                        experts: Optional[ExpertParallel] = None) -> torch.nn.Module:
    """A mixture of experts whose experts live where ``experts`` says (default: all on this rank)."""
    ep = experts or ExpertParallel()
    kw = dict(tp_group=tp_group, tp_size=tp_size, device=device)
    shared = config.moe_shared_expert_intermediate_size
    own = ep.tensor_size is not None and ep.tensor_size != tp_size  # experts sharded over a group of their own
    ekw = dict(tp_group=ep.tensor_group if ep.tensor_size > 1 else mpu.NO_GROUP, tp_size=ep.tensor_size,
               device=device) if own else kw
    return MoELayer(config, lambda: MLP(config, expert=True, **ekw), tp_group=tp_group, tp_size=tp_size,
                    ep_group=ep.group, ep_size=ep.size, ep_rank=ep.rank, aux_scale=ep.aux_scale,
                    init_method=init_methods(config)[0], device=device,
                    shared=(lambda: MLP(config, expert=True, ffn_size=shared, **kw)) if shared else None,
                    etp_group=ep.tensor_group if own else tp_group,
                    etp_size=ep.tensor_size if own else tp_size,
                    etp_rank=ep.tensor_rank if own else mpu.utils.group_rank(tp_group) if tp_size > 1 else 0,
                    exchange_group=ep.exchange_group)


# The attention builders by kind: "standard", and "mla" for multi_latent_attention.
ATTENTION_BUILDERS: dict[str, Builder] = {"standard": _standard_attention, "mla": multi_latent_attention}


@dataclass(frozen=True)
class LayerSpec:
    """The builders of one transformer layer's attention and MLP; ``mlp_context_parallel``: the MLP's
    forward takes the context-parallel context as its second argument."""

    attention: Builder
    mlp: Builder
    mlp_context_parallel: bool = False


def layer_spec(config: GPTConfig, number: int) -> LayerSpec:
    """The parts of layer ``number`` (its index in the whole model) of ``config``."""
    kind = config.attention_kind(number)
    if kind not in ATTENTION_BUILDERS:
        raise ValueError(f"no attention builder for {kind!r} (known: {sorted(ATTENTION_BUILDERS)})")
    moe = config.is_moe_layer(number)
    return LayerSpec(attention=ATTENTION_BUILDERS[kind], mlp=_mixture_of_experts if moe else _dense_mlp,
                     mlp_context_parallel=moe)
