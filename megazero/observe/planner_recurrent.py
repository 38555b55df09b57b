"""What a recurrent mixer (Gated DeltaNet, Kimi Delta Attention, Mamba-2) costs the planner: the activations it keeps for backward, the
state among them, and the bytes its context- and tensor-parallel exchanges send.

**Context parallelism** (``recurrent/sequence.py``), per layer and micro-batch, one rank, ring volumes: under
state passing (``linear_cp_comm_type='state_passing'``) every rank holds ``slots`` runs of the zigzag layout (2:
chunks r and 2P-1-r, equal shares padded) and all-gathers one summary row per run, ``(|S| + |M|)`` fp32 per batch
row (the state a run leaves and its transition: ``[nv, dk, dv]`` + ``[nv, dk, dk]`` for Gated DeltaNet (KDA: its
heads), ``[heads, P, N]`` + ``[heads]`` for Mamba-2; heads / tp), and the convolution's halo, the K-1 inputs before each
run (``channels / tp`` in the activations' dtype). An all-gather of every rank's share X sends ``X (P-1)``; backward
reduce-scatters the gradients of the same size. Nothing depends on the sequence length. Under ``'a2a'``
(Megatron's) Gated DeltaNet moves its q, k, v, beta and a to 1/P of the heads (KDA its q, k, v, beta and decay
input), Mamba-2 its x, dt, B and C to 1/P of the groups, and the output comes back, both directions in backward again: ``(P-1)/P`` of this rank's share
of the tokens, which grows with the sequence. Full recomputation re-runs the forward's exchanges. Not counted:
the document starts gathered with packed documents (one byte per token or halo token, forward only).

**Tensor parallelism**: a recurrent mixer's column-parallel projections (three; KDA's five, or three and its
gates' low-rank up projections) take the same input apart, so backward all-reduces its gradient once each
(under SP: gathers it for each in forward and again in backward, and reduce-scatters each gradient); the
replicated small weights' gradients (convolution, decays, norm; KDA's down projections under SP) are
all-reduced once per micro-batch. In units of one ``[tokens, h]`` all-reduce, Gated DeltaNet and Mamba-2: 4 (5
under full recompute), with SP 5.5 (7.5).

**Activations** (bytes a rank keeps per token, measured against ``saved_tensors_hooks`` in the tests): besides
the layer's input and norm (the planner's per-part share), the convolution's input, its halo-padded copy and
its pre-SiLU output in the activations' dtype; the gate and the projections' outputs the norm and ``out_proj``
keep; and the chunked scan's fp32 working set: per head and token the chunk-local ``C x C`` matrices (decay,
``k k^T``, ``q k^T``; five of them), the UT transform's ``[u | w]``, the writes, and the chunk's entering
states, ``2 dk dv / C`` (the state kept for backward: ``[heads, dk, dv]`` fp32 per chunk, stacked and per
chunk). Under context parallelism each run is scanned twice (from zero for its summary, then from its entering
state; the worst rank's two runs both) and a delta rule's transition once more (a scan with a ``[dk, dk]``
state); KDA's decay per key channel keeps its sub-chunks' decayed keys (~42 dk floats per head and token), and the gathered summaries ``P x slots x (|S| + |M|)`` fp32 are kept. Within a few per cent of the
measured bytes in bf16; fp32 runs keep some more (casts that are no-ops keep their inputs alive). These are the
PyTorch chunked forms' (``delta_rule.py``, ``ssd.py``: what runs on the CPU, on the meta device of the rehearsal,
and on CUDA without flash-linear-attention or mamba-ssm); the fused CUDA kernels (``kernels.py``) keep less.
"""

from __future__ import annotations

from typing import Optional

from megazero.model.config import GPTConfig
from megazero.model.recurrent.counts import GDN_CHUNK, SSD_CHUNK, conv_channels, recurrent_parameters, summary_elements
from megazero.observe.planner_offload import DTYPE_BYTES

__all__ = ["ZIGZAG_SLOTS", "recurrent_cp_bytes_per_layer", "recurrent_tp_units", "recurrent_activation_bytes",
           "recurrent_state_bytes"]

