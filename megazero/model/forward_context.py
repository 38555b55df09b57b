"""What every layer of one forward shares beside its activations, carried as one object.

The model builds one :class:`ForwardContext` per forward and hands it to each layer; a layer passes it to
its mixer, and only the parts that need context parallelism (the attention's exchange, a recurrent layer's
state passing, a mixture's routing over the whole sequence) read its ``cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .keyed_dropout import DropoutKey

if TYPE_CHECKING:  # carried, never read here
    from .attention.cp.context import ContextParallel
    from .decode_cache import DecodeCache

__all__ = ["ForwardContext", "Rotary"]

Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ForwardContext:
    """``rotary``: RoPE's (cos, sin) of this rank's positions (None: no RoPE); ``attention_mask``: an explicit
    mask (packed documents), True = masked, on top of each layer's causal or windowed mask; ``cp``: the
    context-parallel context (None: this rank holds whole sequences); ``dropout_key``: the samples' keys
    of dropout keyed by position (None: the kernels' own masks, or no dropout); ``starts``: ``[b, s_local]`` bool,
    True where this rank's token begins a packed document, for the layers that carry a state along the
    sequence (None: one document per sample, or a model without such layers); ``cache``: incremental decoding's
    per-layer state (:class:`~megazero.model.decode_cache.DecodeCache`), which each mixer reads and extends, the
    new tokens' positions continuing from its length (None: the forward sees whole sequences)."""

    rotary: Rotary = None
    attention_mask: Optional[torch.Tensor] = None
    cp: Optional["ContextParallel"] = None
    dropout_key: Optional[DropoutKey] = None
    starts: Optional[torch.Tensor] = None
    cache: Optional["DecodeCache"] = None
