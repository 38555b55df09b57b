"""A counter-based normal generator: any slice of a parameter can be drawn without the rest.

The full (tp=1) tensor, viewed as ``[rows, cols]`` (``cols`` = its last dimension),
is cut into chunks of at most ``W`` columns of one row. Chunk ``c`` of the
parameter with key ``k`` holds ``torch.randn(width, generator=seeded(mix(k, c)))``.
So a value depends only on (seed, parameter name, position): a rank draws the
chunks its TP shard and ZeRO partition touch, and the result is the same at any
tp x dp x stage. ``W`` is a power-of-two divisor of ``cols`` where one exists, so
that column shards (row-parallel weights) start on chunk boundaries and a rank
draws little it does not keep.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["param_key", "chunk_width", "normal_at"]

_MASK = (1 << 64) - 1
_MAX_W = 4096


def _mix(x: int) -> int:
    """splitmix64's finalizer: consecutive counters give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def param_key(base_seed: int, name: str) -> int:
    """Stable across processes and Python versions (unlike ``hash``)."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return _mix(base_seed ^ digest)


def chunk_width(cols: int) -> int:
    w = cols & -cols  # largest power of two dividing cols
    if w >= 256:
        return min(w, _MAX_W)
    return min(cols, _MAX_W)


def normal_at(key: int, cols: int, fidx: torch.Tensor, std: float, mean: float = 0.0) -> torch.Tensor:
    """Values at the full flat indices ``fidx`` (non-decreasing; each row's indices contiguous),
    drawing only the chunks they touch. fp32, CPU."""
    out = torch.empty(fidx.numel(), dtype=torch.float32)
    if fidx.numel() == 0:
        return out
    w = chunk_width(cols)
    per_row = -(-cols // w)
    row, col = fidx // cols, fidx % cols
    chunk = row * per_row + col // w
    ids, counts = torch.unique_consecutive(chunk, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    g = torch.Generator()
    pos = 0
    for c, n, s in zip(ids.tolist(), counts.tolist(), starts.tolist()):
        j = c % per_row
        width = min(w, cols - j * w)
        off = int(col[s]) - j * w
        g.manual_seed(_mix(key ^ _mix(c)) >> 1)
        vals = torch.randn(width, generator=g)
        out[pos:pos + n] = vals[off:off + n]
        pos += n
    if std != 1.0:
        out.mul_(std)
    if mean:
        out.add_(mean)
    return out
