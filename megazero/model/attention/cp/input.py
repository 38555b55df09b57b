"""A batch split for context parallelism: the model's one call that gives a rank its tokens.

Every context-parallel rank reads the whole sample; :func:`prepare_context_parallel_input` keeps this
rank's tokens of every per-token tensor (inputs, labels, masks, multi-token targets: anything whose
last dimension is the sequence), their global positions, and the attention's context
(:class:`~megazero.model.attention.cp.context.ContextParallel`), with packed documents placed as the
ring balances them (torchtitan's ``prepare_context_parallel_input``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .context import ContextParallel
from .hierarchical import Hierarchy
from .layout import CPLayout, zigzag_layout

__all__ = ["context_parallel_context", "prepare_context_parallel_input", "document_bounds"]


def context_parallel_context(seq_length: int, groups, comm_type, device: torch.device,
                             hierarchical: tuple[int, ...] = ()) -> ContextParallel:
    """Rank ``groups.cp_rank``'s share of a ``seq_length`` sequence (chunks r and 2cp-1-r of 2cp), with
    the attention's context (``comm_type``: one exchange or one per layer; ``hierarchical``: a2a+p2p's
    sizes), its index tensors on ``device``. The same for every micro-batch of that length."""
    layout = zigzag_layout(seq_length, groups.cp_size)
    hierarchy = (Hierarchy.build(seq_length, hierarchical[0], hierarchical[1], groups.hcp_a2a_group,
                                 groups.hcp_p2p_group, device) if hierarchical else None)
    return ContextParallel.from_layout(layout, groups.cp_rank, groups.cp_group, comm_type, device=device,
                                       hierarchy=hierarchy)


def prepare_context_parallel_input(ctx: ContextParallel, sequences: dict[str, Optional[torch.Tensor]],
                                   position_ids: Optional[torch.Tensor] = None,
                                   attention_mask: Optional[torch.Tensor] = None,
                                   documents: Optional[list[list[int]]] = None, balance_documents: bool = True):
    """This rank's share of a whole micro-batch under ``ctx`` (:func:`context_parallel_context`):
    ``(ctx, {name: this rank's tokens of each tensor}, global positions [b, s_local] or [s_local],
    attention mask)``. ``sequences`` maps names to tensors ``[..., b, s]`` (None passes through);
    ``documents``: each sample's packed documents as cu_seqlens, which the ring takes in place of the
    attention mask (the mask is then dropped unless an a2a or all-gather layer still needs it), and whose
    starts the context carries for the recurrent layers. ``balance_documents``: with rings in every layer, place
    each sample's documents evenly over the ranks (False: keep the zigzag placement, which the recurrent
    layers' state passing needs: one placement for every sample)."""
    mask = attention_mask
    device = next(t for t in sequences.values() if t is not None).device
    if documents is not None and {"p2p", "a2a+p2p"} & set(ctx.comm_types):
        # Rings in every layer: each sample's documents balanced over the ranks (its own placement).
        ctx = ctx.with_documents(documents, balanced=balance_documents and set(ctx.comm_types) == {"p2p"},
                                 device=device)
        mask = mask if {"a2a", "allgather"} & set(ctx.comm_types) else None
    if documents is not None and ctx.sample_positions is None:
        ctx = dataclasses.replace(ctx, starts=_document_starts(documents, ctx.layout, ctx.rank, device))
    if ctx.sample_positions is not None:
        pos = ctx.sample_positions  # [b, s_local]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.gather(-1, pos.expand(*t.shape[:-2], *pos.shape))
    else:
        pos = ctx.shard.positions

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[..., pos]

    local = {name: take(t) if t is not None else None for name, t in sequences.items()}
    positions = take(position_ids) if position_ids is not None else pos
    return ctx, local, positions, mask


def document_bounds(text: torch.Tensor, eod: int) -> list[list[int]]:
    """Each sample's packed documents as cu_seqlens, from the loader's host tokens ``[b, s + 1]``: a
    document ends after each end-of-document token of the inputs (Megatron's reset semantics)."""
    s = text.size(1) - 1
    ends = (text[:, :s - 1] == eod).nonzero().tolist()  # an EOD at the last input ends nothing inside
    cuts: list[list[int]] = [[0] for _ in range(text.size(0))]
    for sample, i in ends:
        cuts[sample].append(i + 1)
    return [c + [s] for c in cuts]


def _document_starts(documents: list[list[int]], layout: Optional[CPLayout], rank: int,
                     device: torch.device) -> torch.Tensor:
    """``[b, s_local]`` bool: which of rank ``rank``'s tokens (under ``layout``) begin a document, built on the
    host from the cu_seqlens and copied without waiting."""
    positions = layout.positions(rank)
    starts = torch.zeros(len(documents), int(documents[0][-1]), dtype=torch.bool)
    for sample, cu in enumerate(documents):
        starts[sample, torch.tensor(cu[:-1], dtype=torch.long)] = True
    local = starts[:, positions]
    if device.type == "cuda":
        local = local.pin_memory()
    return local.to(device, non_blocking=True)
