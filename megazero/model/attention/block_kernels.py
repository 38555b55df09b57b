"""Block kernels of ring attention: attention of one dense query block against one key/value block.

A kernel returns the block's output and its log-sum-exp, and its backward takes the *merged* output
and log-sum-exp of the whole attention, which makes the block gradients those of the whole attention
(the FlashAttention recurrence: dS = P * (dP - rowsum(dO * O))). Registered kernels:

- ``math``: the explicit formula in fp32 (fp64 for fp64 inputs); any device and dtype; in square tiles
  of at most 4M score elements merged by log-sum-exp (a Python loop: slower than the fused ops); the
  one kernel that applies attention dropout keyed by position, an explicit mask and a sliding window's
  edge (``band``: column j masked for row i when j < i + band; the tiles wholly left of it skipped).
- ``cpu_flash``: torch's CPU flash-attention op and its backward op (no dropout: torch's CPU op has none).
- ``cuda_flash``: torch's CUDA flash-attention op (fp16/bf16, head dims multiples of 8 up to 256).
- ``cuda_efficient``: torch's CUDA memory-efficient op (fp32 as well).

Attention dropout with the kernel's own masks (``dropout_p``, Megatron's behaviour: drawn from the
device's generator, so they depend on the layout) is applied by every kernel but ``cpu_flash``: the CUDA
ops draw them with their Philox state and replay it in backward, the math kernel draws each tile's from
the generator and redraws them in backward from its saved state. Dropout scales the normalised
probabilities, so the blocks still merge by their (undropped) log-sum-exp.

Value heads may be narrower or wider than query/key heads (multi-latent attention). The math and
efficient kernels take that as it is; the flash ops want one width, so their kernels pad the narrower
side with zeros for the op (V's zero columns give zero output columns, Q/K's add nothing to the
scores) and trim what they return: the padded copies live only during the op.

``auto`` picks the flash op for the device and dtype, the efficient one for fp32 on CUDA, and math
where neither applies (and on CPU with dropout). :func:`register_block_kernel` adds another (e.g.
flash-attn's own kernels).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F

__all__ = ["BlockKernel", "register_block_kernel", "block_kernel", "MATH_KERNEL"]


class BlockKernel(Protocol):
    """Attention of one dense block. q ``[b, heads, n, dqk]``, k ``[b, groups, m, dqk]``, v ``[b, groups, m, dv]``
    (strided views; only the last dimension is contiguous); ``causal`` means n == m and key j is masked for
    query i < j (square, so top-left and bottom-right aligned causal masks agree). ``forward`` -> (out
    ``[b, heads, n, dv]`` in q's dtype, lse ``[b, heads, n]`` in fp32, fp64 for fp64 q, rng). ``backward`` gets
    the *merged* out and lse of the whole attention and returns this block's (dq, dk, dv).
    ``dropout_p``: attention dropout with masks drawn from the current generator of q's device (the caller
    forks the stream it wants); ``rng``, what forward returned: what backward needs to draw the same masks
    (None without dropout). ``draws_dropout``: whether the kernel takes ``dropout_p`` > 0."""

    draws_dropout: bool

    def forward(self, q, k, v, causal: bool, scale: float,
                dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, dropout_p: float = 0.0,
                 rng: Any = None) -> tuple[torch.Tensor, ...]: ...


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_TILE = 1 << 22  # score elements of one tile of the math kernel (b * heads * rows * columns)


def _generator_state(device: torch.device) -> Optional[torch.Tensor]:
    """The state of the generator that draws ``device``'s random numbers now (None on meta, which draws none)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state() if device.type == "cpu" else None


def _generator_at(device: torch.device, state: Optional[torch.Tensor]) -> Optional[torch.Generator]:
    """A generator of ``device`` at ``state`` (:func:`_generator_state`); the live ones are untouched."""
    if state is None:
        return None
    g = torch.Generator(device=device)
    g.set_state(state)
    return g


def _tiles(n: int, m: int, causal: bool, t: int, device: torch.device, band: Optional[int] = None):
    """(rows, columns, diagonal) of the tiles of an ``[n, m]`` block; a causal block keeps the tiles on
    and below the diagonal (``diagonal``: the tile holds masked pairs j > i), a ``band`` the tiles with
    a column j >= i + band. On meta (a rehearsal: shapes, no values) only the first tile, the largest:
    no other tile's temporaries exceed its, so the peak memory is the same for a fraction of the
    operators (a rehearsal's time)."""
    for r0 in range(0, n, t):
        r1 = min(n, r0 + t)
        first = 0 if band is None else max(0, r0 + band) // t * t  # tiles left of the band are all masked
        for c0 in range(first, r1 if causal else m, t):
            c1 = min(r1 if causal else m, c0 + t)
            yield slice(r0, r1), slice(c0, c1), causal and c1 > r0 + 1
            if device.type == "meta":
                return


