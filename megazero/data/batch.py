"""Inputs, labels and masks of a GPT micro-batch from packed samples, Megatron's way.

A sample is ``seq_length + 1`` stream tokens that may span several documents separated
by the end-of-document token. Megatron's ``get_ltor_masks_and_position_ids`` decides
how documents inside one sample see each other; ``build_batch`` computes the same
tensors (vectorized instead of a per-EOD Python loop):

* ``reset_position_ids``: position ids restart at 0 after every EOD token;
* ``reset_attention_mask``: a token attends only to earlier tokens of its own document
  (block-diagonal causal); the EOD token belongs to the document it ends;
* ``eod_mask_loss``: no loss where the *input* token is EOD (predicting the next
  document's first token from the previous document's end).

The attention mask is boolean ``[b, 1, s, s]`` with True = masked out (causality
included), the form ``GPTModel.forward`` takes; it is None without
``reset_attention_mask`` (the model applies plain causality itself, and flash attention
can run). The loss of a batch is ``sum(loss * loss_mask) / sum(loss_mask)``.

``to_device`` is the one host -> device move of a loader batch: on CUDA runs the loader
pins its batches (``pin_memory_for``) and the copy is asynchronous (``non_blocking``), so it
overlaps with the work already queued on the GPU instead of stalling the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["GPTBatch", "build_batch", "masked_mean", "to_device", "pin_memory_for"]


def pin_memory_for(device) -> bool:
    """Whether a loader feeding ``device`` should pin (page-lock) its batches: CUDA only,
    where pinned memory is what lets :func:`to_device` copy asynchronously."""
    return torch.device(device).type == "cuda"


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` (a loader batch) on ``device``: the same tensor when it is there already (the
    CPU runs), else a copy, ``non_blocking`` on CUDA. From pinned memory (see
    :func:`pin_memory_for`) that copy is asynchronous and ordered on the current stream
    before the kernels that read it; from pageable memory torch copies synchronously."""
    device = torch.device(device)
    return tensor.to(device, non_blocking=device.type == "cuda")


@dataclass
class GPTBatch:
    tokens: torch.Tensor  # [b, s] int64 inputs
    labels: torch.Tensor  # [b, s] int64 next tokens
    loss_mask: torch.Tensor  # [b, s] float32, 0 where no loss is taken
    position_ids: torch.Tensor  # [b, s] int64
    attention_mask: Optional[torch.Tensor]  # [b, 1, s, s] bool, True = masked; None = plain causal
    dropout_keys: Optional[torch.Tensor] = None  # [b] int64 samples' keys of position-keyed dropout


def build_batch(text: torch.Tensor, eod: Optional[int], reset_position_ids: bool = False,
                reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> GPTBatch:
    """``text`` ``[b, seq_length + 1]`` token ids (the dataset's samples) -> ``GPTBatch``."""
    if text.dim() != 2 or text.size(1) < 2:
        raise ValueError(f"text must be [batch, seq_length + 1] with seq_length >= 1, got shape {tuple(text.shape)}")
    if eod is None and (reset_position_ids or reset_attention_mask or eod_mask_loss):
        raise ValueError("reset_position_ids / reset_attention_mask / eod_mask_loss need the tokenizer's "
                         "end-of-document id (this tokenizer has none)")
    text = text.long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    b, s = tokens.shape
    is_eod = tokens == eod if eod is not None else torch.zeros_like(tokens, dtype=torch.bool)
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=text.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # Document number of every token: how many EODs come strictly before it.
    doc = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()
    arange = torch.arange(s, device=text.device)
    if reset_position_ids:
        # First position of each token's document: one past the last EOD before it.
        after_eod = torch.where(is_eod, arange + 1, torch.zeros_like(arange))
        start = torch.cummax(after_eod, dim=1).values
        start = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=text.device), start[:, :-1]], dim=1)
        position_ids = arange - start
    else:
        position_ids = arange.expand(b, s).clone()
    attention_mask = None
    if reset_attention_mask:
        causal = torch.ones(s, s, dtype=torch.bool, device=text.device).triu_(1)
        other_doc = doc[:, :, None] != doc[:, None, :]
        attention_mask = (causal | other_doc)[:, None]
    return GPTBatch(tokens, labels, loss_mask, position_ids, attention_mask)


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's loss reduction: ``sum(loss * mask) / sum(mask)`` (fp32)."""
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp_min(1.0)
