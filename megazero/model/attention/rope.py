"""Rotary position embeddings (Su et al. 2021) in Llama's (HF) convention.

The head dimension is split into two halves, and pair ``(x[i], x[i + d/2])`` is
rotated by angle ``pos * base^(-2i/d)`` ("rotate_half"). This is the layout of
HF Llama checkpoints, so the converters need no permutation of q/k weights.

Partial rotary (Megatron's ``--rotary-percent``): the tables cover only the first
``rotary_dim`` dimensions of a head; the remaining ones pass through unrotated.
"""

from __future__ import annotations


import torch

from ..config import GPTConfig

__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_embedding"]


class RotaryEmbedding(torch.nn.Module):
    """Computes ``(cos, sin)`` tables for given positions. Owns no parameters or buffers,
    so meta construction and partitioned materialization need nothing special."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {dim}")
        self.dim, self.base = dim, base

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` ``[s]`` or ``[b, s]`` -> ``cos, sin`` of shape ``[s, 1, 1, d]`` or ``[s, b, 1, d]`` (fp32)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=position_ids.device).float() / self.dim
        inv_freq = 1.0 / (self.base ** exponents)  # [d/2], computed as HF Llama does
        pos = position_ids.float()
        if pos.dim() == 1:
            pos = pos[:, None]  # [s, 1]
        else:
            pos = pos.t()  # [s, b]
        freqs = pos[..., None] * inv_freq  # [s, b|1, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [s, b|1, 1, d]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by the tables from ``RotaryEmbedding`` (math in fp32).

    Tables narrower than ``d`` rotate only the leading dimensions (partial rotary)."""
    rot = cos.size(-1)
    xf = x.float()
    if rot == x.size(-1):
        return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
    head, tail = xf[..., :rot], xf[..., rot:]
    return torch.cat([head * cos + _rotate_half(head) * sin, tail], dim=-1).to(x.dtype)


def rotary_embedding(config: GPTConfig) -> RotaryEmbedding:
    """The model's RoPE tables for ``config``: over ``rotary_dim`` dimensions of each head."""
    return RotaryEmbedding(config.rotary_dim, config.rotary_base)
