"""zero/flat.py's fill_range: the few-copies version equals a copy per row, for every range."""

import torch

from megazero.zero.flat import fill_range


def _per_row(rows, lo, hi, width, src):
    pos = lo
    while pos < hi:
        r, c = divmod(pos, width)
        n = min(hi - pos, width - c)
        dst = rows[r, c:c + n]
        dst.zero_() if src is None else dst.copy_(src[pos - lo:pos - lo + n])
        pos += n


def test_fill_range_equals_a_copy_per_row_for_every_range_in_a_column_block():
    for n, width in [(1, 7), (3, 5), (4, 8)]:
        bucket = torch.full((n, width + 3), -1.0)  # the block is columns 1..width of a wider bucket
        for lo in range(n * width + 1):
            for hi in range(lo, n * width + 1):
                for src in (torch.arange(hi - lo, dtype=torch.float32), None):
                    a, b = bucket.clone(), bucket.clone()
                    fill_range(a[:, 1:width + 1], lo, hi, width, src)
                    _per_row(b[:, 1:width + 1], lo, hi, width, src)
                    assert torch.equal(a, b), (n, width, lo, hi, src is None)
