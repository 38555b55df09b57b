"""Hidden dropout keyed by position: a mask that is a function of the sample, the token's place in the
sequence, the feature and the dropout site, never of how the batch is split over ranks.

torch's dropout draws a mask for the tensor a rank holds, in the order it holds it: split the sequence
over context-parallel ranks (or over tensor-parallel ranks by sequence parallelism, or the batch over
data-parallel ranks) and the masks change. Here element (token t of sample n, feature j) at site ``site``
is kept when ``hash(key_n, site, t, j)`` clears the threshold, where ``key_n`` is the sample's key
(:func:`sample_keys`: the run's seed and the sample's index in the dataset) and ``t`` the token's index in
the whole sequence. Any rank computes the mask of exactly the elements it holds, so cp 2 applies the
masks cp 1 does, bit for bit, and so does any tp x sp x pp x dp or micro-batch size. The mask is
recomputed in backward rather than saved. The hash is 32-bit integer arithmetic on int64 tensors, the
same bits on any device.

Attention dropout (:class:`AttentionDropout`) uses the same hash with (sample, global head) as the
sample, the query's index in the sequence as the row and the key's as the feature, at a site of its
own per layer: whichever rank holds a query (tensor parallelism splits the heads, context
parallelism the queries and keys, the all-to-all the heads again), it draws that element's bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DropoutKey", "AttentionDropout", "sample_keys", "keyed_mask", "keyed_dropout"]

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements hashed at a time: bounds the int64 temporaries to 32 MiB each
_THRESHOLD_BITS = 24
_ATTENTION_SITE = 1 << 30  # attention sites: this + layer, apart from hidden dropout's 0 .. 2L


def _mix32(x):
    """A 32-bit integer finalizer (Wellons' lowbias32) on an int or an int64 tensor holding values < 2^32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sample_keys(seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
    """``[b]`` int64 keys (< 2^32) of the samples with dataset indices ``sample_ids``, for the run's ``seed``;
    computed where ``sample_ids`` lives (no host copy)."""
    ids = sample_ids.to(torch.int64)
    return _mix32(_mix32((ids & _M32) ^ _mix32(seed & _M32)) ^ ((ids >> 32) & _M32) ^ _mix32((seed >> 32) & _M32))


@dataclass(frozen=True)
class DropoutKey:
    """What keys one forward's hidden-dropout masks: ``samples`` ``[b]`` the samples' keys
    (:func:`sample_keys`), ``rows`` ``[s_rows]`` (or ``[s_rows, b]`` when each sample's tokens sit
    differently) the index in the whole sequence of each row (dim 0) of the activations this rank
    holds (its context-parallel tokens, its sequence-parallel slice of them)."""

    samples: torch.Tensor
    rows: torch.Tensor


def _site_key(site: int) -> int:
    return _mix32((site * 0x9E3779B1 + 0x632BE5AB) & _M32)


def _row_keys(rows: torch.Tensor, samples: torch.Tensor, site: int) -> torch.Tensor:
    """``[s, n]`` keys of rows (indices in the sequence, ``[s]`` or ``[s, n]``) of the ``n`` samples at ``site``."""
    rows = _mix32((rows.to(torch.int64) & _M32) ^ _site_key(site))
    return _mix32((rows[:, None] if rows.dim() == 1 else rows) ^ samples[None, :])


def _col_keys(cols: torch.Tensor) -> torch.Tensor:
    return _mix32((cols.to(torch.int64) & _M32) ^ 0xB5297A4D)


def _threshold(p: float) -> int:
    return round(p * (1 << _THRESHOLD_BITS))


def _keep(row_keys: torch.Tensor, col_keys: torch.Tensor, threshold: int, out=None) -> torch.Tensor:
    """The keep bits of (row, column) pairs: ``row_keys`` broadcast against ``col_keys``."""
    return torch.ge(_mix32(row_keys ^ col_keys) >> (32 - _THRESHOLD_BITS), threshold, out=out)


def keyed_mask(key: DropoutKey, site: int, features: int, p: float) -> torch.Tensor:
    """The keep mask ``[s_rows, b, features]`` (bool) of dropout with probability ``p`` at ``site``."""
    row_keys = _row_keys(key.rows, key.samples, site)  # [s, b]
    cols = _col_keys(torch.arange(features, dtype=torch.int64, device=row_keys.device))  # [h]
    threshold = _threshold(p)
    s, b = row_keys.shape
    keep = torch.empty(s, b, features, dtype=torch.bool, device=row_keys.device)
    step = max(1, _CHUNK // max(1, b * features))
    for lo in range(0, s, step):
        _keep(row_keys[lo:lo + step, :, None], cols, threshold, out=keep[lo:lo + step])
    return keep


@dataclass(frozen=True)
class AttentionDropout:
    """Attention dropout with probability ``p`` keyed by position: element (sample n, head h, query i,
    key j) of layer ``layer`` is kept when ``hash(key_n, h, i, j, layer)`` clears the threshold, the
    hash of :func:`keyed_mask` with (sample, global head) as the sample and the key's index as the
    feature. ``samples`` ``[b]`` the samples' keys; ``heads`` ``[h]`` the global indices of the query
    heads held (tensor and context parallelism hold a slice of them); ``i``, ``j`` indices in the whole
    sequence, given per block by the caller (:meth:`keep`)."""

    p: float
    samples: torch.Tensor
    heads: torch.Tensor
    layer: int

    def select(self, samples: slice = slice(None), heads: Optional[slice] = None) -> "AttentionDropout":
        """The same dropout for a slice of the samples (and of the heads held)."""
        return AttentionDropout(self.p, self.samples[samples], self.heads if heads is None else self.heads[heads],
                                self.layer)

    def keep(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[b, h, n, m]`` (bool) keep mask of queries at positions ``queries`` ``[n]`` against keys at
        ``keys`` ``[m]``; blocks of it are blocks of the whole sequence's mask."""
        heads = _mix32((self.heads.to(torch.int64) & _M32) ^ 0x27D4EB2F)  # [h]
        pairs = _mix32(self.samples[:, None] ^ heads[None, :]).reshape(-1)  # [b * h]: (sample, head) keys
        rows = _row_keys(queries, pairs, _ATTENTION_SITE + self.layer)  # [n, b * h]
        keep = _keep(rows.t()[:, :, None], _col_keys(keys), _threshold(self.p))  # [b * h, n, m]
        return keep.view(self.samples.numel(), self.heads.numel(), queries.numel(), keys.numel())


class _KeyedDropout(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, key, site, p):
        ctx.key, ctx.site, ctx.p = key, site, p
        return x * keyed_mask(key, site, x.size(-1), p).to(x.dtype) * (1.0 / (1.0 - p))

    @staticmethod
    def backward(ctx, grad):
        mask = keyed_mask(ctx.key, ctx.site, grad.size(-1), ctx.p)
        return grad * mask.to(grad.dtype) * (1.0 / (1.0 - ctx.p)), None, None, None


def keyed_dropout(x: torch.Tensor, p: float, key: DropoutKey, site: int) -> torch.Tensor:
    """Dropout of ``x`` ``[s_rows, b, features]`` with the masks ``key`` and ``site`` give (see the module)."""
    if x.dim() != 3 or x.size(0) != key.rows.size(0) or x.size(1) != key.samples.numel():
        raise ValueError(f"keyed dropout expects [rows, batch, features] with {key.rows.size(0)} rows and "
                         f"{key.samples.numel()} samples (the key's), got {tuple(x.shape)}")
    if p <= 0.0:
        return x
    if p >= 1.0:
        raise ValueError(f"dropout probability must be below 1, got {p}")
    return _KeyedDropout.apply(x, key, site, p)
