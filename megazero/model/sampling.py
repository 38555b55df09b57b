"""Autoregressive sampling from a (tensor-parallel) GPTModel: temperature, top-k, top-p.

Every rank runs the same forward passes; the vocab-parallel logits of the last
position are gathered over TP and sampled with a generator seeded identically
on all ranks. The logits are not bit-identical across data-parallel replicas (each
replica's TP all-reduce may add in its own order), so a near-tie can be sampled
differently: the token rank 0 samples is broadcast and every rank appends that one,
which also makes the end-of-document stop the same step everywhere. A model that can
(:func:`decode_with_cache`) decodes incrementally with a :class:`~megazero.model.decode_cache.DecodeCache`:
one forward over the prompt, then one over each new token.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..mpu.mappings import gather_from_tensor_model_parallel_region
from .decode_cache import DecodeCache

__all__ = ["sample_next", "agree_on_tokens", "decode_with_cache", "generate", "generate_text"]

logger = logging.getLogger(__name__)


def sample_next(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """One token id per row of ``logits [b, vocab]``; ``temperature=0`` is greedy."""
    logits = logits.float()
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def agree_on_tokens(tokens: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The ``tokens`` of the first rank of ``group`` (the default group when None), on every rank of it.

    Every rank of the group must call it with a tensor of the same shape and dtype. Without
    ``torch.distributed``, or on a group of one, ``tokens`` is returned as it is.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tokens
    tokens = tokens.contiguous()
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(tokens, src=src, group=group)
    return tokens


def decode_with_cache(model: torch.nn.Module, total_length: int, seq_length: int,
                      use_cache: Optional[bool] = None) -> bool:
    """Whether :func:`generate` decodes ``model`` with a :class:`~megazero.model.decode_cache.DecodeCache` for
    sequences of up to ``total_length`` tokens: when the model can (its ``decode_cache_refusal()`` says None) and,
    beyond ``seq_length`` tokens, only if its positions are not learned ones (those recompute the cut context).
    ``use_cache``: None decides so; True demands the cache (ValueError saying why it cannot); False never."""
    if use_cache is False:
        return False
    refuse = getattr(model, "decode_cache_refusal", None)
    refusal = refuse() if callable(refuse) else f"{type(model).__name__} takes no decoding cache"
    config = getattr(model, "config", None)
    if refusal is None and total_length > seq_length and getattr(config, "position_embedding_type", None) == "learned":
        refusal = (f"{total_length} tokens exceed seq_length ({seq_length}) and the model's positions are learned: "
                   "the context is cut to the last seq_length tokens and recomputed every step")
    if refusal is not None and use_cache:
        raise ValueError(f"generate(use_cache=True): {refusal}")
    if refusal is not None:
        logger.debug("generating without a decoding cache: %s", refusal)
    return refusal is None


@torch.no_grad()
def generate(model: torch.nn.Module, tokens: torch.Tensor, max_new_tokens: int, *, seq_length: int,
             vocab_size: Optional[int] = None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, eod: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
             use_cache: Optional[bool] = None) -> torch.Tensor:
    """Extend ``tokens [b, t]`` by up to ``max_new_tokens``. Padded vocabulary entries (>= ``vocab_size``)
    are never sampled. Generation stops early after a step in which every row sampled ``eod``.

    Two ways, the same tokens while the sequence fits ``seq_length``: with a decoding cache
    (:func:`decode_with_cache`; a GPTModel without pipeline stages or sequence parallelism) a forward over the
    prompt fills it and each later step runs the new token only; without, every step runs the context cut to
    the last ``seq_length`` tokens. Beyond ``seq_length`` they differ: the cache's model sees the whole sequence
    (a recurrent layer's state and an attention layer's keys since the first token, RoPE positions continuing),
    while models with learned positions, and models without a cache, keep the recomputed cut context.

    Every rank of ``group`` (the default group when None; it must hold every TP rank and
    every data-parallel replica of the model) calls it together with the same arguments, and
    every rank returns the same tokens after the same number of forward passes: each step's
    tokens are those the group's first rank sampled. Cost per generated token: one broadcast
    of ``b`` int64 ids (8·b bytes, latency-bound) over ``group``, besides the forward pass.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    cache = DecodeCache() if decode_with_cache(model, tokens.size(1) + max_new_tokens, seq_length, use_cache) else None
    try:
        for step in range(max_new_tokens):
            if cache is None:
                logits = model(tokens[:, -seq_length:])[:, -1, :]  # [b, vocab / tp]
            else:  # the prompt once, then the new token only
                logits = model(tokens if step == 0 else tokens[:, -1:], cache=cache)[:, -1, :]
            logits = gather_from_tensor_model_parallel_region(logits)
            if vocab_size is not None:
                logits[:, vocab_size:] = float("-inf")
            nxt = agree_on_tokens(sample_next(logits, generator, temperature, top_k, top_p), group)
            tokens = torch.cat([tokens, nxt.unsqueeze(-1).to(tokens.device)], dim=-1)
            if eod is not None and bool((nxt == eod).all()):
                break
    finally:
        model.train(was_training)
    return tokens


def generate_text(model: torch.nn.Module, tokenizer, prompt: str, *, max_new_tokens: int = 64,
                  temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0) -> str:
    """Prompt in, prompt + continuation out (decoded with ``tokenizer``). Every rank of the default
    group calls it together and gets the same text (see :func:`generate`)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = tokenizer.tokenize(prompt) or [tokenizer.eod]
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    cfg = getattr(model, "config", None)
    seq_length = cfg.seq_length if cfg is not None else tokens.size(1) + max_new_tokens
    out = generate(model, tokens, max_new_tokens, seq_length=seq_length, vocab_size=tokenizer.vocab_size,
                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eod=tokenizer.eod)
    return tokenizer.detokenize(out[0].tolist())
