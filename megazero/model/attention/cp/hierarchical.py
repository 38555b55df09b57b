"""Hierarchical context parallelism (``a2a+p2p``): all-to-all over heads inside a group of A ranks,
ring attention across P such groups (cp = A x P), Megatron-core's hierarchical CP.

The cp ranks hold the zigzag chunks of the sequence (rank c = o·A + i: chunks c and 2cp-1-c of 2cp).
The A ranks of ring rank o together hold chunks o·A .. o·A+A-1 and their mirror images, which are
exactly the two zigzag chunks of o among 2P. So the all-to-all inside the group (Ulysses: every rank
gets all the group's tokens for heads/A of the heads), reordered to increasing positions, leaves
each rank with ring rank o's zigzag share of the sequence, and the ring over the P groups computes
the attention for those heads; the inverse all-to-all hands each rank its tokens back.

Sent per rank per layer: the all-to-all of q, k, v and the output inside the group (Ulysses' volume
for S/P tokens over A ranks) and the ring's K/V blocks of heads/A heads: all-to-all's small messages
stay on the fast links of a node while the ring's larger ones cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megazero.model.attention.cp.exchanges import a2a_dropout, a2a_head_split, a2a_sinks, scatter_heads
from megazero.model.attention.cp.layout import CPLayout, zigzag_document_layout, zigzag_layout
from megazero.model.keyed_dropout import AttentionDropout
from megazero.model.attention.cp.ring import ring_attention
from megazero.mpu.cp_exchange import CommCounter, heads_to_seq_all_to_all

__all__ = ["Hierarchy", "hierarchical_attention"]


@dataclass(frozen=True)
class Hierarchy:
    """The two levels of one CP group: the all-to-all group (``a2a_size`` consecutive CP ranks), the
    ring group (``p2p_size`` ranks, one per all-to-all group), the ring's layout of the sequence (per
    sample with packed documents) and the permutation from the all-to-all's rank-major order to it."""

    a2a_group: Optional[dist.ProcessGroup]
    p2p_group: Optional[dist.ProcessGroup]
    a2a_size: int
    p2p_size: int
    ring_layouts: tuple[CPLayout, ...]
    order: torch.Tensor  # gathered index -> ring storage order
    inverse: torch.Tensor

    @classmethod
    def build(cls, seq_len: int, a2a_size: int, p2p_size: int, a2a_group: Optional[dist.ProcessGroup],
              p2p_group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> "Hierarchy":
        """For sequences of ``seq_len`` tokens on the zigzag placement over a2a_size x p2p_size ranks."""
        cp = a2a_size * p2p_size
        if seq_len % (2 * cp):
            raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size {2 * cp}")
        c = seq_len // (2 * cp)
        # All-to-all rank i holds [chunk oA+i, chunk 2cp-1-oA-i]; the ring's storage order is the first
        # chunks by i rising, then the mirror chunks by i falling (increasing positions).
        order = torch.cat([torch.arange(2 * i * c, (2 * i + 1) * c) for i in range(a2a_size)]
                          + [torch.arange((2 * i + 1) * c, (2 * i + 2) * c) for i in reversed(range(a2a_size))])
        inverse = torch.argsort(order)
        if device is not None:
            order, inverse = order.to(device), inverse.to(device)
        return cls(a2a_group, p2p_group, a2a_size, p2p_size, (zigzag_layout(seq_len, p2p_size),), order, inverse)

    def with_documents(self, cu_seqlens: Sequence[Sequence[int]]) -> "Hierarchy":
        """The ring's layouts cut at each sample's documents (cu_seqlens per sample)."""
        layouts = tuple(zigzag_document_layout(cu, self.p2p_size) for cu in cu_seqlens)
        return Hierarchy(self.a2a_group, self.p2p_group, self.a2a_size, self.p2p_size, layouts, self.order,
                         self.inverse)


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hierarchy: Hierarchy, *,
                           counter: Optional[CommCounter] = None, ring_stats=None,
                           kernel: str = "auto", dropout: Optional[AttentionDropout] = None,
                           dropout_p: float = 0.0, window: Optional[int] = None,
                           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (per-document) attention of the whole sequence for this rank's tokens: q ``[s_local, b,
    heads, dqk]``, k ``[s_local, b, groups, dqk]``, v ``[s_local, b, groups, dv]`` -> ``[s_local, b,
    heads * dv]``. Heads must divide by the all-to-all size, and KV groups divide by it or it by them
    (:func:`a2a_head_split`). ``dropout``: keyed attention dropout of this rank's heads, applied by the
    ring to the heads the all-to-all leaves; ``dropout_p``: the ring's kernels' own masks instead.
    ``window`` and ``sinks`` ``[heads]`` (this rank's heads): as the ring's, for the heads left here."""
    h = hierarchy
    s, b, heads, d = *q.shape[:3], v.size(3)
    a2a_head_split(heads, k.size(2), h.a2a_size)
    q_h, k_h, v_h = (t.index_select(0, h.order) for t in scatter_heads(q, k, v, h.a2a_group, counter))
    out = ring_attention(q_h, k_h, v_h, h.ring_layouts if len(h.ring_layouts) > 1 else h.ring_layouts[0],
                         h.p2p_group, stats=ring_stats, kernel=kernel, dropout=a2a_dropout(dropout, h.a2a_group),
                         dropout_p=dropout_p, window=window, sinks=a2a_sinks(sinks, h.a2a_group))
    out = out.view(q_h.size(0), b, heads // h.a2a_size, d).index_select(0, h.inverse)
    return heads_to_seq_all_to_all(out, h.a2a_group, counter).reshape(s, b, heads * d)
