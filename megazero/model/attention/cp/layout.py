"""Which tokens of a sequence each context-parallel (CP) rank holds, and which attention blocks it computes.

Pure functions, no communication. A sequence of ``S`` tokens is cut into ``2P`` equal chunks for ``P``
CP ranks; rank ``r`` holds chunks ``r`` and ``2P-1-r`` (Megatron's DualChunkSwap, "zigzag"), so under a
causal mask every rank computes the same number of query-key pairs. With packed documents
(block-diagonal causal mask) each document is cut into ``2P`` chunks the same way and a rank holds
its two chunks of every document, in document order; a document whose length is not a multiple of
``2P`` is refused (as Megatron does): pad the documents, or choose another CP size.

A layout is a list of *runs* per rank: ``(document, global start, length)``, contiguous in the
global sequence, in the order the rank stores them. :func:`plan_blocks` turns the runs of a query
rank and a key/value rank into the dense sub-blocks the ring kernel computes, skipping fully masked
work; :func:`work_per_rank` counts the query-key pairs those blocks compute.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["CPLayout", "Block", "zigzag_layout", "document_layout", "balanced_document_layout", "zigzag_document_layout",
           "contiguous_layout",
           "cu_seqlens_from_document_ids", "split_for_rank", "gather_from_ranks", "plan_blocks",
           "windowed_blocks", "work_per_rank"]

Run = tuple[int, int, int]  # (document, global start, length)


@dataclass(frozen=True)
class Block:
    """One dense block: local query rows ``[q_lo, q_hi)`` x local key columns ``[k_lo, k_hi)``.
    ``causal``: rows and columns are the same tokens in increasing global order (mask j > i);
    otherwise every pair is allowed. ``band`` (a sliding window's edge): column j of the block is
    also masked for row i when j < i + band (block-local indices)."""
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    band: Optional[int] = None

    @property
    def pairs(self) -> int:
        """The unmasked query-key pairs of the block (what a kernel skipping masked tiles computes)."""
        n, m = self.q_hi - self.q_lo, self.k_hi - self.k_lo
        if self.band is None:
            return n * (n + 1) // 2 if self.causal else n * m
        return sum(max(0, (r + 1 if self.causal else m) - max(0, r + self.band)) for r in range(n))


@dataclass(frozen=True)
class CPLayout:
    """The tokens each of ``cp_size`` ranks holds of a ``seq_len`` sequence (see the module docstring)."""
    seq_len: int
    cp_size: int
    runs: tuple[tuple[Run, ...], ...]  # per rank

    @property
    def local_len(self) -> int:
        return sum(n for _, _, n in self.runs[0])

    def positions(self, rank: int) -> torch.Tensor:
        """Global token indices rank ``rank`` holds, in its storage order (for RoPE, position ids, dropout keys)."""
        return torch.cat([torch.arange(s, s + n) for _, s, n in self.runs[rank]])

    def position_ids(self, rank: int, doc_starts: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Position ids of the rank's tokens; with ``doc_starts`` (cu_seqlens) counted from each document's start."""
        if doc_starts is None:
            return self.positions(rank)
        return torch.cat([torch.arange(s, s + n) - doc_starts[d] for d, s, n in self.runs[rank]])


def _chunk_runs(doc: int, start: int, length: int, rank: int, p: int) -> list[Run]:
    c = length // (2 * p)
    return [(doc, start + rank * c, c), (doc, start + (2 * p - 1 - rank) * c, c)]


def zigzag_layout(seq_len: int, cp_size: int) -> CPLayout:
    """Load-balanced causal layout: rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``."""
    if cp_size < 1 or seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size = "
                         f"{2 * cp_size}: the balanced layout cuts it into {2 * cp_size} equal chunks; use a "
                         f"sequence length that is a multiple of {2 * cp_size} (e.g. "
                         f"{-(-seq_len // (2 * cp_size)) * 2 * cp_size}) or another CP size")
    return CPLayout(seq_len, cp_size, tuple(tuple(_chunk_runs(0, 0, seq_len, r, cp_size)) for r in range(cp_size)))


