"""What every Hugging Face import does alike: the vocabulary padded to megazero's rows, and the refusal of a
checkpoint's weights the config does not use."""

from __future__ import annotations

from typing import Iterable

import torch

from ..config import GPTConfig

__all__ = ["pad_vocabulary", "refuse_unused"]


def pad_vocabulary(t: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    """An HF embedding or head ``[vocab_size, ...]`` padded with zero rows to ``c.padded_vocab_size``."""
    if t.shape[0] != c.vocab_size:
        raise ValueError(f"HF embedding has {t.shape[0]} rows but the config's vocab_size is {c.vocab_size}")
    return torch.cat([t, t.new_zeros(c.padded_vocab_size - c.vocab_size, *t.shape[1:])])


def refuse_unused(unexpected: Iterable[str], what: str) -> None:
    """Raise KeyError naming (the first 8 of) the checkpoint's weights a ``what`` config does not use."""
    unexpected = sorted(unexpected)
    if unexpected:
        raise KeyError(f"HF checkpoint has weights this {what} config does not use: {unexpected[:8]}"
                       + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
