"""Running a recurrent layer over this rank's tokens: the short convolution and the scan, with packed documents
and context parallelism that passes state.

A rank holds its tokens as *runs* of consecutive global positions (one run without context parallelism; two
under the balanced zigzag layout, chunks r and 2P-1-r). Both parts work run by run:

* :func:`short_convolution` (the causal depthwise convolution of width K before Gated DeltaNet's and Mamba-2's
  scans) needs the K-1 tokens before each run: the ranks all-gather every run's last K-1 inputs (and their
  document starts), a payload of (K-1) x channels per run whatever the sequence length. A tap reaches back only
  inside its token's document.
* :func:`recurrent_scan` runs each run from a zero state to its *summary*: the state it leaves (S_ext) and the
  affine map it applies to the state entering it (M: S_out = M . S_in + S_ext; zero when a document starts
  inside). The ranks all-gather the summaries (a state and a transition per run and head, independent of the
  sequence length), every rank folds the ones before each of its runs in global order in fp32, and runs its
  runs again from the states so found. Backward flows through the gather (a reduce-scatter).

Megatron's scheme is the alternative (:class:`HeadsExchange`, ``linear_cp_comm_type='a2a'``): an all-to-all gives
each rank the whole sequence for 1/P of the heads, which run as without context parallelism, and another takes
the output back; it moves activations that grow with the sequence and needs the heads divisible by P.

A scan is described by a :class:`Scan`: the chunked kernel, its transition and how a transition acts on a
state; ``recurrent/delta_rule.py`` (Gated DeltaNet) and ``recurrent/ssd.py`` (Mamba-2) provide them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

import dataclasses

from megazero.mpu.cp_exchange import (all_gather_tensor, gather_sequence, heads_to_seq_all_to_all,
                                      seq_to_heads_all_to_all)

from ..forward_context import ForwardContext

__all__ = ["Scan", "delta_scan", "Runs", "local_runs", "short_convolution", "recurrent_scan", "HeadsExchange"]


@dataclass(frozen=True)
class Scan:
    """``run(*inputs, initial_state=, starts=) -> (out, final_state)``; ``transition(*inputs, starts=) -> M``;
    ``carry(M, S) -> M . S`` (the state a run leaves when ``S`` enters it, less its own S_ext)."""

    run: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    transition: Callable[..., torch.Tensor]
    carry: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def delta_scan(rule: Callable[..., tuple[torch.Tensor, torch.Tensor]],
               transition: Callable[..., torch.Tensor]) -> Scan:
    """The :class:`Scan` of a delta rule over inputs ``(q, k, v, g, beta)`` (Gated DeltaNet's, Kimi Delta
    Attention's): ``rule(q, k, v, g, beta, initial_state=, starts=)``, ``transition(k, g, beta, starts=)``; the
    state [dk, dv] of each head leaves a run as M @ S_in + S_ext, M [dk, dk]."""
    def run(q, k, v, g, beta, *, initial_state, starts):
        return rule(q, k, v, g, beta, initial_state=initial_state, starts=starts)

    def transition_of(q, k, v, g, beta, *, starts):
        return transition(k, g, beta, starts=starts)

    return Scan(run=run, transition=transition_of, carry=torch.matmul)


@dataclass(frozen=True)
class Runs:
    """This rank's tokens as runs: ``local[i] = (offset, length)`` in storage order, ``starts[i]`` the run's
    first global position; ``order`` every rank's runs ``(rank, index on that rank, global start, length)``
    sorted by global start (identical on every rank); ``rank`` this rank's index in the CP group; ``slots`` the
    most runs any rank holds (what each rank contributes to a gather, padded with zeros)."""

    local: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]
    order: tuple[tuple[int, int, int, int], ...]
    rank: int
    slots: int = 1

    @property
    def per_rank(self) -> int:
        return len(self.local)

    def row(self, rank: int, index: int) -> int:
        """Where run ``index`` of ``rank`` sits in a gather of every rank's ``slots`` rows."""
        return rank * self.slots + index

    def padded(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """This rank's ``rows`` stacked and padded with zeros to ``slots`` (for a gather of equal shares)."""
        pad = [torch.zeros_like(rows[0])] * (self.slots - len(rows))
        return torch.stack(rows + pad)


def local_runs(context: ForwardContext, length: int) -> Runs:
    """The runs of this rank's ``length`` tokens: one (the whole sequence) without context parallelism, else
    the context's layout with consecutive runs of a rank merged."""
    cp = context.cp
    if cp is None or cp.layout is None or cp.layout.cp_size == 1:
        return Runs(((0, length),), (0,), ((0, 0, 0, length),), 0)
    if cp.sample_layouts is not None and cp.sample_positions is not None:
        raise ValueError("recurrent layers need one placement of the tokens for every sample: place packed "
                         "documents with the zigzag layout (ModelFace does when the model has recurrent layers)")
    per_rank = []
    for rank_runs in cp.layout.runs:
        merged: list[list[int]] = []
        for _, start, n in rank_runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += n
            else:
                merged.append([start, n])
        per_rank.append(merged)
    mine = per_rank[cp.rank]
    offsets, at = [], 0
    for start, n in mine:
        offsets.append((at, n))
        at += n
    order = sorted(((r, i, s, n) for r, runs in enumerate(per_rank) for i, (s, n) in enumerate(runs)),
                   key=lambda t: t[2])
    return Runs(tuple(offsets), tuple(s for s, _ in mine), tuple(order), cp.rank, max(len(r) for r in per_rank))


def _predecessors(runs: Runs) -> dict[tuple[int, int], Optional[tuple[int, int]]]:
    """(rank, index) of each run -> that of the run ending where it starts (None at the sequence's start)."""
    by_end = {s + n: (r, i) for r, i, s, n in runs.order}
    return {(r, i): by_end.get(s) for r, i, s, n in runs.order}


def short_convolution(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], context: ForwardContext,
                      *, runs: Optional[Runs] = None, activation: bool = True,
                      halo: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal depthwise convolution of this rank's tokens ``x`` ``[b, s_local, C]`` with ``weight`` ``[C, K]`` (tap
    K-1 is the token itself) and ``bias`` ``[C]``, then SiLU when ``activation``: ``[b, s_local, C]``. A tap
    that would reach before its token's document (``context.starts``) or before the sequence reads zero.
    ``halo`` ``[b, K-1, C]``: the inputs just before ``x`` (incremental decoding's cache; one run, no context
    parallelism), read by the taps that reach before ``x`` instead of zeros."""
    runs = runs or local_runs(context, x.size(1))
    k = weight.size(1)
    if halo is not None:
        if len(runs.order) != 1 or halo.shape != (x.size(0), k - 1, x.size(2)):
            raise ValueError(f"a given halo is the {k - 1} inputs before one run of tokens, [b, K-1, C] = "
                             f"{[x.size(0), k - 1, x.size(2)]}; got {list(halo.shape)} for {len(runs.order)} runs")
        halos, halo_starts = [halo], [None]
    else:
        halos, halo_starts = _halos(x, context, runs, k - 1)
    out = []
    for j, (off, n) in enumerate(runs.local):
        seg = x[:, off:off + n]
        starts = context.starts[:, off:off + n] if context.starts is not None else None
        out.append(_convolve(seg, halos[j], starts, halo_starts[j], weight, bias))
    y = out[0] if len(out) == 1 else torch.cat(out, dim=1)
    return torch.nn.functional.silu(y) if activation else y


def _convolve(x: torch.Tensor, halo: torch.Tensor, starts: Optional[torch.Tensor],
              halo_starts: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """One run: ``x`` ``[b, n, C]`` after its ``halo`` ``[b, K-1, C]``, each tap masked to its token's document.
    The taps are summed in one fixed order, so a token's output has the same bits whichever rank computes it."""
    b, n, _ = x.shape
    k = weight.size(1)
    padded = torch.cat([halo.to(x.dtype), x], dim=1)  # [b, n + K - 1, C]
    if starts is not None:
        hs = halo_starts if halo_starts is not None else torch.zeros(b, k - 1, dtype=torch.bool, device=x.device)
        seg = torch.cumsum(torch.cat([hs, starts], dim=1).to(torch.int32), dim=1)  # document index along padded
    y = x * weight[:, k - 1]
    for back in range(1, k):
        tap = padded[:, k - 1 - back:k - 1 - back + n] * weight[:, k - 1 - back]
        if starts is not None:
            same = (seg[:, k - 1 - back:k - 1 - back + n] == seg[:, k - 1:]).unsqueeze(-1)
            tap = tap * same
        y = y + tap
    return y + bias if bias is not None else y


def _halos(x: torch.Tensor, context: ForwardContext, runs: Runs, width: int):
    """The ``width`` inputs before each of this rank's runs (zeros at the sequence's start) and their document
    starts (None without documents), all-gathered from the runs that precede them."""
    b, _, c = x.shape
    zero = x.new_zeros(b, width, c)
    no_starts = [None] * runs.per_rank
    if width == 0:
        return [zero] * runs.per_rank, no_starts
    if len(runs.order) == 1:
        return [zero], no_starts
    for off, n in runs.local:
        if n < width:
            raise ValueError(f"a context-parallel run of {n} tokens is shorter than the convolution's reach "
                             f"({width}): use a longer sequence or a smaller context-parallel size")
    tails = runs.padded([x[:, off + n - width:off + n] for off, n in runs.local])  # [slots, b, width, C]
    cp = context.cp
    gathered = gather_sequence(tails, cp.group)  # [P * slots, b, width, C], rank-major
    tail_starts = None
    if context.starts is not None:
        st = runs.padded([context.starts[:, off + n - width:off + n].to(torch.uint8) for off, n in runs.local])
        tail_starts = all_gather_tensor(st, cp.group).bool()
    before = _predecessors(runs)
    halos, halo_starts = [], []
    for j in range(runs.per_rank):
        prev = before[(runs.rank, j)]
        if prev is None:
            halos.append(zero)
            halo_starts.append(None if tail_starts is None else torch.zeros(b, width, dtype=torch.bool,
                                                                             device=x.device))
            continue
        row = runs.row(*prev)
        halos.append(gathered[row])
        halo_starts.append(None if tail_starts is None else tail_starts[row])
    return halos, halo_starts


def recurrent_scan(scan: Scan, inputs: Sequence[torch.Tensor], context: ForwardContext,
                   runs: Optional[Runs] = None) -> torch.Tensor:
    """``scan`` over this rank's tokens: ``inputs`` each ``[b, s_local, ...]`` (storage order) -> its output
    ``[b, s_local, ...]``, each run started from the state the runs before it in the whole sequence leave
    (their summaries all-gathered over the context-parallel group and folded in global order)."""
    s_local = inputs[0].size(1)
    runs = runs or local_runs(context, s_local)

    def part(j: int) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
        off, n = runs.local[j]
        starts = context.starts[:, off:off + n] if context.starts is not None else None
        return [t[:, off:off + n] for t in inputs], starts

    if len(runs.order) == 1:
        ins, starts = part(0)
        return scan.run(*ins, initial_state=None, starts=starts)[0]
    finals, transitions, first_outs = [], [], []
    for j in range(runs.per_rank):
        ins, starts = part(j)
        out, final = scan.run(*ins, initial_state=None, starts=starts)
        first_outs.append(out)
        finals.append(final)
        transitions.append(scan.transition(*ins, starts=starts))
    # One gather of (S_ext, M) per run, so every rank runs the same collectives in backward: its reduce-scatter
    # is reached on every rank (all of a rank's summaries feed it), and before the halo's (upstream of it).
    f_shape, t_shape = finals[0].shape, transitions[0].shape
    rows = [torch.cat([f.reshape(-1), t.reshape(-1).to(f.dtype)]) for f, t in zip(finals, transitions)]
    summaries = gather_sequence(runs.padded(rows), context.cp.group)  # [P * slots, |S| + |M|] rank-major
    n = finals[0].numel()
    all_finals = summaries[:, :n].reshape(-1, *f_shape)
    all_transitions = summaries[:, n:].reshape(-1, *t_shape).to(transitions[0].dtype)
    entering = _fold(scan, runs, all_finals, all_transitions)
    outs = []
    for j in range(runs.per_rank):
        state = entering[j]
        if state is None:  # the sequence's first run: its zero-state output is the answer
            outs.append(first_outs[j])
            continue
        ins, starts = part(j)
        outs.append(scan.run(*ins, initial_state=state, starts=starts)[0])
    return torch.cat(outs, dim=1)


def _fold(scan: Scan, runs: Runs, finals: torch.Tensor, transitions: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """The state entering each of this rank's runs: the summaries of the runs before it folded in global order,
    S <- M_i . S + S_ext_i (None for the run at the sequence's start)."""
    state: Optional[torch.Tensor] = None
    entering: dict[int, Optional[torch.Tensor]] = {}
    for r, i, _, _ in runs.order:
        if r == runs.rank:
            entering[i] = state
        row = runs.row(r, i)
        state = finals[row] if state is None else scan.carry(transitions[row], state) + finals[row]
    return [entering[j] for j in range(runs.per_rank)]


@dataclass(frozen=True)
class HeadsExchange:
    """Megatron's context parallelism for these layers: :meth:`to_heads` gives this rank the whole sequence (in
    global order) for its 1/P of the heads, :attr:`context` is that view's (no CP; the documents' starts of the
    whole sequence), :meth:`to_sequence` takes an output back to this rank's tokens and every head."""

    cp: object
    context: ForwardContext
    size: int
    rank: int

    @classmethod
    def of(cls, context: ForwardContext) -> "HeadsExchange":
        cp = context.cp
        starts = context.starts
        if starts is not None:  # every token's, in global order
            every = all_gather_tensor(starts.t().contiguous().to(torch.uint8), cp.group)  # [S, b] rank-major
            starts = every[cp.shard.order].t().bool()
        size = cp.shard.all_positions.numel() // cp.shard.positions.numel()
        whole = dataclasses.replace(context, cp=None, starts=starts, attention_mask=None)
        return cls(cp, whole, size, cp.rank)

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s_local, n, d]`` -> ``[b, S, n / P, d]``: heads ``[rank n/P, (rank+1) n/P)`` in global order."""
        if t.size(2) % self.size:
            raise ValueError(f"the heads all-to-all splits {t.size(2)} heads over {self.size} context-parallel ranks: "
                             "they must divide; use linear_cp_comm_type='state_passing' (any number of heads)")
        x = seq_to_heads_all_to_all(t.transpose(0, 1), self.cp.group)  # [S, b, n/P, d] rank-major
        return x[self.cp.shard.order].transpose(0, 1)

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, S, n / P, d]`` (global order) -> ``[b, s_local, n, d]``: the inverse of :meth:`to_heads`."""
        x = t.transpose(0, 1)[self.cp.shard.all_positions]  # rank-major
        return heads_to_seq_all_to_all(x, self.cp.group).transpose(0, 1)