ZIGZAG_SLOTS = 2  # runs per rank in a gather under the zigzag layout (chunks r and 2P-1-r, padded to equal shares)


def _heads_exchange(c: GPTConfig) -> bool:
    return c.linear_cp_comm_type == "a2a"


def recurrent_cp_bytes_per_layer(config: GPTConfig, kind: str, *, tp: int, cp: int, seq_length: int,
                                 micro_batch_size: int, precision: str, recompute: Optional[str]) -> float:
    """Bytes one rank sends in one recurrent layer's context-parallel exchanges per micro-batch, forward and
    backward (the forward twice under full recompute); ``seq_length`` is the whole sequence (module doc)."""
    if cp <= 1:
        return 0.0
    c, b, e = config, micro_batch_size, DTYPE_BYTES[precision]
    if _heads_exchange(c):
        if kind == "gdn":  # q, k, v, beta, a; the output
            nk, nv = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
            width = 2 * nk * c.linear_key_head_dim + 2 * nv * c.linear_value_head_dim + 2 * nv
        elif kind == "kda":  # q, k, v, beta, f (the decay's input); the output
            n = c.linear_num_key_heads // tp
            width = 3 * n * c.linear_key_head_dim + 2 * n * c.linear_value_head_dim + n
        else:  # x, dt, B, C; the output
            heads = c.mamba_heads // tp
            width = 2 * heads * c.mamba_head_dim + heads + 2 * c.mamba_num_groups // tp * c.mamba_state_dim
        one = e * b * (seq_length // cp) * width * (cp - 1) / cp
    else:
        state, transition = summary_elements(c, kind, tp)
        halo = (c.linear_conv_kernel_dim - 1) * conv_channels(c, kind) // tp * e
        one = ZIGZAG_SLOTS * b * (4 * (state + transition) + halo) * (cp - 1)
    return (2 if recompute == "full" else 1) * one + one


def recurrent_tp_units(config: GPTConfig, kind: str, *, sequence_parallel: bool, recompute: Optional[str],
                       tokens: int) -> float:
    """One recurrent mixer's tensor-parallel exchanges per micro-batch in units of a ``[tokens, h]`` all-reduce
    (module doc), its small weights' gradient all-reduce included. With L column-parallel projections of the input
    and low-rank ones of ranks r (KDA's gates): ``1 + L + sum r/h`` (forward's output, backward's input gradients;
    full recompute 1 more), under SP ``1 + 1.5 (L + sum r/h)`` (full recompute ``0.5 (1 + L + sum r/h)`` more)."""
    c, full = config, recompute == "full"
    ranks = [r for r in (c.kda_f_lora_rank, c.kda_gate_lora_rank) if r is not None] if kind == "kda" else []
    inputs = 3 + (2 - len(ranks) if kind == "kda" else 0)  # [q; k], v (and z), b (a): KDA's full-rank gates too
    low = sum(ranks) / c.hidden_size
    if sequence_parallel:
        units = 1 + 1.5 * (inputs + low) + (0.5 * (1 + inputs + low) if full else 0.0)
    else:
        units = 1 + inputs + low + (1.0 if full else 0.0)
    small = recurrent_parameters(c, kind)[1] - (c.hidden_size if c.add_bias_linear else 0)
    if not sequence_parallel:  # KDA's down projections saw every token: their gradients are whole already
        small -= sum(r * c.hidden_size for r in ranks)
    return units + small / (tokens * c.hidden_size)


def _scan_bytes(c: GPTConfig, kind: str, tp: int, cp: int) -> float:
    """The chunked scan's fp32 bytes per token on one rank (twice under context parallelism, with Gated
    DeltaNet's transition scan)."""
    if kind == "gdn":
        nv, dk, dv, C = c.linear_num_value_heads // tp, c.linear_key_head_dim, c.linear_value_head_dim, GDN_CHUNK
        scan = 4 * nv * (5 * C + 6 * dk + 7 * dv + 2 * dk * dv / C + 6)
        transition = 4 * nv * (2 * C + 2 * dk + dk * dk / C)
    elif kind == "kda":  # the per-channel decays of each sub-chunk level: ~42 dk (chunk 64, sub-chunks 16 and 4)
        n, dk, dv, C = c.linear_num_key_heads // tp, c.linear_key_head_dim, c.linear_value_head_dim, GDN_CHUNK
        scan = 4 * n * (2 * C + 42 * dk + 4 * dv + 2 * dk * dv / C + 5)
        transition = 4 * n * (C + 40 * dk + 2 * dk * dk / C)
    else:
        heads, groups, P, N, Q = (c.mamba_heads // tp, c.mamba_num_groups // tp, c.mamba_head_dim, c.mamba_state_dim,
                                  SSD_CHUNK)
        scan = 4 * (5 * heads * P + 3 * heads * Q + groups * Q + 5 * groups * N + 2 * heads * P * N / Q + 4 * heads)
        transition = 0.0
    return scan if cp <= 1 else 2 * scan + transition


def recurrent_activation_bytes(config: GPTConfig, kind: str, *, micro_batch_size: int, seq_length: int, tp: int = 1,
                               cp: int = 1, act_bytes: int = 2) -> float:
    """Bytes one recurrent mixer keeps for backward on one rank for ``seq_length`` tokens (this rank's: s / cp) of
    ``micro_batch_size`` sequences, without its input and norm (module doc); the gathered summaries included."""
    c, e = config, act_bytes
    channels = conv_channels(c, kind) // tp
    if kind == "gdn":
        nk, nv = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
        # the convolution's three, the gate, the norm's output and out_proj's input; l2norm's fp32 q and k
        outside = e * (3 * channels + 3 * nv * c.linear_value_head_dim) + 4 * 2 * nk * c.linear_key_head_dim
    elif kind == "kda":
        n, dk, dv = c.linear_num_key_heads // tp, c.linear_key_head_dim, c.linear_value_head_dim
        # the convolution's three and out_proj's input; fp32 q and k for l2norm, the decay's input and softplus,
        # the sigmoid gate's four
        outside = e * (3 * channels + n * dv) + 4 * n * (4 * dk + 4 * dv)
    else:
        d = c.mamba_heads // tp * c.mamba_head_dim
        # the convolution's three, the norm's output and out_proj's input; fp32 x, z, silu(z) and the norm's input
        outside = e * (3 * channels + 2 * d) + 4 * 4 * d
    tokens = seq_length * micro_batch_size
    if _heads_exchange(c):  # the whole sequence for 1/cp of the heads: a rank's share of the scan as at cp 1
        return tokens * (outside + _scan_bytes(c, kind, tp, 1))
    return tokens * (outside + _scan_bytes(c, kind, tp, cp)) + _summaries(c, kind, micro_batch_size, tp, cp)


def _summaries(c: GPTConfig, kind: str, micro_batch_size: int, tp: int, cp: int) -> float:
    """The gathered summaries a layer keeps under state passing (the fold reads them in backward)."""
    if cp <= 1 or _heads_exchange(c):
        return 0.0
    return cp * ZIGZAG_SLOTS * micro_batch_size * 4 * sum(summary_elements(c, kind, tp))


def recurrent_state_bytes(config: GPTConfig, kind: str, *, micro_batch_size: int, seq_length: int, tp: int = 1,
                          cp: int = 1) -> float:
    """Of :func:`recurrent_activation_bytes`, the states: each chunk's entering state (fp32, kept twice: per chunk
    and stacked; per run twice more under context parallelism) and the gathered summaries."""
    c, b = config, micro_batch_size
    per_chunk = summary_elements(c, kind, tp)[0]
    chunk = SSD_CHUNK if kind == "mamba" else GDN_CHUNK
    twice = cp > 1 and not _heads_exchange(c)
    states = 2 * 4 * per_chunk * b * seq_length / chunk * (2 if twice else 1)
    return states + _summaries(c, kind, b, tp, cp)
