"""What a layer is made of: its token mixer and its MLP, each chosen from the config (either may be absent).

A :class:`LayerSpec` holds two builders (Megatron-core's ModuleSpec, torchtitan's ``Config.build()``),
each called as ``build(config, number=, tp_group=, tp_size=, device=, experts=)`` and returning a module:

* mixer: ``forward(x, context) -> [s(/tp), b, h]`` (a :class:`~megazero.model.forward_context.ForwardContext`:
  rotary, explicit mask, CP, dropout key and document starts); standard attention
  (:class:`~megazero.model.attention.self_attention.SelfAttention`, its window and sinks from the config's
  pattern), multi-latent attention, Gated DeltaNet or Mamba-2 (``recurrent/``);
* MLP: ``forward(x) -> [s(/tp), b, h]``, the dense :class:`~megazero.model.mlp.MLP`; or, with
  ``mlp_context_parallel``, ``forward(x, cp)``: a :class:`~megazero.model.moe.layer.MoELayer`, whose
  routing counts the tokens of the whole sequence under context parallelism.

:func:`layer_spec` picks them for layer ``number`` of a config (``config.layer_kinds``); a new kind of layer
is one more builder.
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

__all__ = ["LayerSpec", "ExpertParallel", "layer_spec", "MIXER_BUILDERS", "ATTENTION_BUILDERS", "MLP_BUILDERS"]

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


def _recurrent(kind: str) -> Builder:
    """The builder of a recurrent mixer, imported when first built (a model without one never loads them)."""
    def build(config: GPTConfig, *, number: int, tp_group, tp_size: int, device=None,
              experts: Optional[ExpertParallel] = None) -> torch.nn.Module:
        if kind == "gdn":
            from .recurrent.gated_delta_net import GatedDeltaNet as cls
        elif kind == "kda":
            from .recurrent.kimi_delta_attention import KimiDeltaAttention as cls
        else:
            from .recurrent.mamba import MambaMixer as cls
        return cls(config, number=number, tp_group=tp_group, tp_size=tp_size, device=device)
    return build


# The token mixers by kind: attention ("standard"; "mla", multi-latent), Gated DeltaNet ("gdn"), Kimi Delta
# Attention ("kda"), Mamba-2 ("mamba").
MIXER_BUILDERS: dict[str, Builder] = {"standard": _standard_attention, "mla": multi_latent_attention,
                                      "gdn": _recurrent("gdn"), "kda": _recurrent("kda"),
                                      "mamba": _recurrent("mamba")}
ATTENTION_BUILDERS = MIXER_BUILDERS  # the name the attention-only layers had
MLP_BUILDERS: dict[str, Builder] = {"dense": _dense_mlp, "moe": _mixture_of_experts}
# A mixer's module name and its norm's in a layer (Megatron-core's: a Mamba layer's are ``norm`` and ``mixer``)
MIXER_NAMES = {"mamba": ("norm", "mixer")}
DEFAULT_MIXER_NAMES = ("input_layernorm", "self_attention")


@dataclass(frozen=True)
class LayerSpec:
    """The builders of one layer's mixer and MLP (either may be None: a hybrid stack's one-part layers);
    ``mlp_context_parallel``: the MLP's forward takes the context-parallel context as its second argument;
    ``names``: the attribute names of the mixer's norm and of the mixer."""

    attention: Optional[Builder]
    mlp: Optional[Builder]
    mlp_context_parallel: bool = False
    names: tuple[str, str] = DEFAULT_MIXER_NAMES


def layer_spec(config: GPTConfig, number: int) -> LayerSpec:
    """The parts of layer ``number`` (its index in the whole model) of ``config``."""
    kinds = config.layer_kinds(number)
    if kinds.mixer is not None and kinds.mixer not in MIXER_BUILDERS:
        raise ValueError(f"no mixer builder for {kinds.mixer!r} (known: {sorted(MIXER_BUILDERS)})")
    return LayerSpec(attention=MIXER_BUILDERS[kinds.mixer] if kinds.mixer else None,
                     mlp=MLP_BUILDERS[kinds.mlp] if kinds.mlp else None, mlp_context_parallel=kinds.mlp == "moe",
                     names=MIXER_NAMES.get(kinds.mixer, DEFAULT_MIXER_NAMES))
