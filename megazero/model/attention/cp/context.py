"""What a model's attention needs to run context-parallel, and the dispatch to the exchange it names.

One :class:`ContextParallel` is built per sequence length (the layout depends on nothing else) and
handed to every layer; a layer runs the exchange its number is given (one for all layers, or one per
layer as Megatron's ``--cp-comm-type`` accepts): ``p2p`` (ring.py), ``a2a`` and
``allgather`` (exchanges.py), ``a2a+p2p`` (hierarchical.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megazero.model.attention.cp.exchanges import SequenceShard, a2a_attention, allgather_attention
from megazero.model.attention.cp.hierarchical import Hierarchy, hierarchical_attention
from megazero.model.attention.cp.layout import CPLayout, balanced_document_layout, zigzag_document_layout
from megazero.model.keyed_dropout import AttentionDropout
from megazero.model.attention.cp.ring import ring_attention

__all__ = ["ContextParallel", "context_parallel_attention", "COMM_TYPES"]

COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


@dataclass(frozen=True)
class ContextParallel:
    """The CP ``group``; the exchange (``comm_type``: one name, or one per layer); where this rank's
    tokens sit (``shard``) and the ``layout`` they were split by; the ``hierarchy`` of ``a2a+p2p``;
    with packed documents (:meth:`with_documents`) the ring's per-sample layouts. The model's position
    ids must be the tokens' global positions."""

    group: Optional[dist.ProcessGroup]
    comm_type: Union[str, tuple[str, ...]]
    shard: SequenceShard
    layout: Optional[CPLayout] = None
    counter: Optional[object] = None  # CommCounter (a2a, allgather) or RingStats (p2p)
    sample_layouts: Optional[tuple[CPLayout, ...]] = None  # the ring's per-sample documents
    hierarchy: Optional[Hierarchy] = None
    documents: bool = False  # the attention mask's documents are in the layouts (the ring ignores the mask)
    # With documents balanced per sample: [b, s_local] the global indices of this rank's tokens of each
    # sample (they differ between samples); None: ``shard.positions`` for every sample.
    sample_positions: Optional[torch.Tensor] = None
    rank: int = 0  # this rank's index in the CP group
    # With packed documents: [b, s_local] bool, True where this rank's token begins a document (the recurrent
    # layers' resets); None: one document per sample.
    starts: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for t in self.comm_types:
            if t not in COMM_TYPES:
                raise ValueError(f"cp comm type {t!r} is not available here; choose one of {COMM_TYPES}")
        if "p2p" in self.comm_types and self.layout is None:
            raise ValueError("the p2p (ring) exchange needs the layout the sequence was split by: "
                             "build it with ContextParallel.from_layout")
        if "a2a+p2p" in self.comm_types and self.hierarchy is None:
            raise ValueError("the a2a+p2p exchange needs its hierarchy (Hierarchy.build): the all-to-all and "
                             "ring groups")

    @property
    def comm_types(self) -> tuple[str, ...]:
        return (self.comm_type,) if isinstance(self.comm_type, str) else tuple(self.comm_type)

    def comm_type_of(self, layer: int) -> str:
        """The exchange layer ``layer`` (its index in the whole model) runs."""
        if isinstance(self.comm_type, str):
            return self.comm_type
        if not 0 <= layer < len(self.comm_type):
            raise ValueError(f"layer {layer} has no cp comm type: {len(self.comm_type)} given, one per layer")
        return self.comm_type[layer]

    @classmethod
    def from_layout(cls, layout: CPLayout, rank: int, group: Optional[dist.ProcessGroup],
                    comm_type: Union[str, Sequence[str]], counter: Optional[object] = None,
                    device: Optional[torch.device] = None, hierarchy: Optional[Hierarchy] = None) -> "ContextParallel":
        """The context of CP rank ``rank`` for a sequence split by ``layout`` (no communication), its
        index tensors on ``device``. Checked on the host, then moved: no device synchronisation."""
        shard = SequenceShard.from_rank_positions([layout.positions(r) for r in range(layout.cp_size)], rank)
        kind = comm_type if isinstance(comm_type, str) else tuple(comm_type)
        return cls(group, kind, shard if device is None else shard.to(device), layout, counter, hierarchy=hierarchy,
                   rank=rank)

    def with_documents(self, cu_seqlens: Sequence[Sequence[int]], balanced: bool = False,
                       device: Optional[torch.device] = None) -> "ContextParallel":
        """This context for a batch of packed documents, ``cu_seqlens`` per sample ([0, end of doc 0, ...,
        S]). ``balanced`` (every layer a ring): each sample's documents are split evenly over the ranks
        (:func:`~megazero.model.attention.cp.layout.balanced_document_layout`), so the tokens a rank holds differ
        between samples: ``sample_positions`` says which (on ``device``). Otherwise the zigzag placement
        is kept and the rings' blocks are cut at the document boundaries; the all-to-all and all-gather
        exchanges take the mask instead."""
        if balanced:
            if set(self.comm_types) != {"p2p"}:
                raise ValueError(f"documents balanced per sample need the ring in every layer, got {self.comm_types}")
            layouts = tuple(balanced_document_layout(cu, self.layout.cp_size) for cu in cu_seqlens)
            positions = torch.stack([x.positions(self.rank) for x in layouts])
            if device is not None and device.type == "cuda":  # pinned: the copy does not wait for the GPU
                positions = positions.pin_memory()
            positions = positions.to(device if device is not None else positions.device, non_blocking=True)
            return dataclasses.replace(self, sample_layouts=layouts, documents=True, sample_positions=positions)
        seq = self.shard.all_positions.numel()
        if any(int(cu[-1]) != seq for cu in cu_seqlens):
            raise ValueError(f"documents must cover the {seq} tokens of the sequence, got "
                             f"{[int(cu[-1]) for cu in cu_seqlens]}")
        layouts = (tuple(zigzag_document_layout(cu, self.layout.cp_size) for cu in cu_seqlens)
                   if "p2p" in self.comm_types else None)
        hierarchy = self.hierarchy.with_documents(cu_seqlens) if self.hierarchy is not None else None
        return dataclasses.replace(self, sample_layouts=layouts, hierarchy=hierarchy, documents=True)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, *,
                               layer: int = 0, backend: str = "auto", attention_mask: Optional[torch.Tensor] = None,
                               dropout: Optional[AttentionDropout] = None, dropout_p: float = 0.0,
                               window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``core_attention`` of this rank's queries over the whole sequence, by the exchange of ``layer``: q/k
    ``[s_local, b, heads | groups, dqk]``, v ``[s_local, b, groups, dv]`` -> ``[s_local, b, heads * dv]``.
    The ring (and the ring of ``a2a+p2p``) takes packed documents from its layouts, not from a mask, and
    its block kernel from ``block_kernels`` (the explicit formula when ``backend`` is 'math').
    ``dropout``: attention dropout keyed by position (``dropout.heads``: this rank's global heads), the
    masks of the whole sequence whichever exchange runs; every exchange then computes by the explicit
    formula's tiles. ``dropout_p``: the kernels' own masks instead (the fused kernels run: sdpa or
    flash in ``a2a``, the block kernels in the others), drawn from the model-parallel stream, which
    depend on the layout (Megatron's behaviour). ``window`` (a query at i sees keys i - window .. i) and
    ``sinks`` (``[heads]``, this rank's heads): every exchange computes them exactly."""
    kind = cp.comm_type_of(layer)
    if kind == "a2a":
        return a2a_attention(q, k, v, cp.shard, cp.group, backend=backend, attention_mask=attention_mask,
                             counter=cp.counter, dropout=dropout, dropout_p=dropout_p, window=window, sinks=sinks)
    if kind == "allgather":
        return allgather_attention(q, k, v, cp.shard, cp.group, backend=backend, attention_mask=attention_mask,
                                   counter=cp.counter, layout=cp.layout, dropout=dropout, dropout_p=dropout_p,
                                   window=window, sinks=sinks)
    if attention_mask is not None and not cp.documents:
        raise ValueError(f"the {kind} exchange takes packed documents from its layouts "
                         "(ContextParallel.with_documents), not from an attention mask; pass no mask")
    kernel = "math" if backend == "math" else "auto"
    if kind == "a2a+p2p":
        return hierarchical_attention(q, k, v, cp.hierarchy, counter=cp.counter, kernel=kernel, dropout=dropout,
                                      dropout_p=dropout_p, window=window, sinks=sinks)
    return ring_attention(q, k, v, cp.sample_layouts or cp.layout, cp.group, stats=cp.counter, kernel=kernel,
                          dropout=dropout, dropout_p=dropout_p, window=window, sinks=sinks)
