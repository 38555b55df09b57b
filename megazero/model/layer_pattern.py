"""What each layer of a model is: its token mixer and its MLP, from the config's per-layer pattern.

A layer is a pre-norm block with a *mixer* (attention, multi-latent attention, Gated DeltaNet, Kimi Delta Attention
or Mamba-2), an *MLP* (dense or a mixture of experts), or both. Two descriptions, both Megatron-LM's:

* a GPT (no hybrid pattern): every layer has both; its mixer is ``experimental_attention_variant``'s (Gated
  DeltaNet, or KDA for 'kda') where ``linear_attention_freq`` says (an int N: every layer but each N-th, 1-based,
  as Qwen3-Next's and Kimi Linear's 3:1; or one 1 (linear) / 0 (attention) per layer), else attention; its MLP a
  mixture where ``moe_layer_freq`` says;
* a hybrid stack (``hybrid_layer_pattern``, Nemotron-H's): one symbol per layer, each a block with its own
  norm and residual: ``M`` Mamba-2, ``G`` Gated DeltaNet, ``*`` attention (multi-latent under
  ``multi_latent_attention``), ``-`` a dense MLP, ``E`` a mixture of experts; ``|`` cuts the stack into
  pipeline stages (and their virtual chunks), one segment each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = ["LayerKinds", "HYBRID_SYMBOLS", "hybrid_symbols", "hybrid_segments", "linear_attention_layer",
           "check_layer_pattern", "RECURRENT_MIXERS"]

# pattern symbol -> (mixer, mlp); "attention" is resolved to the attention builder's kind by the config
HYBRID_SYMBOLS: dict[str, tuple[Optional[str], Optional[str]]] = {
    "M": ("mamba", None), "G": ("gdn", None), "*": ("attention", None), "-": (None, "dense"), "E": (None, "moe")}
PIPE = "|"
# Megatron symbols megazero does not build, and what to do instead
_REFUSED = {"/": "multi-token prediction depths are --mtp-num-layers N (each an attention layer with the model's MLP)",
            "D": "DeepSeek sparse attention (DSA) layers do not exist in megazero; use '*'",
            "+": "write '*' with --multi-latent-attention for multi-latent attention layers"}
RECURRENT_MIXERS = ("gdn", "kda", "mamba")  # mixers that carry a state along the sequence


@dataclass(frozen=True)
class LayerKinds:
    """One layer's parts: ``mixer`` ('standard', 'mla', 'gdn', 'kda', 'mamba' or None) and ``mlp`` ('dense', 'moe' or
    None)."""

    mixer: Optional[str]
    mlp: Optional[str]

    @property
    def recurrent(self) -> bool:
        """The mixer carries a state along the sequence (Gated DeltaNet, KDA, Mamba-2)."""
        return self.mixer in RECURRENT_MIXERS


def hybrid_symbols(pattern: str) -> str:
    """The layer symbols of ``pattern`` (pipeline cuts removed), one per layer."""
    return pattern.replace(PIPE, "")


def hybrid_segments(pattern: str) -> list[int]:
    """Layers per ``|``-separated segment of ``pattern`` (one segment when it has no cut)."""
    return [len(s) for s in pattern.split(PIPE)]


def linear_attention_layer(freq: Union[None, int, Sequence[int]], number: int) -> bool:
    """Layer ``number`` (0-based) is linear attention (Gated DeltaNet or KDA) under Megatron's
    ``linear_attention_freq``: an int N, every layer but each N-th (1-based: layers N-1, 2N-1, ... are attention); a
    pattern, its 1s."""
    if freq is None:
        return False
    if isinstance(freq, int):
        return (number + 1) % freq != 0
    return bool(freq[number])


def check_layer_pattern(pattern: Optional[str], num_layers: int, variant: Optional[str],
                        freq: Union[None, int, Sequence[int]]) -> None:
    """Raise ValueError naming the values and the fix when the per-layer description cannot build."""
    if variant not in (None, "gated_delta_net", "kda"):
        raise ValueError(f"experimental_attention_variant={variant!r} does not exist in megazero; use "
                         "'gated_delta_net' (Qwen3-Next's linear attention), 'kda' (Kimi Linear's) or none")
    if variant is None and freq is not None:
        raise ValueError("linear_attention_freq chooses Gated DeltaNet layers: set experimental_attention_variant="
                         "'gated_delta_net' (--experimental-attention-variant gated_delta_net), or 'kda' for Kimi "
                         "Delta Attention layers, or drop it")
    if variant is not None and freq is None and pattern is None:
        raise ValueError(f"experimental_attention_variant={variant!r} needs linear_attention_freq "
                         "(--linear-attention-freq N: every N-th layer is attention; or a 1/0 pattern per layer)")
    if variant == "kda" and pattern is not None:
        raise ValueError("experimental_attention_variant='kda' places KDA layers by linear_attention_freq; a hybrid "
                         "layer pattern has no KDA symbol ('G' is Gated DeltaNet): drop one of them")
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"linear_attention_freq must be >= 1, got {freq}")
    if isinstance(freq, (tuple, list)):
        if len(freq) != num_layers or set(freq) - {0, 1}:
            kind = "KDA" if variant == "kda" else "Gated DeltaNet"
            raise ValueError(f"linear_attention_freq {tuple(freq)} must give one 0 (attention) or 1 ({kind}) "
                             f"per layer: {num_layers} values")
    if pattern is None:
        return
    if freq is not None:
        raise ValueError("hybrid_layer_pattern names every layer's kind ('G' for Gated DeltaNet): drop "
                         "linear_attention_freq")
    for symbol in set(pattern):
        if symbol in _REFUSED:
            raise ValueError(f"hybrid layer pattern {pattern!r}: {symbol!r} is not built here: {_REFUSED[symbol]}")
        if symbol != PIPE and symbol not in HYBRID_SYMBOLS:
            raise ValueError(f"hybrid layer pattern {pattern!r}: {symbol!r} is not a layer symbol; use M (Mamba-2), "
                             "G (Gated DeltaNet), * (attention), - (MLP), E (mixture of experts) and | (pipeline cut)")
    symbols = hybrid_symbols(pattern)
    if len(symbols) != num_layers:
        raise ValueError(f"hybrid layer pattern {pattern!r} has {len(symbols)} layers but num_layers is {num_layers}; "
                         f"set --num-layers {len(symbols)} or leave it out (the pattern gives it)")
    if 0 in hybrid_segments(pattern):
        raise ValueError(f"hybrid layer pattern {pattern!r} has an empty pipeline segment (two '|' in a row, or one "
                         "at an end): every stage needs at least one layer")
