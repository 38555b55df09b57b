"""Rotary position embeddings (Su et al. 2021) in Llama's (HF) convention, and YaRN's scaled tables.

The head dimension is split into two halves, and pair ``(x[i], x[i + d/2])`` is
rotated by angle ``pos * inv_freq[i]`` with ``inv_freq[i] = base^(-2i/d)`` ("rotate_half").
This is the layout of HF Llama checkpoints, so the converters need no permutation of q/k weights.
Multi-latent attention stores its RoPE parts interleaved (DeepSeek's pairs ``(x[2i], x[2i+1])``):
:func:`deinterleave` brings them to this layout before :func:`apply_rotary`.

Partial rotary (Megatron's ``--rotary-percent``): the tables cover only the first
``rotary_dim`` dimensions of a head; the remaining ones pass through unrotated.

YaRN (Peng et al. 2023; ``rope_type='yarn'``): the frequencies are blended between interpolation
(``inv_freq / factor``) and extrapolation (``inv_freq``) by a linear ramp between the dimensions that
make ``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings`` (rounded
outwards), and the tables are multiplied by an attention factor. Both follow transformers'
``_compute_yarn_parameters`` (the DeepSeek-V3 parity target); see :func:`yarn_attention_factor` for
where Megatron-core's factor differs.

Llama 3 (``rope_type='llama3'``, Llama-3.1/3.2/3.3 and Megatron's ``--use-rope-scaling``): frequencies whose
wavelength exceeds ``original / low_freq_factor`` are divided by ``factor``, those shorter than
``original / high_freq_factor`` kept, and the ones between blended smoothly; the tables are not rescaled.
The operations are transformers' ``_compute_llama3_parameters`` (= Megatron-core's ``_apply_scaling``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import GPTConfig

__all__ = ["RotaryEmbedding", "YarnScaling", "Llama3Scaling", "apply_rotary", "deinterleave", "rotary_embedding",
           "yarn_get_mscale", "yarn_attention_factor", "softmax_mscale"]


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's parameters (GPTConfig's names: rotary_scaling_factor is ``factor``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # the correction range rounded to whole dimensions (HF's truncate)

    @classmethod
    def of(cls, config: GPTConfig) -> Optional["YarnScaling"]:
        """The config's YaRN, or None when its RoPE is plain."""
        if config.resolved_rope_type != "yarn":
            return None
        return cls(config.rotary_scaling_factor, config.original_max_position_embeddings, config.beta_fast,
                   config.beta_slow, config.mscale, config.mscale_all_dim, config.yarn_correction_range_round_to_int)


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's frequency scaling (GPTConfig's names: rotary_scaling_factor is ``factor``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def of(cls, config: GPTConfig) -> Optional["Llama3Scaling"]:
        """The config's Llama 3 scaling, or None when its RoPE is not 'llama3'."""
        if config.resolved_rope_type != "llama3":
            return None
        return cls(config.rotary_scaling_factor, config.low_freq_factor, config.high_freq_factor,
                   config.original_max_position_embeddings)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    """Llama 3's rescaled inverse frequencies (transformers' operations, in its order)."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor
                                                                                   - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


def yarn_attention_factor(y: YarnScaling) -> float:
    """The tables' factor: ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both are non-zero,
    else ``mscale(f, 1)`` (transformers' rule). Megatron-core takes the ratio whenever both are given,
    so the two differ only when one of them is 0 and ``mscale != 1`` (DeepSeek's configs set both)."""
    if y.mscale and y.mscale_all_dim:
        return float(yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim))
    return yarn_get_mscale(y.factor)


def softmax_mscale(config: GPTConfig) -> float:
    """What YaRN multiplies the softmax scale by in multi-latent attention: ``mscale(f, mscale_all_dim)^2``
    (DeepSeek's, transformers' ``yarn_apply_mscale`` and Megatron-core's); 1 with plain RoPE."""
    y = YarnScaling.of(config)
    if y is None or not y.mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(y.factor, y.mscale_all_dim)
    return m * m


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The dimension whose frequency makes ``rotations`` turns over ``max_positions``."""
    return (dim * math.log(max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(dim: int, base: float, y: YarnScaling, device=None) -> torch.Tensor:
    """YaRN's blended inverse frequencies ``[dim/2]`` (transformers' operations, in its order)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (y.factor * pos_freqs)
    low = _yarn_correction_dim(y.beta_fast, dim, base, y.original_max_position_embeddings)
    high = _yarn_correction_dim(y.beta_slow, dim, base, y.original_max_position_embeddings)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    keep = 1 - ramp  # 1: the dimension keeps its frequency (extrapolation)
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(torch.nn.Module):
    """Computes ``(cos, sin)`` tables for given positions, plain, YaRN-scaled (``yarn``) or Llama-3-scaled
    (``llama3``). Owns no parameters or buffers, so meta construction and partitioned materialization need
    nothing special."""

    def __init__(self, dim: int, base: float = 10000.0, yarn: Optional[YarnScaling] = None,
                 llama3: Optional[Llama3Scaling] = None) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {dim}")
        if yarn is not None and llama3 is not None:
            raise ValueError("RoPE takes YaRN or Llama 3 scaling, not both")
        self.dim, self.base, self.yarn, self.llama3 = dim, base, yarn, llama3
        self.attention_factor = yarn_attention_factor(yarn) if yarn is not None else 1.0

    def inv_freq(self, device=None) -> torch.Tensor:
        """The inverse frequencies ``[d/2]`` (fp32)."""
        if self.yarn is not None:
            return _yarn_inv_freq(self.dim, self.base, self.yarn, device)
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        inv_freq = 1.0 / (self.base ** exponents)  # computed as HF Llama does
        return inv_freq if self.llama3 is None else _llama3_inv_freq(inv_freq, self.llama3)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` ``[s]`` or ``[b, s]`` -> ``cos, sin`` of shape ``[s, 1, 1, d]`` or ``[s, b, 1, d]`` (fp32)."""
        inv_freq = self.inv_freq(position_ids.device)
        pos = position_ids.float()
        if pos.dim() == 1:
            pos = pos[:, None]  # [s, 1]
        else:
            pos = pos.t()  # [s, b]
        freqs = pos[..., None] * inv_freq  # [s, b|1, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [s, b|1, 1, d]
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, base={self.base}" + (f", yarn={self.yarn}" if self.yarn is not None else "")
                + (f", llama3={self.llama3}" if self.llama3 is not None else ""))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ...; x1, x3, ...]`` (rotate_half's layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


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
    """The model's RoPE tables for ``config``: over ``rotary_dim`` dimensions of each head, or over the
    decoupled RoPE part (``qk_pos_emb_head_dim``) under multi-latent attention; YaRN-scaled when
    ``config.resolved_rope_type`` is 'yarn', Llama-3-scaled when it is 'llama3'."""
    dim = config.qk_pos_emb_head_dim if config.multi_latent_attention else config.rotary_dim
    return RotaryEmbedding(dim, config.rotary_base, YarnScaling.of(config), Llama3Scaling.of(config))
