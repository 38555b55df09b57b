"""GPTConfig: the typed description of a GPT, plus named presets.

One config describes the model for every tensor-parallel size: all sizes here
are *full* (unsharded) sizes, and ``validate(tp_size)`` checks that they split
evenly. The default field values give the GPT-2/GPT-3 architecture (learned
positions, LayerNorm, GeLU, biases, tied embeddings); ``rope`` + ``rmsnorm`` +
``swiglu`` + ``add_bias_linear=False`` (+ ``num_query_groups``) give Llama's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megazero.mpu.utils import pad_vocab_size

__all__ = ["GPTConfig", "PRESETS", "gpt_preset"]

_ENUMS = {
    "position_embedding_type": ("learned", "rope"),
    "normalization": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "swiglu"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": ("uniform", "block"),
    "attention_backend": ("auto", "flash", "sdpa", "math"),
}


@dataclass
class GPTConfig:
    """Architecture and execution options of a GPT (decoder-only transformer)."""

    # --- shape -----------------------------------------------------------------------------
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # the tokenizer's vocabulary; the embedding is padded to padded_vocab_size
    # FFN inner size. None -> 4*hidden for gelu; for swiglu Llama's rule: int(8*hidden/3)
    # rounded up to a multiple of 64 (keeps the gated MLP's parameter count ~= 4h MLP's; Llama
    # itself rounds to 256, e.g. 11008 for h=4096: set ffn_hidden_size to match a checkpoint).
    ffn_hidden_size: Optional[int] = None
    # Key/value heads. None -> num_attention_heads (multi-head attention); fewer -> GQA.
    num_query_groups: Optional[int] = None
    max_position_embeddings: int = 2048  # rows of the learned position table
    seq_length: int = 2048  # training sequence length
    # --- architecture ----------------------------------------------------------------------
    position_embedding_type: str = "learned"  # 'learned' | 'rope'
    rotary_base: float = 10000.0  # RoPE theta
    normalization: str = "layernorm"  # 'layernorm' | 'rmsnorm'
    activation: str = "gelu"  # 'gelu' (tanh approximation, = HF gelu_new) | 'swiglu'
    add_bias_linear: bool = True  # biases on every linear layer (QKV, proj, MLP)
    tie_embeddings: bool = True  # output layer reuses the input embedding matrix
    # --- regularisation and init -----------------------------------------------------------
    hidden_dropout: float = 0.1  # on embeddings and on each residual branch
    attention_dropout: float = 0.1  # on attention probabilities
    init_method_std: float = 0.02  # N(0, std); residual-output projections use std/sqrt(2*layers)
    layernorm_epsilon: float = 1e-5
    label_smoothing: float = 0.0  # of the training loss, over the unpadded vocabulary (Megatron's --label-smoothing)
    make_vocab_size_divisible_by: int = 128
    # --- execution -------------------------------------------------------------------------
    # Megatron 2022 sequence parallelism: norms/dropout/residuals on [s/tp, b, h] shards.
    # With tp=1 it is accepted and is a no-op.
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None  # None | 'full' (whole layers) | 'selective' (core attention)
    recompute_method: str = "uniform"  # 'uniform': chunks of recompute_num_layers; 'block': first N layers only
    recompute_num_layers: int = 1
    attention_backend: str = "auto"  # 'auto' | 'flash' | 'sdpa' | 'math'
    params_dtype: torch.dtype = torch.float32

    # ---- resolved sizes -------------------------------------------------------------------

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to ``make_vocab_size_divisible_by``.

        Deliberately not multiplied by the TP size: the full embedding shape is then the
        same for every TP size, so checkpoints reshard freely (validate() checks % tp).
        """
        return pad_vocab_size(self.vocab_size, 1, self.make_vocab_size_divisible_by)

    @property
    def ffn_size(self) -> int:
        """Resolved FFN inner size (see ``ffn_hidden_size``)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return _round_up(int(8 * self.hidden_size / 3), 64)
        return 4 * self.hidden_size

    @property
    def kv_channels(self) -> int:
        """Per-head dimension."""
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Resolved number of key/value heads."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    # ---- checks -----------------------------------------------------------------------------

    def validate(self, tp_size: int = 1) -> "GPTConfig":
        """Raise ValueError (naming the clashing numbers) if this config cannot run at ``tp_size``."""
        for name, allowed in _ENUMS.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {allowed}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "max_position_embeddings", "make_vocab_size_divisible_by", "recompute_num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if tp_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
        h, n, g = self.hidden_size, self.num_attention_heads, self.query_groups
        if h % n:
            raise ValueError(f"hidden_size ({h}) must be divisible by num_attention_heads ({n})")
        if g < 1 or n % g:
            raise ValueError(f"num_attention_heads ({n}) must be divisible by num_query_groups ({g})")
        if n % tp_size:
            raise ValueError(f"num_attention_heads ({n}) must be divisible by the tensor parallel size ({tp_size})")
        if g % tp_size:
            raise ValueError(f"num_query_groups ({g}) must be divisible by the tensor parallel size ({tp_size}); "
                             f"lower tp or raise num_query_groups")
        if self.ffn_size < 1 or self.ffn_size % tp_size:
            raise ValueError(f"ffn size ({self.ffn_size}) must be divisible by the tensor parallel size ({tp_size})")
        if self.padded_vocab_size % tp_size:
            raise ValueError(
                f"padded vocabulary ({self.padded_vocab_size} = {self.vocab_size} rounded up to a multiple of "
                f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by}) must be divisible by the "
                f"tensor parallel size ({tp_size}); use a make_vocab_size_divisible_by that is a multiple of {tp_size}")
        if self.position_embedding_type == "learned" and self.seq_length > self.max_position_embeddings:
            raise ValueError(f"seq_length ({self.seq_length}) exceeds max_position_embeddings "
                             f"({self.max_position_embeddings}) of the learned position table")
        if self.position_embedding_type == "rope" and self.kv_channels % 2:
            raise ValueError(f"RoPE needs an even head dimension, got kv_channels={self.kv_channels}")
        for name in ("hidden_dropout", "attention_dropout", "label_smoothing"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if self.init_method_std <= 0:
            raise ValueError(f"init_method_std must be > 0, got {self.init_method_std}")
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon must be > 0, got {self.layernorm_epsilon}")
        if self.recompute_granularity == "full" and self.recompute_num_layers > self.num_layers:
            raise ValueError(f"recompute_num_layers ({self.recompute_num_layers}) exceeds num_layers ({self.num_layers})")
        return self

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ---- (de)serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (dtype as its name, e.g. 'float32')."""
        d = dataclasses.asdict(self)
        d["params_dtype"] = str(self.params_dtype).replace("torch.", "")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        """Inverse of ``to_dict``; unknown keys are an error (they would be silently ignored otherwise)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; valid fields: {sorted(names)}")
        d = dict(d)
        if isinstance(d.get("params_dtype"), str):
            d["params_dtype"] = getattr(torch, d["params_dtype"].replace("torch.", ""))
        return cls(**d)


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


_GPT3 = dict(seq_length=2048, max_position_embeddings=2048, vocab_size=50257)

# Named shapes (kwargs for GPTConfig). GPT-3 sizes follow Brown et al. 2020, Table 2.1.
# 'gpt-tiny' is for tests and smoke runs; it keeps the default dropout of 0.1.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt-tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                     max_position_embeddings=64, vocab_size=512),
    "gpt-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, **_GPT3),
    "gpt-350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, **_GPT3),
    "gpt-760m": dict(num_layers=24, hidden_size=1536, num_attention_heads=16, **_GPT3),
    "gpt-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, **_GPT3),
    "gpt-2.7b": dict(num_layers=32, hidden_size=2560, num_attention_heads=32, **_GPT3),
    "gpt-6.7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, **_GPT3),
    "gpt-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, **_GPT3),
    "gpt-175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, **_GPT3),
}


def gpt_preset(name: str, **overrides: Any) -> GPTConfig:
    """GPTConfig of a named preset ('gpt-1.3b' or '1.3b'), with fields overridden by keyword."""
    key = name.lower()
    if key not in PRESETS:
        key = "gpt-" + key
    if key not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; valid names: {', '.join(PRESETS)} (the 'gpt-' prefix is optional)")
    return GPTConfig(**{**PRESETS[key], **overrides})
