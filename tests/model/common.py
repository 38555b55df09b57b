"""Tiny configs and batches shared by the model tests."""

from __future__ import annotations

import torch

from megazero.model import GPTConfig

SEQ, BATCH = 16, 2

# 8 heads / 4 query groups: at tp=4 every rank owns one group (2 query heads).
ARCHS = {
    # GPT-2/3: learned positions, LayerNorm, GeLU, biases, tied. Vocab 70 -> 96 padded, so at
    # tp=4 rank 3 holds only padding rows (72..95).
    "gpt": dict(vocab_size=70),
    # Llama-style: RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer.
    "llama": dict(vocab_size=90, num_query_groups=4, position_embedding_type="rope", normalization="rmsnorm",
                  activation="swiglu", add_bias_linear=False, tie_embeddings=False),
}


def tiny_config(arch: str = "gpt", **overrides) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=SEQ, max_position_embeddings=SEQ,
                make_vocab_size_divisible_by=32, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**base, **ARCHS[arch], **overrides})


def batch(config: GPTConfig, seed: int = 7, batch_size: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels (a few set to -100 to exercise ignoring)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100
    return ids[:, :-1].contiguous(), labels


def mean_loss(per_token: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    keep = labels != -100
    return (per_token * keep).sum() / keep.sum()
