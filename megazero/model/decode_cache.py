"""What incremental decoding keeps between forwards: per layer, the state its next tokens need.

A :class:`DecodeCache` goes to :meth:`GPTModel.forward <megazero.model.gpt.GPTModel.forward>` (``cache=``),
which hands it to every layer in the :class:`~megazero.model.forward_context.ForwardContext`. The first
forward (the *prefill*) runs the prompt and fills it; each later one runs only the new tokens, their
positions continuing from :attr:`DecodeCache.length`. Per layer number it holds:

* an attention layer's :class:`KeyValues`: this rank's key/value heads after RoPE and the key norms (a
  sliding-window layer keeps only the keys its next queries can see);
* a recurrent layer's (Gated DeltaNet, Mamba-2) :class:`RecurrentState`: the last K-1 inputs of its short
  convolution (this rank's channels, before the convolution) and its scan's state (fp32).

So a token costs one query against the cached keys in attention and a fixed amount of work in the recurrent
layers, whatever the length so far. For inference (``torch.no_grad``): the buffers are written in place. One
cache serves one sequence of forwards of one model on one rank; a forward that fails leaves it unusable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DecodeCache", "KeyValues", "RecurrentState"]

_MIN_CAPACITY = 16  # tokens a key/value buffer holds at first (it doubles when full)


@dataclass
class KeyValues:
    """One attention layer's cached keys and values, ``[n, b, groups, d]`` each, for the positions
    ``first .. first + n - 1``. ``window``: the layer's sliding window (a query at i sees keys i - window .. i;
    None: all), so older keys are dropped. The tokens live in ``buffer[start:start + n]`` of a buffer that
    doubles when full and is compacted when the window has dropped its head, so an append costs O(new tokens)
    amortised."""

    window: Optional[int] = None
    first: int = 0
    start: int = 0
    count: int = 0
    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None

    def extend(self, k: torch.Tensor, v: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append the new tokens' ``k`` ``[n, b, groups, dqk]`` and ``v`` ``[n, b, groups, dv]`` at positions
        ``position ..``; returns (keys, values, the position of the first key): what queries at ``position ..``
        attend over (views of the cache, valid until the next append)."""
        if self.keys is not None and self.first + self.count != position:
            raise ValueError(f"the cache holds keys up to position {self.first + self.count}, the new tokens start at "
                             f"{position}: run every token of the sequence through the model with this cache, in order")
        if self.keys is None:
            self.first = position
        if self.window is not None:  # keys before position - window are seen by no query from here on
            drop = min(self.count, max(0, position - self.window - self.first))
            self.first, self.start, self.count = self.first + drop, self.start + drop, self.count - drop
        n = k.size(0)
        self._make_room(k, v, n)
        end = self.start + self.count
        self.keys[end:end + n] = k
        self.values[end:end + n] = v
        self.count += n
        span = slice(self.start, self.start + self.count)
        return self.keys[span], self.values[span], self.first

    def _make_room(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        """Buffers with room for ``n`` more tokens after the held ones: new ones twice the need when full,
        the held tokens moved to the front."""
        if self.keys is not None and self.start + self.count + n <= self.keys.size(0):
            return
        need = self.count + n
        capacity = self.keys.size(0) if self.keys is not None else 0
        if need > capacity // 2:
            capacity = max(2 * need, _MIN_CAPACITY)
        keys, values = (t.new_empty((capacity, *t.shape[1:])) for t in (k, v))
        if self.count:
            keys[:self.count] = self.keys[self.start:self.start + self.count]
            values[:self.count] = self.values[self.start:self.start + self.count]
        self.keys, self.values, self.start = keys, values, 0


@dataclass
class RecurrentState:
    """One recurrent layer's cache: ``conv`` ``[b, K-1, C]`` the last K-1 inputs of its short convolution (this
    rank's channels, before the convolution; None before the first token) and ``state`` its scan's state in
    fp32 (None: zeros, before the first token)."""

    conv: Optional[torch.Tensor] = None
    state: Optional[torch.Tensor] = None

    def convolution_halo(self, x: torch.Tensor, width: int) -> Optional[torch.Tensor]:
        """The ``width`` inputs before ``x`` ``[b, n, C]`` (None at the sequence's start: zeros), and keep the
        last ``width`` inputs up to the end of ``x`` for the next tokens."""
        before = self.conv
        if width == 0:
            return before
        held = x.new_zeros(x.size(0), width, x.size(2)) if before is None else before.to(x.dtype)
        self.conv = torch.cat([held, x], dim=1)[:, -width:].clone()
        return before


class DecodeCache:
    """The per-layer caches of one sequence of decoding forwards (see the module's doc). ``length``: the
    tokens the model has seen, which is also the position of the next token."""

    def __init__(self) -> None:
        self.length = 0
        self._layers: dict[int, KeyValues | RecurrentState] = {}

    def keys_values(self, number: int, window: Optional[int] = None) -> KeyValues:
        """Attention layer ``number``'s keys and values (created empty with its ``window`` on first use)."""
        return self._entry(number, KeyValues, window=window)

    def recurrent(self, number: int) -> RecurrentState:
        """Recurrent layer ``number``'s convolution inputs and state (created empty on first use)."""
        return self._entry(number, RecurrentState)

    def _entry(self, number: int, kind: type, **init):
        entry = self._layers.get(number)
        if entry is None:
            entry = self._layers[number] = kind(**init)
        elif not isinstance(entry, kind):
            raise TypeError(f"layer {number}'s cache holds {type(entry).__name__}, not {kind.__name__}: one cache "
                            "serves one model")
        return entry

    def advance(self, n: int) -> None:
        """Count ``n`` more tokens seen (the model does after each forward)."""
        self.length += n

    def layers(self) -> dict[int, KeyValues | RecurrentState]:
        """Every layer's entry by layer number (read-only use: sizes, tests)."""
        return dict(self._layers)
