"""Hierarchical context parallelism (a2a+p2p): all-to-all over heads inside groups of A ranks, the ring
across the P groups, against one-process attention of the whole sequence (fp32 within 1e-6 / 1e-5,
fp64 within 1e-12), with GQA (KV heads split and replicated) and per-sample packed documents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero.model.attention.cp.hierarchical import Hierarchy, hierarchical_attention
from megazero.model.attention.cp.layout import split_for_rank, zigzag_layout
from megazero.mpu import group_ranks
from megazero.mpu.cp_exchange import CommCounter
from tests.distributed import run_distributed
from tests.model.test_ring_attention import _allowed, _error, _reference

B, HEADS, D = 2, 4, 16
DOCS = ([0, 9, 30, 31, 64], [0, 50, 64])  # each sample its own packed documents (any lengths)


def _groups(cp: int, a2a: int):
    lines = group_ranks(cp, 1, 1, cp, (a2a, cp // a2a))
    made = {kind: [dist.new_group(line) for line in lines[kind]] for kind in ("hcp_a2a", "hcp_p2p")}
    rank = dist.get_rank()
    return [next(g for g, line in zip(made[kind], lines[kind]) if rank in line) for kind in ("hcp_a2a", "hcp_p2p")]


def _case(a2a: int, groups: int, dtype, documents: bool):
    cp, rank = dist.get_world_size(), dist.get_rank()
    inner, outer = _groups(cp, a2a)
    seq = 64
    g = torch.Generator().manual_seed(groups)
    q, k, v = (torch.randn(seq, B, n, D, generator=g, dtype=dtype).requires_grad_() for n in (HEADS, groups, groups))
    grad = torch.randn(seq, B, HEADS * D, generator=g, dtype=dtype)
    if documents:
        ref = torch.cat([_reference(*(t[:, i:i + 1] for t in (q, k, v)), _allowed(seq, cu), dtype)
                         for i, cu in enumerate(DOCS)], dim=1)
    else:
        ref = _reference(q, k, v, _allowed(seq, None), dtype)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    hierarchy = Hierarchy.build(seq, a2a, cp // a2a, inner, outer)
    if documents:
        hierarchy = hierarchy.with_documents(DOCS)
    local = [split_for_rank(t.detach(), rank, cp).requires_grad_() for t in (q, k, v)]
    counter = CommCounter()
    out = hierarchical_attention(*local, hierarchy, counter=counter)
    got = torch.autograd.grad(out, local, split_for_rank(grad, rank, cp))
    tol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-6, 1e-5)
    _error(out, split_for_rank(ref.detach(), rank, cp), "output", tol[0], 0.0)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        _error(a, split_for_rank(b, rank, cp), name, tol[1], 0.0)
    return counter.elements_sent["forward"]


@pytest.mark.parametrize("world,a2a", [(4, 2), (8, 2), (8, 4)])
def test_hierarchical_equals_one_process(world, a2a):
    for groups in (HEADS, 2, 1):  # KV heads split over the all-to-all (4, 2 at a2a 2) or replicated
        if groups % a2a and a2a % groups:
            continue
        for documents in (False, True):
            run_distributed(world, _case, a2a, groups, torch.float32, documents)
    run_distributed(world, _case, a2a, 2, torch.float64, True)


def test_placement_is_the_ring_layout_of_the_all_to_all_groups():
    """The all-to-all group of ring rank o holds, between them, ring rank o's zigzag chunks of 2P."""
    seq, a2a, p2p = 96, 2, 3
    cp = a2a * p2p
    h = Hierarchy.build(seq, a2a, p2p, None, None)
    fine, coarse = zigzag_layout(seq, cp), zigzag_layout(seq, p2p)
    for o in range(p2p):
        gathered = torch.cat([fine.positions(o * a2a + i) for i in range(a2a)])
        assert torch.equal(gathered[h.order], coarse.positions(o))
        assert torch.equal(gathered[h.order][h.inverse], gathered)