class _MathKernel:
    """The explicit formula in fp32 (fp64 for fp64 inputs); GQA by grouping query heads, not copying K/V.
    It computes a block in square tiles (scores and masks of ``b * heads * t * t`` <= 4M elements, merged
    by log-sum-exp), so no block's whole score matrix is held. The only kernel that takes ``dropout``
    (an :class:`~megazero.model.keyed_dropout.AttentionDropout`, with ``positions``: the block's query
    and key positions in the whole sequence, for its masks) and ``mask`` (``[b | 1, 1, n, m]``, True =
    masked, on top of ``causal``); ``dropout_p`` instead draws each tile's mask from the generator (rng:
    its state before the block, from which backward redraws them in the same order). With dropout the
    output is (P * M / (1 - p)) V with P normalised by the undropped row sum, and backward regenerates M
    (FlashAttention's dropout)."""

    draws_dropout = True

    def __init__(self, tile_elements: int = _TILE) -> None:
        self.tile_elements = tile_elements

    def _tile(self, b: int, h: int) -> int:
        """Rows and columns of a square tile: ``b * h * t * t`` at most ``tile_elements``, t >= 1."""
        return max(1, math.isqrt(max(1, self.tile_elements // (b * h))))

    @staticmethod
    def _scores(q, k, scale, rows, cols, diagonal, mask, acc, band=None):
        b, h, _, d = q.shape
        g = k.size(1)
        qg = q[:, :, rows].to(acc).reshape(b, g, h // g, -1, d)
        scores = torch.matmul(qg, k[:, :, cols].to(acc).unsqueeze(2).transpose(-1, -2)) * scale  # [b, g, h/g, n, m]
        if diagonal:
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(cols.start, cols.stop, device=q.device)[None, :] > i,
                                        float("-inf"))
        if band is not None and cols.start < rows.stop - 1 + band:  # the window's edge crosses the tile
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(cols.start, cols.stop, device=q.device)[None, :] < i + band,
                                        float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(mask[..., rows, cols].unsqueeze(1), float("-inf"))
        return scores

    @staticmethod
    def _scale(dropout, positions, rows, cols, like, p: float, draw: Optional[torch.Generator]):
        """The tile's dropout factors M / (1 - p), shaped and typed ``like`` the tile's scores, or None:
        keyed by ``positions`` (``dropout``), or drawn (``p`` > 0) from ``draw`` (None: the device's
        current generator)."""
        if dropout is not None:
            keep = dropout.keep(positions[0][rows], positions[1][cols]).view(like.shape)
            p = dropout.p
        elif p > 0.0:
            keep = torch.rand(like.shape, generator=draw, dtype=like.dtype, device=like.device) >= p
        else:
            return None
        return keep.to(like.dtype) * (1.0 / (1.0 - p))

    @staticmethod
    def _check(dropout, dropout_p: float) -> None:
        if dropout is not None and dropout_p > 0.0:
            raise ValueError("give attention dropout once: dropout_p (drawn masks) or dropout (keyed by position)")

    def forward(self, q, k, v, causal, scale, dropout_p=0.0, dropout=None, positions=None, mask=None, band=None):
        self._check(dropout, dropout_p)
        b, h, n, _ = q.shape
        g, dv, acc = k.size(1), v.size(-1), acc_dtype(q.dtype)
        rng = _generator_state(q.device) if dropout_p > 0.0 else None
        out = torch.zeros(b, g, h // g, n, dv, dtype=acc, device=q.device)
        lse = torch.full((b, g, h // g, n), float("-inf"), dtype=acc, device=q.device)
        vg = v.to(acc).unsqueeze(2)
        for rows, cols, diagonal in _tiles(n, k.size(2), causal, self._tile(b, h), q.device, band):
            scores = self._scores(q, k, scale, rows, cols, diagonal, mask, acc, band)
            t_lse = torch.logsumexp(scores, dim=-1)
            finite = torch.where(torch.isinf(t_lse), torch.zeros_like(t_lse), t_lse)  # rows with no key here
            probs = torch.exp(scores - finite.unsqueeze(-1))
            factor = self._scale(dropout, positions, rows, cols, probs, dropout_p, None)
            probs = probs if factor is None else probs * factor
            o = torch.matmul(probs, vg[:, :, :, cols])
            old = lse[..., rows]
            new = torch.logaddexp(old, t_lse)
            w_old = torch.where(torch.isinf(new), torch.zeros_like(new), torch.exp(old - new))
            w_new = torch.where(torch.isinf(new), torch.zeros_like(new), torch.exp(t_lse - new))
            out[..., rows, :] = out[..., rows, :] * w_old.unsqueeze(-1) + o * w_new.unsqueeze(-1)
            lse[..., rows] = new
        return out.reshape(b, h, n, dv).to(q.dtype), lse.reshape(b, h, n), rng

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng=None, dropout=None, positions=None,
                 mask=None, band=None):
        self._check(dropout, dropout_p)
        b, h, n, d = q.shape
        g, dv, acc = k.size(1), v.size(-1), acc_dtype(q.dtype)
        draw = _generator_at(q.device, rng) if dropout_p > 0.0 else None  # forward's draws, in its order
        qg, kg, vg = q.to(acc).reshape(b, g, h // g, n, d), k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
        do = dout.to(acc).reshape(b, g, h // g, n, dv)
        lse = lse.to(acc).reshape(b, g, h // g, n, 1)
        delta = (do * out.to(acc).reshape(b, g, h // g, n, dv)).sum(-1, keepdim=True)  # rowsum(dO * O), global O
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        for rows, cols, diagonal in _tiles(n, k.size(2), causal, self._tile(b, h), q.device, band):
            probs = torch.exp(self._scores(q, k, scale, rows, cols, diagonal, mask, acc, band) - lse[..., rows, :])
            factor = self._scale(dropout, positions, rows, cols, probs, dropout_p, draw)  # M regenerated
            kept = probs if factor is None else probs * factor
            dv[:, :, cols] += torch.matmul(kept.transpose(-1, -2), do[..., rows, :]).sum(2)
            dp = torch.matmul(do[..., rows, :], vg[:, :, :, cols].transpose(-1, -2))
            dp = dp if factor is None else dp * factor
            ds = probs * (dp - delta[..., rows, :]) * scale
            dq[..., rows, :] += torch.matmul(ds, kg[:, :, :, cols])
            dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2)
        return dq.reshape(b, h, n, d), dk, dv


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V ``[b, groups, m, d]`` -> ``[b, heads, m, d]`` (a copy when groups < heads): the CUDA ops are
    given equal heads."""
    g = t.size(1)
    return t if g == heads else t.repeat_interleave(heads // g, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum each group's query heads."""
    b, h, m, d = grad.shape
    return grad if h == groups else grad.reshape(b, groups, h // groups, m, d).sum(2)


class _CpuFlashKernel:
    """torch's CPU flash-attention op (GQA native): (out, lse) forward, and a backward op that takes the
    global out and lse. No dropout: torch's CPU op refuses it (``auto`` picks math for dropout on CPU)."""

    draws_dropout = False

    def forward(self, q, k, v, causal, scale, dropout_p=0.0):
        if dropout_p > 0.0:
            raise ValueError("torch's CPU flash-attention op applies no dropout; use the math block kernel")
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng=None):
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        return op(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)


class _CudaFlashKernel:
    """torch's CUDA flash-attention op (the one SDPA dispatches to for fp16/bf16) and its backward op; K/V of a
    GQA block are expanded to the query heads for the op (a block-sized copy) and their gradients summed back.
    With dropout the op draws its masks from the CUDA generator's Philox state; rng is that state, which
    the backward op replays."""

    draws_dropout = True

    def forward(self, q, k, v, causal, scale, dropout_p=0.0):
        h = q.size(1)
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, h), _expand(v, h), dropout_p, causal,
                                                                 False, scale=scale)
        return res[0], res[1], (res[6], res[7]) if dropout_p > 0.0 else None

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng=None):
        h, g, n, m = q.size(1), k.size(1), q.size(2), k.size(2)
        if rng is None:
            no_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # read only with dropout
            rng = (no_rng, no_rng[:1].reshape(()))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, _expand(k, h), _expand(v, h), out.contiguous(), lse.contiguous(), None, None,
            n, m, dropout_p, causal, *rng, scale=scale)
        return dq, _fold(dk, g), _fold(dv, g)


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with zero columns appended up to ``width`` (``t`` itself when it is that wide)."""
    return t if t.size(-1) == width else F.pad(t, (0, width - t.size(-1)))


class _OneWidth:
    """A kernel whose op wants q, k and v of one head width, for any value width: with dv != dqk the
    narrower side is padded with zeros for the op (Q/K's zero columns add nothing to the scores, the
    scale is passed; V's give zero output and zero gradient columns) and the results trimmed; with
    dv == dqk the op is called as it is."""

    def __init__(self, inner: BlockKernel) -> None:
        self.inner = inner
        self.draws_dropout = getattr(inner, "draws_dropout", False)

    def forward(self, q, k, v, causal, scale, dropout_p=0.0):
        dqk, dv = q.size(-1), v.size(-1)
        if dqk == dv:
            return self.inner.forward(q, k, v, causal, scale, dropout_p)
        w = max(dqk, dv)
        out, lse, rng = self.inner.forward(_widened(q, w), _widened(k, w), _widened(v, w), causal, scale, dropout_p)
        return out[..., :dv], lse, rng

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng=None):
        dqk, dv = q.size(-1), v.size(-1)
        if dqk == dv:
            return self.inner.backward(dout, q, k, v, out, lse, causal, scale, dropout_p, rng)
        w = max(dqk, dv)  # dO and O padded alike: rowsum(dO * O) is unchanged
        dq, dk, d_v = self.inner.backward(*(_widened(t, w) for t in (dout, q, k, v, out)), lse, causal, scale,
                                          dropout_p, rng)
        return dq[..., :dqk], dk[..., :dqk], d_v[..., :dv]


def _lse_padded(lse: torch.Tensor) -> torch.Tensor:
    """The efficient op's log-sum-exp rows are padded to a multiple of 32; its backward reads that shape."""
    n = lse.size(-1)
    width = -(-n // 32) * 32
    if width == n:
        return lse.contiguous()
    padded = torch.zeros(*lse.shape[:-1], width, dtype=lse.dtype, device=lse.device)
    padded[..., :n] = lse
    return padded


class _CudaEfficientKernel:
    """torch's CUDA memory-efficient attention op (fp32, fp16, bf16) and its backward op; with dropout, rng
    is the op's Philox seed and offset, which the backward op replays."""

    draws_dropout = True

    def forward(self, q, k, v, causal, scale, dropout_p=0.0):
        h = q.size(1)
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand(k, h), _expand(v, h), None, True, dropout_p, causal, scale=scale)
        return out, lse[..., :q.size(2)], (seed, offset) if dropout_p > 0.0 else None

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout_p=0.0, rng=None):
        h, g = q.size(1), k.size(1)
        if rng is None:
            no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # read only with dropout
            rng = (no_rng, no_rng)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q, _expand(k, h), _expand(v, h), None, out.contiguous(), _lse_padded(lse),
            *rng, dropout_p, [True, True, True, False], causal, scale=scale)
        return dq, _fold(dk, g), _fold(dv, g)


MATH_KERNEL = _MathKernel()  # the explicit formula: the one kernel that masks a window's edge (``band``)
_KERNELS: dict[str, BlockKernel] = {"math": MATH_KERNEL, "cpu_flash": _OneWidth(_CpuFlashKernel()),
                                    "cuda_flash": _OneWidth(_CudaFlashKernel()),
                                    "cuda_efficient": _CudaEfficientKernel()}


def register_block_kernel(name: str, kernel: BlockKernel) -> None:
    """Make ``kernel`` selectable as ``ring_attention(..., kernel=name)`` (e.g. flash-attn's own kernels)."""
    _KERNELS[name] = kernel


def _auto(q: torch.Tensor, v_dim: int, dropout: bool) -> str:
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.device.type in ("cuda", "meta"):  # meta: a rehearsal of a GPU launch, whose memory the CUDA ops show
        d = max(q.shape[-1], v_dim)  # the flash op's width, the narrower side padded
        if half and d % 8 == 0 and d <= 256:
            return "cuda_flash"
        if q.dtype != torch.float64:
            return "cuda_efficient"
        return "math"
    has_op = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    if q.device.type == "cpu" and has_op and (half or q.dtype == torch.float32) and not dropout:
        return "cpu_flash"
    return "math"  # fp64 references, and dropout on CPU (torch's CPU flash op has none)


def block_kernel(name: str, q: torch.Tensor, v_dim: Optional[int] = None, dropout: bool = False) -> BlockKernel:
    """The kernel ``name`` ('auto' or a registered name) runs for ``q`` and values ``v_dim`` wide (default:
    q's width), with its own attention dropout when ``dropout``; 'auto' chooses by device, dtype, head
    widths and dropout."""
    chosen = _auto(q, q.shape[-1] if v_dim is None else v_dim, dropout) if name == "auto" else name
    if chosen not in _KERNELS:
        raise ValueError(f"unknown ring attention block kernel {name!r}; registered: {sorted(_KERNELS)} "
                         f"(add one with register_block_kernel)")
    kernel = _KERNELS[chosen]
    if dropout and not getattr(kernel, "draws_dropout", False):
        raise ValueError(f"block kernel {chosen!r} applies no attention dropout; pass kernel 'auto' or 'math'")
    return kernel
