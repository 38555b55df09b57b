"""Context-parallel layouts: which tokens each rank holds, refusals, and the work each rank computes."""

from __future__ import annotations

import pytest
import torch

from megazero.model.attention.cp.layout import (contiguous_layout, cu_seqlens_from_document_ids, document_layout,
                                      gather_from_ranks, plan_blocks, split_for_rank, work_per_rank, zigzag_layout)


def _doc_lengths(p: int) -> list[int]:
    """Four packed documents of unequal lengths, each a multiple of 2P: 32P tokens in all."""
    return [2 * p * n for n in (3, 5, 1, 7)]


def test_zigzag_split_and_gather_are_inverse():
    x = torch.arange(48).reshape(24, 2)
    parts = [split_for_rank(x, r, 3, 0) for r in range(3)]
    assert parts[0][:, 0].tolist() == [0, 2, 4, 6, 40, 42, 44, 46]  # chunks 0 and 5 of 6
    assert torch.equal(gather_from_ranks(parts, 0), x)
    assert zigzag_layout(24, 3).positions(1).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


def test_refusals_name_the_numbers():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2 x context-parallel size = 8.*32"):
        zigzag_layout(30, 4)
    with pytest.raises(ValueError, match=r"document 1 has 6 tokens.*multiple of 4"):
        document_layout([0, 8, 14, 16], 2)


def test_document_layout_from_document_ids():
    ids = torch.tensor([0] * 8 + [1] * 4 + [2] * 4)
    cu = cu_seqlens_from_document_ids(ids)
    assert cu == [0, 8, 12, 16]
    layout = document_layout(cu, 2)
    assert layout.positions(1).tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    assert layout.position_ids(1, cu).tolist() == [2, 3, 4, 5, 1, 2, 1, 2]
    x = torch.arange(16)
    assert torch.equal(gather_from_ranks([split_for_rank(x, r, 2, 0, layout) for r in range(2)], 0, layout), x)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_work_is_balanced(p):
    causal = work_per_rank(zigzag_layout(64 * p, p))
    assert max(causal) / (sum(causal) / p) <= 1.00
    cu = [0]
    for n in _doc_lengths(p):
        cu.append(cu[-1] + n)
    docs = work_per_rank(document_layout(cu, p))
    assert max(docs) / (sum(docs) / p) <= 1.05
    assert sum(docs) == sum(n * (n + 1) // 2 for n in _doc_lengths(p))
    unbalanced = work_per_rank(contiguous_layout(64 * p, p))  # the counter sees imbalance: ~ (2P-1)/P
    assert max(unbalanced) / (sum(unbalanced) / p) > 1.4


def test_plans_skip_masked_halves():
    layout = zigzag_layout(16, 2)  # rank 0: tokens 0-3, 12-15; rank 1: 4-11
    own, earlier, later = (plan_blocks(layout.runs[a], layout.runs[b]) for a, b in ((0, 0), (1, 0), (0, 1)))
    assert [(b.q_lo, b.q_hi, b.k_lo, b.k_hi, b.causal) for b in own] == [(0, 8, 0, 8, True)]
    assert [(b.q_lo, b.q_hi, b.k_lo, b.k_hi) for b in earlier] == [(0, 8, 0, 4)]  # all queries, first half of keys
    assert [(b.q_lo, b.q_hi, b.k_lo, b.k_hi) for b in later] == [(4, 8, 0, 8)]  # second half of queries, all keys
    assert plan_blocks(contiguous_layout(16, 2).runs[0], contiguous_layout(16, 2).runs[1]) == []
