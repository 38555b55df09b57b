"""Context-parallel attention (``a2a`` and ``allgather``) against one-process ``core_attention``.

Every rank builds the same global q/k/v/grad-output from one seed, keeps the rows its layout gives
it (contiguous chunks, the balanced zigzag of 2P chunks, or a random permutation), and compares its
output and gradients with the matching rows of the one-process run: ``torch.equal`` for a2a,
tolerances for allgather. The bytes each call moves are checked against the closed-form volumes.
"""

from __future__ import annotations

import pytest
import torch

from megazero.model.attention.core import core_attention
from megazero.model.attention.cp.exchanges import (SequenceShard, a2a_attention, a2a_elements, a2a_head_split,
                                         allgather_attention, allgather_elements)
from megazero.mpu.cp_exchange import CommCounter
from tests.distributed import run_distributed

S, B, HEADS, D = 64, 2, 4, 16


def layout_positions(layout: str, seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global indices of the tokens ``rank`` holds."""
    if layout == "contiguous":
        n = seq // cp
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "zigzag":  # chunks r and 2P-1-r of 2P: balanced causal work
        c = seq // (2 * cp)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    if layout == "random":  # any permutation, the same on every rank
        perm = torch.randperm(seq, generator=torch.Generator().manual_seed(7))
        n = seq // cp
        return perm[rank * n:(rank + 1) * n]
    raise ValueError(layout)


def document_mask(seq: int, batch: int, seed: int = 3) -> torch.Tensor:
    """``[b, 1, S, S]``, True across packed documents (a different packing per sample)."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(batch):
        cuts = torch.zeros(seq, dtype=torch.long)
        cuts[torch.randperm(seq - 1, generator=g)[:4] + 1] = 1  # five documents
        ids.append(torch.cumsum(cuts, 0))
    ids = torch.stack(ids)
    return (ids[:, None, :, None] != ids[:, None, None, :])


def _inputs(groups: int, dtype=torch.float32, seq: int = S, dv: int = D):
    """q, k at width D, v (and the output) at ``dv``."""
    g = torch.Generator().manual_seed(11 + groups)
    q = torch.randn(seq, B, HEADS, D, generator=g, dtype=dtype)
    k = torch.randn(seq, B, groups, D, generator=g, dtype=dtype)
    v = torch.randn(seq, B, groups, dv, generator=g, dtype=dtype)
    go = torch.randn(seq, B, HEADS * dv, generator=g, dtype=dtype)
    return q, k, v, go


def _reference(q, k, v, go, backend, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = core_attention(q, k, v, backend=backend, attention_mask=mask)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_run(fn, q, k, v, go, pos, backend, mask, counter, layout=None, cp=None):
    shard = SequenceShard.gather(pos, None)
    if layout is not None:  # computed from the layout alone, the shard is the same without communication
        rank = torch.distributed.get_rank()
        alone = SequenceShard.from_rank_positions([layout_positions(layout, S, cp, r) for r in range(cp)], rank)
        assert alone.is_identity == shard.is_identity == (layout == "contiguous")
        assert all(torch.equal(getattr(alone, f), getattr(shard, f)) for f in ("positions", "all_positions", "order"))
    ql, kl, vl = (t[pos].clone().requires_grad_() for t in (q, k, v))
    out = fn(ql, kl, vl, shard, None, backend=backend, attention_mask=mask, counter=counter)
    out.backward(go[pos])
    return out.detach(), ql.grad, kl.grad, vl.grad


def _masks(kind: str):
    if kind == "causal":
        return None
    docs = document_mask(S, B)
    return docs if kind == "documents" else docs[0, 0]  # "documents-2d": one packing for the batch, [S, S]


def a2a_cases(cp: int) -> list[tuple]:
    """(groups, mask kind, backend, layout, dtype, value width): every GQA shape, mask and layout on sdpa;
    the math backend, the [S, S] mask, bf16 and value heads narrower and wider than D on the zigzag layout."""
    cases = [(g, m, "sdpa", lay, torch.float32, D) for g in (4, 2, 1) for m in ("causal", "documents")
             for lay in ("contiguous", "zigzag", "random")]
    cases += [(g, m, "math", "zigzag", torch.float32, D) for g in (4, 1) for m in ("causal", "documents")]
    cases += [(2, "documents-2d", "sdpa", "zigzag", torch.float32, D),
              (1, "documents", "sdpa", "zigzag", torch.bfloat16, D)]
    cases += [(2, "documents", "sdpa", "zigzag", torch.float32, 8), (1, "causal", "math", "zigzag", torch.float32, 40)]
    return cases


def _a2a_cases(cp: int, cases):
    rank = torch.distributed.get_rank()
    for groups, mask_kind, backend, layout, dtype, dv in cases:
        q, k, v, go = _inputs(groups, dtype, dv=dv)
        mask = _masks(mask_kind)
        ref = _reference(q, k, v, go, backend, mask)
        pos = layout_positions(layout, S, cp, rank)
        counter = CommCounter()
        got = _cp_run(a2a_attention, q, k, v, go, pos, backend, mask, counter, layout, cp)
        for name, r, g in zip(("out", "dq", "dk", "dv"), ref, got):
            assert torch.equal(g, r[pos]), (name, groups, mask_kind, backend, layout, dtype,
                                            (g - r[pos]).abs().max().item())
        split = groups % cp == 0
        kv_fwd, kv_bwd = (groups, groups) if split else (cp, HEADS)
        # the research formula S (a + g) (d + dv) (P-1) / P^2 (2 d for dv = d), per sequence of the batch
        assert counter.elements_sent["forward"] == B * S * (HEADS + kv_fwd) * (D + dv) * (cp - 1) // cp ** 2
        assert counter.elements_sent["backward"] == B * S * (HEADS + kv_bwd) * (D + dv) * (cp - 1) // cp ** 2
        assert counter.elements_sent["forward"] == a2a_elements(S, HEADS, groups, D, cp, B, v_head_dim=dv)
        assert counter.elements_sent["backward"] == a2a_elements(S, HEADS, groups, D, cp, B, phase="backward",
                                                                 v_head_dim=dv)
        assert counter.elements_received == counter.elements_sent
        assert counter.bytes_sent["forward"] == q.element_size() * counter.elements_sent["forward"]
        assert counter.calls == {"forward": 4, "backward": 4}
    return len(cases)


def _allgather_cases(cp: int, groups_list, layouts, backends):
    rank = torch.distributed.get_rank()
    worst = dict.fromkeys(("out", "dq", "dk", "dv"), 0.0)
    for groups in groups_list:
        q, k, v, go = _inputs(groups)
        for mask_kind in ("causal", "documents", "documents-2d"):
            mask = _masks(mask_kind)
            for backend in backends:
                ref = _reference(q, k, v, go, backend, mask)
                for layout in layouts:
                    pos = layout_positions(layout, S, cp, rank)
                    counter = CommCounter()
                    got = _cp_run(allgather_attention, q, k, v, go, pos, backend, mask, counter)
                    errs = [(g - r[pos]).abs().max().item() for r, g in zip(ref, got)]
                    assert errs[0] <= 1e-6 and max(errs[1:]) <= 1e-5, (groups, mask_kind, backend, layout, errs)
                    worst = {name: max(worst[name], e) for name, e in zip(worst, errs)}
                    volume = B * 2 * S * groups * D * (cp - 1) // cp  # 2 S g d (P-1) / P per sequence
                    assert counter.elements_received["forward"] == volume == allgather_elements(S, groups, D, cp, B)
                    assert counter.elements_received["backward"] == volume
                    assert counter.calls == {"forward": 2, "backward": 2}
    return worst


@pytest.mark.parametrize("cp", [2, 4])
def test_a2a_is_bit_identical_to_one_process(cp):
    """Outputs and dq/dk/dv equal (torch.equal) the one-process rows: GQA groups 4/2/1 (KV heads split
    and replicated), causal and packed documents, contiguous/zigzag/random layouts, sdpa and math, bf16."""
    cases = a2a_cases(cp)
    assert run_distributed(cp, _a2a_cases, cp, cases) == [len(cases)] * cp


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_matches_one_process(cp):
    """Output within 1e-6 and gradients within 1e-5 of one-process core_attention (fp32)."""
    worst = run_distributed(cp, _allgather_cases, cp, (4, 2, 1), ("contiguous", "zigzag", "random"), ("sdpa", "math"))
    assert all(w["out"] <= 1e-6 and max(w["dq"], w["dk"], w["dv"]) <= 1e-5 for w in worst)


def _exact_reference(q, k, v, go):
    """Causal GQA attention by the formula in the inputs' dtype (core_attention's math softmax is fp32)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(HEADS // t.size(1), dim=1) for t in (kt, vt))
    scores = (qt @ kt.transpose(-1, -2)) / D ** 0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu_(1), float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ vt).permute(2, 0, 1, 3).reshape(S, B, HEADS * D)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def _allgather_block_cases(cp: int):
    """The causal case given the layout: the ring's block kernels, no mask (contiguous and zigzag)."""
    from megazero.model.attention.cp.layout import contiguous_layout, zigzag_layout

    rank, worst = torch.distributed.get_rank(), 0.0
    for groups in (4, 2, 1):
        for dtype, tol in ((torch.float32, (1e-6, 1e-5)), (torch.float64, (1e-12, 1e-12))):
            q, k, v, go = _inputs(groups, dtype)
            ref = _reference(q, k, v, go, "math", None) if dtype == torch.float32 else _exact_reference(q, k, v, go)
            for name, layout in (("contiguous", contiguous_layout(S, cp)), ("zigzag", zigzag_layout(S, cp))):
                pos = layout_positions(name, S, cp, rank)
                shard = SequenceShard.gather(pos, None)
                ql, kl, vl = (t[pos].clone().requires_grad_() for t in (q, k, v))
                counter = CommCounter()
                out = allgather_attention(ql, kl, vl, shard, None, counter=counter, layout=layout)
                out.backward(go[pos])
                errs = [(g - r[pos]).abs().max().item() for r, g in zip(ref, (out, ql.grad, kl.grad, vl.grad))]
                assert errs[0] <= tol[0] and max(errs[1:]) <= tol[1], (groups, dtype, name, errs)
                assert counter.elements_received["forward"] == allgather_elements(S, groups, D, cp, B)
                worst = max(worst, errs[0])
    return worst


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_with_its_layout_runs_the_block_kernels(cp):
    """Given the layout, each chunk attends to the gathered keys through flash blocks merged by LSE:
    fp32 within 1e-6 (output) / 1e-5 (gradients), fp64 within 1e-12, of one-process attention."""
    assert all(w <= 1e-6 for w in run_distributed(cp, _allgather_block_cases, cp))


def _refusals(cp):
    rank = torch.distributed.get_rank()
    q = torch.randn(S // cp, B, 6, D)
    k = v = torch.randn(S // cp, B, 3, D)
    shard = SequenceShard.gather(layout_positions("zigzag", S, cp, rank), None)
    with pytest.raises(ValueError, match="3 KV groups divisible by the context parallel size 2"):
        a2a_attention(q, k, v, shard, None)
    with pytest.raises(ValueError, match="cover 0..63 exactly once"):
        SequenceShard.gather(torch.arange(S // cp), None)  # every rank claims the same tokens
    with pytest.raises(ValueError, match="the same number of tokens"):
        SequenceShard.from_rank_positions([torch.arange(3), torch.arange(3, 8)], 0)
    with pytest.raises(ValueError, match="shard names"):
        a2a_attention(q[:4], k[:4], v[:4], shard, None)
    with pytest.raises(ValueError, match=r"must cover the global sequence, \[b, 1, 64, 64\]"):
        allgather_attention(q, k, v, shard, None, attention_mask=torch.zeros(S // cp, S, dtype=torch.bool))
    return True


def test_refusals_name_the_numbers():
    assert run_distributed(2, _refusals, 2) == [True, True]
    with pytest.raises(ValueError, match="6 query heads over 4 ranks"):
        a2a_head_split(6, 3, 4)
    assert a2a_head_split(4, 4, 2) == "split" and a2a_head_split(4, 1, 4) == "replicate"


def test_one_rank_is_core_attention():
    """Without a CP group (one process) both functions are core_attention."""
    q, k, v, go = _inputs(2)
    shard = SequenceShard.gather(torch.arange(S), None)
    for fn in (a2a_attention, allgather_attention):
        got = _reference_fn(fn, q, k, v, go, shard)
        ref = _reference(q, k, v, go, "sdpa", None)
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
    assert a2a_elements(S, HEADS, 2, D, 1) == 0 == allgather_elements(S, 2, D, 1)


def _reference_fn(fn, q, k, v, go, shard):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, shard, None, backend="sdpa")
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad
