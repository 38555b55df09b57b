"""Sizes of the recurrent mixers (Gated DeltaNet, Kimi Delta Attention, Mamba-2) from a config: parameters, matmul
FLOPs per token, the state a head carries and the context-parallel summaries, without building anything.

Parameters (full sizes; ``add_bias_linear`` adds the projections' biases), as ``gated_delta_net.py`` and
``mamba.py`` build them:

* Gated DeltaNet: ``in_proj_qk`` ``[2 nk dk, h]``, ``in_proj_vz`` ``[2 nv dv, h]``, ``in_proj_ba`` ``[2 nv, h]``,
  ``out_proj`` ``[h, nv dv]``; replicated over TP: the convolution ``[2 nk dk + nv dv, K]`` (no bias), ``A_log``
  and ``dt_bias`` ``[nv]``, the gated norm's weight ``[dv]`` and ``out_proj``'s bias.
* Kimi Delta Attention (n = ``linear_num_key_heads`` heads, each a key and a value head): ``in_proj_qk``
  ``[2 n dk, h]``, ``in_proj_v`` ``[n dv, h]``, ``in_proj_b`` ``[n, h]``, the decay's ``f_proj`` ``[n dk, h]`` and the
  output gate's ``g_proj`` ``[n dv, h]`` (or, with ``kda_f_lora_rank`` / ``kda_gate_lora_rank`` r, ``[r, h]``
  replicated and ``[n dk | n dv, r]``; no biases), ``out_proj`` ``[h, n dv]``; replicated: the convolution
  ``[2 n dk + n dv, K]``, ``A_log`` ``[n]``, ``dt_bias`` ``[n dk]``, the norm's weight ``[dv]``, ``out_proj``'s bias.
* Mamba-2 (d = heads x head_dim, gN = groups x state): ``in_proj_zx`` ``[2d, h]``, ``in_proj_bc`` ``[2gN, h]``,
  ``in_proj_dt`` ``[heads, h]``, ``out_proj`` ``[h, d]``; replicated: the convolution ``[d + 2gN, K]`` and its bias,
  ``A_log``, ``D``, ``dt_bias`` ``[heads]``, the norm's weight ``[d]`` and ``out_proj``'s bias.

FLOPs per token, forward (2 per multiply-add): the projections' ``2 x`` their weights, the depthwise convolution's
``2 K`` per channel, and the chunked scan. Its counts are the matmuls of this repository's kernels, per head and
token with chunk C:

* gated delta rule (``delta_rule.py``, C = 64): ``C (5 dk + 3 dv) + 6 dk dv`` -- the chunk-local terms k k^T and
  q k^T (2 C dk each), the UT transform's triangular solve over [v | k] (C (dk + dv)), the intra-chunk
  ``attn @ v_new`` (2 C dv), and three state products (``w S``, ``k^T v_new``, ``q S``: 2 dk dv each). It is the
  O(L C d + L d^2) of the chunkwise delta rule (Yang et al. 2024, "Parallelizing Linear Transformers with the
  Delta Rule over Sequence Length", Sec. 3; the gated form, Yang et al. 2025, "Gated Delta Networks", Sec. 3.3).
  Kimi Delta Attention's decay per key channel adds the pairs of its sub-chunks (``delta_core.py``: 64 -> 4 x 16
  -> 16 x 4 tokens), ``4 dk`` per token at each level below the chunk: ``4 dk (16 + 4)``.
* SSD (``ssd.py``, Q = 128): per group ``2 Q N`` (C B^T), per head ``2 Q P`` (the masked product with x) and
  ``4 P N`` (the chunk's state from B and x, the output from C and the entering state), the chunked algorithm
  of Dao & Gu 2024, "Transformers are SSMs", Sec. 6 (its O(T Q (N + P)) diagonal blocks and O(T N P) states).

Neither grows with the sequence: a recurrent layer has no s x s square. Elementwise work (gates, decays, norms) is
not counted, as attention's softmax is not. Context parallelism runs each rank's non-first run twice (from a zero
state for its summary, then from the state entering it) and a transition scan: work the model's FLOPs leave out,
as they leave out recomputation.
"""

from __future__ import annotations

from ..config import GPTConfig
from .delta_core import LEAF, SPLIT

__all__ = ["GDN_CHUNK", "SSD_CHUNK", "recurrent_parameters", "recurrent_matrices", "conv_channels", "delta_heads",
           "scan_flops_per_token", "recurrent_flops_per_token", "summary_elements", "state_elements"]

GDN_CHUNK = 64  # chunk_gated_delta_rule's and chunk_kda_rule's default, which GatedDeltaNet and KDA run
SSD_CHUNK = 128  # MambaMixer's chunk_size (megatron-core's)


def _check(kind: str) -> None:
    if kind not in ("gdn", "kda", "mamba"):
        raise ValueError(f"{kind!r} is not a recurrent mixer: use 'gdn' (Gated DeltaNet), 'kda' (Kimi Delta "
                         "Attention) or 'mamba' (Mamba-2)")


def delta_heads(c: GPTConfig, kind: str) -> int:
    """The heads a delta rule runs (each with a ``[dk, dv]`` state): Gated DeltaNet's value heads, KDA's heads."""
    return c.linear_num_value_heads if kind == "gdn" else c.linear_num_key_heads


def conv_channels(c: GPTConfig, kind: str) -> int:
    """Channels of the short convolution (full size): ``[q; k; v]`` of Gated DeltaNet and KDA, ``[x; B; C]`` of
    Mamba-2."""
    _check(kind)
    if kind in ("gdn", "kda"):
        return 2 * c.linear_num_key_heads * c.linear_key_head_dim + delta_heads(c, kind) * c.linear_value_head_dim
    return c.mamba_heads * c.mamba_head_dim + 2 * c.mamba_num_groups * c.mamba_state_dim


def recurrent_matrices(c: GPTConfig, kind: str) -> list[tuple[int, int]]:
    """The mixer's projection weights as ``(rows, columns)``, whole: their sizes are its multiply-adds per token
    outside the convolution and the scan."""
    _check(kind)
    h = c.hidden_size
    if kind == "gdn":
        key, value, nv = (c.linear_num_key_heads * c.linear_key_head_dim,
                          c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads)
        return [(2 * key, h), (2 * value, h), (2 * nv, h), (h, value)]
    if kind == "kda":
        n = c.linear_num_key_heads
        key, value = n * c.linear_key_head_dim, n * c.linear_value_head_dim
        return [(2 * key, h), (value, h), (n, h)] + _kda_gates(c, key, value) + [(h, value)]
    d, bc = c.mamba_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
    return [(2 * d, h), (2 * bc, h), (c.mamba_heads, h), (h, d)]


def _kda_gates(c: GPTConfig, key: int, value: int) -> list[tuple[int, int]]:
    """KDA's decay (f) and output gate (g) projections: full rank, or down to a rank and up (Kimi Linear's)."""
    out = []
    for width, rank in ((key, c.kda_f_lora_rank), (value, c.kda_gate_lora_rank)):
        out += [(width, c.hidden_size)] if rank is None else [(rank, c.hidden_size), (width, rank)]
    return out


def recurrent_parameters(c: GPTConfig, kind: str) -> tuple[int, int]:
    """(the mixer's parameters, those of them tensor parallelism replicates), full sizes (module doc)."""
    matrices = recurrent_matrices(c, kind)
    bias = 1 if c.add_bias_linear else 0
    biased = matrices[:3] if kind == "kda" else matrices[:-1]  # column-parallel; KDA's gates have none
    weights = sum(r * k for r, k in matrices) + bias * sum(r for r, _ in biased)
    out_bias = bias * c.hidden_size  # row-parallel: replicated
    channels, k = conv_channels(c, kind), c.linear_conv_kernel_dim
    downs = 0  # KDA's gates' down projections: among the matrices, whole on every rank
    if kind == "gdn":
        small = channels * k + 2 * c.linear_num_value_heads + c.linear_value_head_dim
    elif kind == "kda":
        downs = sum(r * c.hidden_size for r in (c.kda_f_lora_rank, c.kda_gate_lora_rank) if r is not None)
        small = channels * k + c.linear_num_key_heads * (1 + c.linear_key_head_dim) + c.linear_value_head_dim
    else:
        small = channels * (k + 1) + 3 * c.mamba_heads + c.mamba_heads * c.mamba_head_dim
    return weights + out_bias + small, out_bias + small + downs


def scan_flops_per_token(c: GPTConfig, kind: str) -> int:
    """Forward matmul FLOPs of the chunked scan for one token, all heads (module doc: the kernels' counts)."""
    _check(kind)
    if kind in ("gdn", "kda"):
        dk, dv, C = c.linear_key_head_dim, c.linear_value_head_dim, GDN_CHUNK
        return delta_heads(c, kind) * (C * (5 * dk + 3 * dv) + 6 * dk * dv + _sub_chunk_pairs(kind, dk))
    P, N, Q = c.mamba_head_dim, c.mamba_state_dim, SSD_CHUNK
    return c.mamba_num_groups * 2 * Q * N + c.mamba_heads * (2 * Q * P + 4 * P * N)


def _sub_chunk_pairs(kind: str, dk: int) -> int:
    """KDA's pairs of its sub-chunks per token and head (k k^T and q k^T at each level below the chunk)."""
    flops, size = 0, GDN_CHUNK
    while kind == "kda" and size > LEAF and size % SPLIT == 0:
        size //= SPLIT
        flops += 4 * dk * size
    return flops


def recurrent_flops_per_token(c: GPTConfig, kind: str) -> int:
    """Forward FLOPs of one recurrent mixer for one token: projections, convolution and scan; no sequence term."""
    convolution = 2 * c.linear_conv_kernel_dim * conv_channels(c, kind)
    return 2 * sum(r * k for r, k in recurrent_matrices(c, kind)) + convolution + scan_flops_per_token(c, kind)


def state_elements(c: GPTConfig, kind: str, tp: int = 1) -> int:
    """Elements of the state one batch row carries on one TP rank: ``heads/tp x dk x dv`` (Gated DeltaNet's value
    heads, KDA's heads), ``heads/tp x head_dim x state`` (Mamba-2)."""
    _check(kind)
    if kind in ("gdn", "kda"):
        return delta_heads(c, kind) // tp * c.linear_key_head_dim * c.linear_value_head_dim
    return c.mamba_heads // tp * c.mamba_head_dim * c.mamba_state_dim


def summary_elements(c: GPTConfig, kind: str, tp: int = 1) -> tuple[int, int]:
    """(|S|, |M|) of one run's summary per batch row on one TP rank (``sequence.py``'s gathered row): the state it
    leaves and its transition, ``[heads/tp, dk, dk]`` for a delta rule, one scalar per head for Mamba-2."""
    if kind in ("gdn", "kda"):
        return state_elements(c, kind, tp), delta_heads(c, kind) // tp * c.linear_key_head_dim ** 2
    return state_elements(c, kind, tp), c.mamba_heads // tp