def document_layout(cu_seqlens: Sequence[int], cp_size: int) -> CPLayout:
    """Per-document balanced layout for packed documents ``cu_seqlens`` = [0, end of doc 0, ..., S]:
    each document cut into ``2P`` chunks, rank ``r`` holding chunks ``r`` and ``2P-1-r`` of each."""
    cu = [int(x) for x in cu_seqlens]
    if not cu or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {cu}")
    bad = [(d, b - a) for d, (a, b) in enumerate(zip(cu, cu[1:])) if (b - a) % (2 * cp_size)]
    if bad:
        shown = ", ".join(f"document {d} has {n} tokens" for d, n in bad[:5])
        raise ValueError(f"{shown}{' ...' if len(bad) > 5 else ''}: with context-parallel size {cp_size} every "
                         f"packed document must be a multiple of {2 * cp_size} tokens (it is cut into "
                         f"{2 * cp_size} chunks for load balance); pad each document to a multiple of "
                         f"{2 * cp_size} or choose another CP size")
    runs = tuple(tuple(run for d, (a, b) in enumerate(zip(cu, cu[1:])) for run in _chunk_runs(d, a, b - a, r, cp_size))
                 for r in range(cp_size))
    return CPLayout(cu[-1], cp_size, runs)


def balanced_document_layout(cu_seqlens: Sequence[int], cp_size: int) -> CPLayout:
    """Packed documents of any lengths, each balanced on its own: document d of n tokens is cut into 2P
    chunks of n // 2P tokens, rank r holding chunks r and 2P-1-r (its two in document order), and the
    n % 2P tokens left over lengthen chunks one token each, dealt round-robin over the ranks across
    all documents, so that every rank holds exactly S / P tokens (S a multiple of 2P). The causal work
    of every document is then split evenly (up to those single tokens), whatever the lengths."""
    cu = [int(x) for x in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {cu}")
    p = cp_size
    if cu[-1] % (2 * p):
        raise ValueError(f"sequence length {cu[-1]} is not divisible by 2 x context-parallel size = {2 * p}")
    runs: list[list[Run]] = [[] for _ in range(p)]
    deal = 0  # the next rank a left-over token goes to
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        n = b - a
        sizes = [n // (2 * p)] * (2 * p)
        for _ in range(n % (2 * p)):  # a rank takes its first chunk's extra token, then its mirror's
            r = deal % p
            sizes[r if sizes[r] == n // (2 * p) else 2 * p - 1 - r] += 1
            deal += 1
        starts = [a + sum(sizes[:j]) for j in range(2 * p)]
        for r in range(p):
            for j in (r, 2 * p - 1 - r):
                if sizes[j]:
                    runs[r].append((d, starts[j], sizes[j]))
    return CPLayout(cu[-1], p, tuple(tuple(r) for r in runs))


def zigzag_document_layout(cu_seqlens: Sequence[int], cp_size: int) -> CPLayout:
    """Packed documents of any lengths on the zigzag placement: rank ``r`` holds the tokens
    :func:`zigzag_layout` gives it, and its runs are cut at the document boundaries ``cu_seqlens``
    ([0, end of doc 0, ..., S]), so the ring masks across documents. Documents need no padding; the
    work per rank then depends on where the documents fall (:func:`work_per_rank` says how much)."""
    cu = [int(x) for x in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase, got {cu}")
    base = zigzag_layout(cu[-1], cp_size)
    runs = []
    for rank_runs in base.runs:
        cut: list[Run] = []
        for _, start, n in rank_runs:
            at = start
            while at < start + n:
                doc = bisect.bisect_right(cu, at) - 1
                end = min(cu[doc + 1], start + n)
                cut.append((doc, at, end - at))
                at = end
        runs.append(tuple(cut))
    return CPLayout(cu[-1], cp_size, tuple(runs))


def contiguous_layout(seq_len: int, cp_size: int) -> CPLayout:
    """Rank ``r`` holds the ``r``-th of ``P`` contiguous chunks: the unbalanced baseline."""
    if seq_len % cp_size:
        raise ValueError(f"sequence length {seq_len} is not divisible by the context-parallel size {cp_size}")
    c = seq_len // cp_size
    return CPLayout(seq_len, cp_size, tuple(((0, r * c, c),) for r in range(cp_size)))


def cu_seqlens_from_document_ids(doc_ids: torch.Tensor) -> list[int]:
    """cu_seqlens of a packed sequence from its per-token document ids (a new document where the id changes)."""
    ids = doc_ids.reshape(-1)
    cuts = (torch.nonzero(ids[1:] != ids[:-1]).reshape(-1) + 1).tolist()
    return [0] + cuts + [ids.numel()]


def split_for_rank(x: torch.Tensor, rank: int, cp_size: int, dim: int = 0,
                   layout: Optional[CPLayout] = None) -> torch.Tensor:
    """The tokens of the full-sequence ``x`` (sequence along ``dim``) that ``rank`` holds (zigzag by default)."""
    layout = layout or zigzag_layout(x.size(dim), cp_size)
    return x.index_select(dim, layout.positions(rank).to(x.device))


def gather_from_ranks(parts: Sequence[torch.Tensor], dim: int = 0, layout: Optional[CPLayout] = None) -> torch.Tensor:
    """Inverse of :func:`split_for_rank`: the full sequence from every rank's part, in rank order."""
    layout = layout or zigzag_layout(sum(p.size(dim) for p in parts), len(parts))
    index = torch.cat([layout.positions(r) for r in range(len(parts))]).to(parts[0].device)
    out = torch.empty_like(torch.cat(list(parts), dim))
    return out.index_copy_(dim, index, torch.cat(list(parts), dim))


def _offsets(runs: Sequence[Run]) -> list[int]:
    out, at = [], 0
    for _, _, n in runs:
        out.append(at)
        at += n
    return out


def _diagonal_blocks(runs: Sequence[Run]) -> list[Block]:
    """A rank's own tokens: one causal block per document (its runs are in increasing global order)."""
    blocks, offs = [], _offsets(runs)
    for i, (doc, start, n) in enumerate(runs):
        last = blocks[-1] if blocks else None
        if last and runs[i - 1][0] == doc and runs[i - 1][1] < start and last.q_hi == offs[i]:
            blocks[-1] = Block(last.q_lo, offs[i] + n, last.k_lo, offs[i] + n, True)
        else:
            blocks.append(Block(offs[i], offs[i] + n, offs[i], offs[i] + n, True))
    return blocks


def _visible(qrun: Run, krun: Run) -> bool:
    """Whether every key of ``krun`` is visible to every query of ``qrun`` (False: none is)."""
    (qd, qs, qn), (kd, ks, kn) = qrun, krun
    if qd != kd or ks >= qs + qn:
        return False
    if ks + kn <= qs:
        return True
    raise ValueError(f"key run {krun} partly overlaps query run {qrun}: layouts must be cut on one chunk grid")


def plan_blocks(q_runs: Sequence[Run], k_runs: Sequence[Run], window: Optional[int] = None) -> Sequence[Block]:
    """The dense blocks a rank holding ``q_runs`` computes against a key/value block holding ``k_runs``
    under the causal (per-document) mask: nothing fully masked, neighbouring blocks merged; a run on
    both sides (keys gathered from every rank) is a causal block. ``window``: a query at position i
    also sees no key before i - window (sliding-window attention, :func:`windowed_blocks`)."""
    if window is not None:
        return windowed_blocks(tuple(q_runs), tuple(k_runs), window)
    if tuple(q_runs) == tuple(k_runs):
        return _diagonal_blocks(q_runs)
    q_off, k_off = _offsets(q_runs), _offsets(k_runs)
    rows: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []  # (q_lo, q_hi, key ranges)
    diagonal: list[Block] = []  # the same tokens on both sides (all keys gathered): causal blocks
    for qi, qrun in enumerate(q_runs):
        ranges: list[tuple[int, int]] = []
        for ki, krun in enumerate(k_runs):
            if krun == qrun:
                diagonal.append(Block(q_off[qi], q_off[qi] + qrun[2], k_off[ki], k_off[ki] + krun[2], True))
            elif _visible(qrun, krun):
                lo, hi = k_off[ki], k_off[ki] + krun[2]
                if ranges and ranges[-1][1] == lo:  # adjacent in storage: one wider block
                    ranges[-1] = (ranges[-1][0], hi)
                else:
                    ranges.append((lo, hi))
        q_lo, q_hi = q_off[qi], q_off[qi] + qrun[2]
        if rows and rows[-1][1] == q_lo and rows[-1][2] == tuple(ranges):
            rows[-1] = (rows[-1][0], q_hi, rows[-1][2])
        else:
            rows.append((q_lo, q_hi, tuple(ranges)))
    return [Block(q_lo, q_hi, k_lo, k_hi, False) for q_lo, q_hi, ranges in rows for k_lo, k_hi in ranges] + diagonal


def _on_grid(runs: Sequence[Run], cell: int) -> list[tuple[int, int, int, int]]:
    """``runs`` cut at the global multiples of ``cell``: (document, global start, length, storage offset)."""
    out = []
    for (doc, start, n), off in zip(runs, _offsets(runs)):
        at = start
        while at < start + n:
            end = min(start + n, (at // cell + 1) * cell)
            out.append((doc, at, end - at, off + at - start))
            at = end
    return out


@functools.lru_cache(maxsize=4096)
def windowed_blocks(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], window: int) -> tuple[Block, ...]:
    """:func:`plan_blocks` under a sliding window: a query at i sees the keys i - window .. i of its document.
    Both sides are cut on a grid of ``window + 1`` positions, so a cell against itself is a causal block
    inside the window, a cell against an earlier one is visible whole, cut by the window's edge (``band``)
    or not at all; only the cells the window reaches are computed, so the work grows with the window,
    not with the sequence. Fully visible blocks adjacent in storage are merged."""
    if window < 0:
        raise ValueError(f"a sliding window reaches back {window} keys; it must be >= 0")
    blocks: list[Block] = []
    for qd, q0, qn, qo in _on_grid(q_runs, window + 1):
        for kd, k0, kn, ko in _on_grid(k_runs, window + 1):
            if qd != kd or k0 >= q0 + qn or q0 - (k0 + kn - 1) > window:
                continue  # another document, keys after the queries, or every key beyond the window
            if (k0, kn) == (q0, qn):
                blocks.append(Block(qo, qo + qn, ko, ko + kn, True))
                continue
            if k0 + kn > q0:
                raise ValueError(f"key cells ({k0}, {kn}) and query cells ({q0}, {qn}) partly overlap: "
                                 "layouts must be cut on one chunk grid")
            if q0 + qn - 1 - k0 > window:  # the window's edge crosses the block
                blocks += _split_band(Block(qo, qo + qn, ko, ko + kn, False, q0 - k0 - window))
                continue
            last = blocks[-1] if blocks else None
            if (last is not None and not last.causal and last.band is None
                    and (last.q_lo, last.q_hi, last.k_hi) == (qo, qo + qn, ko)):
                blocks[-1] = Block(qo, qo + qn, last.k_lo, ko + kn, False)
            else:
                blocks.append(Block(qo, qo + qn, ko, ko + kn, False))
    return tuple(blocks)


BAND_LEAF = 64  # rows and columns at which a block cut by a window's edge goes to the math kernel whole


def _split_band(blk: Block) -> list[Block]:
    """``blk`` (a window's edge: column j masked for row i when j < i + band) as the fully visible blocks the
    fast kernels compute and small edge blocks along the edge line: halves of the longer side, recursively."""
    n, m, band = blk.q_hi - blk.q_lo, blk.k_hi - blk.k_lo, blk.band
    if m - 1 < band:
        return []  # every column left of the edge
    if band <= -(n - 1):
        return [Block(blk.q_lo, blk.q_hi, blk.k_lo, blk.k_hi, False)]  # every column right of it
    if max(n, m) <= BAND_LEAF:
        return [blk]
    if n >= m:
        half = n // 2
        return (_split_band(Block(blk.q_lo, blk.q_lo + half, blk.k_lo, blk.k_hi, False, band))
                + _split_band(Block(blk.q_lo + half, blk.q_hi, blk.k_lo, blk.k_hi, False, band + half)))
    half = m // 2
    return (_split_band(Block(blk.q_lo, blk.q_hi, blk.k_lo, blk.k_lo + half, False, band))
            + _split_band(Block(blk.q_lo, blk.q_hi, blk.k_lo + half, blk.k_hi, False, band - half)))


def work_per_rank(layout: CPLayout, window: Optional[int] = None) -> list[int]:
    """Query-key pairs each rank computes over the whole ring (the blocks of :func:`plan_blocks`)."""
    p = layout.cp_size
    return [sum(b.pairs for j in range(p) for b in plan_blocks(layout.runs[r], layout.runs[j], window))
            for r in range(p)]
