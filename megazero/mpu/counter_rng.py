"""A counter-based normal generator: any slice of a parameter can be drawn without the rest.

The full (tp=1) tensor is cut into chunks; chunk ``c`` of the parameter with key
``k`` holds ``torch.randn(width, generator=seeded(mix(k, c)))``. So a value
depends only on (seed, parameter name, position): a rank draws the chunks its TP
shard and ZeRO partition touch, and the result is the same at any tp x dp x stage.

The chunking is a property of the parameter (never of the TP size): a tensor
sharded along its last dimension (row-parallel weights), viewed as ``[rows,
cols]``, has chunks of at most ``W`` columns of one row, ``W`` a power-of-two
divisor of ``cols`` where one exists, so that column shards start on chunk
boundaries; every other tensor is cut into chunks of ``FLAT_CHUNK`` consecutive
elements, whose few large draws cost about what one ``torch.randn`` does.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["param_key", "chunk_width", "normal_at", "FLAT_CHUNK"]

_MASK = (1 << 64) - 1
_MAX_W = 4096
FLAT_CHUNK = 1 << 16


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


def normal_at(key: int, cols: int, w: int, ranges: list[tuple[int, int]], std: float,
              mean: float = 0.0) -> torch.Tensor:
    """Values at the full flat index ranges ``[f0, f1)`` (in order, concatenated) of a tensor of
    rows of ``cols`` elements cut into chunks of ``w``, drawing only the chunks they touch. fp32, CPU."""
    total = sum(f1 - f0 for f0, f1 in ranges)
    out = torch.empty(total, dtype=torch.float32)
    per_row = -(-cols // w)
    g = torch.Generator()
    cached_id, cached = -1, None
    pos = 0
    for f0, f1 in ranges:
        at = f0
        while at < f1:
            row, col = divmod(at, cols)
            j = col // w
            end_col = min((j + 1) * w, cols)
            take = min(f1 - at, end_col - col)
            c = row * per_row + j
            width = end_col - j * w
            if take == width:  # a whole chunk: draw it in place
                g.manual_seed(_mix(key ^ _mix(c)) >> 1)
                torch.randn(width, generator=g, out=out[pos:pos + take])
            else:
                if c != cached_id:
                    g.manual_seed(_mix(key ^ _mix(c)) >> 1)
                    cached_id, cached = c, torch.randn(width, generator=g)
                out[pos:pos + take] = cached[col - j * w:col - j * w + take]
            pos += take
            at += take
    if std != 1.0:
        out.mul_(std)
    if mean:
        out.add_(mean)
    return out
