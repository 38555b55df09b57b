"""Which keys each layer's attention sees: the per-layer sliding-window pattern, as Megatron-core
writes it (``window_size``, ``window_attn_skip_freq``), and the softmax's sinks.

``window_size = (left, right)`` is Transformer Engine's convention: a query at position i sees the keys
i - left .. i + right; a GPT is causal, so right is 0. Hugging Face's ``sliding_window = W`` (a query
sees W keys, itself included) is ``(W - 1, 0)``. ``window_attn_skip_freq``: None, every layer slides;
an int N, layer n (1-based) attends over its whole context when n % N == 0 and slides otherwise
(gpt-oss: 2, global every second layer); a pattern, one 1 (slides) or 0 (global) per layer.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

__all__ = ["SOFTMAX_TYPES", "layer_window", "check_pattern"]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
SkipFreq = Union[None, int, tuple[int, ...]]


def layer_window(window_size: Optional[Sequence[int]], skip_freq: SkipFreq, number: int) -> Optional[int]:
    """How many keys before it a query of layer ``number`` (0-based, in the whole model) sees; None: all."""
    if window_size is None:
        return None
    if skip_freq is None:
        slides = True
    elif isinstance(skip_freq, int):
        slides = (number + 1) % skip_freq != 0
    else:
        slides = bool(skip_freq[number])
    return int(window_size[0]) if slides else None


def check_pattern(window_size: Optional[Sequence[int]], skip_freq: SkipFreq, num_layers: int,
                  softmax_type: str, attention_backend: str = "auto") -> None:
    """Raise ValueError naming the value and the fix when the pattern cannot describe ``num_layers`` layers
    or the attention backend cannot compute it."""
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type {softmax_type!r} is not one of {SOFTMAX_TYPES}")
    if softmax_type != "vanilla" and attention_backend == "flash":
        raise ValueError(f"softmax_type={softmax_type!r} (attention sinks) with attention_backend='flash': flash-attn's "
                         "kernels take no sinks; use attention_backend 'auto' or 'sdpa' (--attention-backend fused), "
                         "which compute them with torch's fused blocks")
    if window_size is None:
        if skip_freq is not None:
            raise ValueError(f"window_attn_skip_freq={skip_freq!r} without window_size: say how far the sliding "
                             "layers see with --window-size LEFT,0, or drop --window-attn-skip-freq")
        return
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right), got {tuple(window_size)}")
    left, right = (int(x) for x in window_size)
    if right != 0:
        raise ValueError(f"window_size ({left}, {right}) lets a query see {right} keys after it; a GPT is causal: "
                         f"use --window-size {left},0")
    if left < 0:
        raise ValueError(f"window_size ({left}, {right}): the left reach must be >= 0 (a query sees itself and the "
                         "left keys before it); -1 (unbounded) is no window: drop --window-size")
    if isinstance(skip_freq, int) and not isinstance(skip_freq, bool):
        if skip_freq < 1:
            raise ValueError(f"window_attn_skip_freq must be >= 1 (every N-th layer global), got {skip_freq}")
    elif skip_freq is not None:
        if len(skip_freq) != num_layers or any(x not in (0, 1) for x in skip_freq):
            raise ValueError(f"window_attn_skip_freq is a pattern of {len(skip_freq)} values {list(skip_freq)[:8]}"
                             f"{'...' if len(skip_freq) > 8 else ''}; it needs one 1 (sliding) or 0 (global) per "
                             f"layer, {num_layers} of them (e.g. \"([1]*3+[0])*{max(1, num_layers // 4)}\")")

