"""Autoregressive sampling from a (tensor-parallel) GPTModel: temperature, top-k, top-p.

Every rank runs the same forward passes; the vocab-parallel logits of the last
position are gathered over TP and sampled with a generator seeded identically
on all ranks. The logits are not bit-identical across data-parallel replicas (each
replica's TP all-reduce may add in its own order), so a near-tie can be sampled
differently: the token rank 0 samples is broadcast and every rank appends that one,
which also makes the end-of-document stop the same step everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..mpu.mappings import gather_from_tensor_model_parallel_region

__all__ = ["sample_next", "agree_on_tokens", "generate", "generate_text"]


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


@torch.no_grad()
def generate(model: torch.nn.Module, tokens: torch.Tensor, max_new_tokens: int, *, seq_length: int,
             vocab_size: Optional[int] = None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, eod: Optional[int] = None, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Extend ``tokens [b, t]`` by up to ``max_new_tokens``; the context is cut to the last
    ``seq_length`` tokens. Padded vocabulary entries (>= ``vocab_size``) are never sampled.
    Generation stops early after a step in which every row sampled ``eod``.

    Every rank of ``group`` (the default group when None; it must hold every TP rank and
    every data-parallel replica of the model) calls it together with the same arguments, and
    every rank returns the same tokens after the same number of forward passes: each step's
    tokens are those the group's first rank sampled. Cost per generated token: one broadcast
    of ``b`` int64 ids (8·b bytes, latency-bound) over ``group``, besides the forward pass.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    try:
        for _ in range(max_new_tokens):
            context = tokens[:, -seq_length:]
            logits = model(context)[:, -1, :]  # [b, vocab / tp]
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
