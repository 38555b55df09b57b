"""Position-keyed hidden dropout: the mask of an element depends on (sample, token index, feature, site)
only, so any split of the rows or the batch sees the same bits; statistics of a fair coin; backward
applies the forward's mask."""

from __future__ import annotations

import pytest
import torch

from megazero.model.attention.cp.layout import zigzag_layout
from megazero.model.keyed_dropout import DropoutKey, keyed_dropout, keyed_mask, sample_keys

P = 0.1


def _key(ids, rows) -> DropoutKey:
    return DropoutKey(samples=sample_keys(11, torch.as_tensor(ids)), rows=torch.as_tensor(rows))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_masks_of_context_parallel_ranks_are_the_rows_of_the_whole_sequence(cp):
    seq, features = 64, 48
    whole = keyed_mask(_key([5, 9], range(seq)), site=3, features=features, p=P)
    layout = zigzag_layout(seq, cp)
    for rank in range(cp):
        rows = layout.positions(rank)
        assert torch.equal(keyed_mask(_key([5, 9], rows), 3, features, P), whole[torch.as_tensor(rows)])
        # sequence parallelism slices those rows again; data parallelism the samples
        half = rows[len(rows) // 2:]
        assert torch.equal(keyed_mask(_key([9], half), 3, features, P), whole[torch.as_tensor(half)][:, 1:])


def test_sites_samples_and_seeds_draw_different_masks():
    base = keyed_mask(_key([0], range(32)), 1, 64, P)
    for other in (keyed_mask(_key([0], range(32)), 2, 64, P), keyed_mask(_key([1], range(32)), 1, 64, P),
                  keyed_mask(DropoutKey(sample_keys(12, torch.tensor([0])), torch.arange(32)), 1, 64, P)):
        assert 0.75 < (other == base).float().mean() < 0.9  # independent coins agree 0.82 of the time


def test_drop_rate_and_independence():
    m = keyed_mask(_key(range(4), range(512)), 7, 1024, P).float()
    n = m.numel()
    assert abs(m.mean().item() - (1 - P)) < 4 * (P * (1 - P) / n) ** 0.5
    for a, b in ((m[:, :, :-1], m[:, :, 1:]), (m[:-1], m[1:]), (m[:, :-1], m[:, 1:])):
        corr = ((a - a.mean()) * (b - b.mean())).mean() / a.var()
        assert abs(corr.item()) < 0.01, corr


def test_backward_applies_the_forward_mask_and_scale():
    x = torch.randn(16, 2, 8, dtype=torch.float64, requires_grad=True)
    key = _key([3, 4], range(100, 116))
    y = keyed_dropout(x, P, key, site=1)
    mask = keyed_mask(key, 1, 8, P).double() / (1 - P)
    assert torch.equal(y, x * mask)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, g * mask)


def test_shapes_disagreeing_with_the_key_are_refused():
    with pytest.raises(ValueError, match="16 rows and 2 samples"):
        keyed_dropout(torch.zeros(8, 2, 4), P, _key([0, 1], range(16)), 0)
