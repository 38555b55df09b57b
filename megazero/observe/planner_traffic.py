"""Bytes one GPU sends per training step, by group: the planner's traffic model.

Ring collectives: an all-gather or reduce-scatter of X bytes sends X (n-1)/n, an all-reduce twice
that, an all-to-all of X bytes X (n-1)/n (the share addressed to itself stays), a point-to-point send
its bytes: the volumes tools/rehearse.py counts from the collectives the run issues.

- ``dp`` / ``edp``: ZeRO over the data(-and-context)-parallel group for the dense parameters, over the
  expert-data-parallel group for the routed experts (same stage formula, their own sizes).
- ``tp``: Megatron's all-reduces (or SP's all-gather + reduce-scatter) of [s, b, h] per layer (in a hybrid
  stack per part: attention, recurrent mixer, MLP).
- ``cp``: the context-parallel attention exchange of every layer (ring, all-to-all, all-gather or
  hierarchical), as :mod:`megazero.model.attention.cp.ring` and :mod:`megazero.mpu.cp_exchange` send it; a
  recurrent layer's state summaries and convolution halo (:mod:`megazero.observe.planner_recurrent`), whose
  bytes do not grow with the sequence.
- ``ep``: the token dispatcher's all-to-alls of every mixture layer (Megatron-core's alltoall
  dispatcher, :mod:`megazero.model.moe.dispatch`), for tokens routed evenly over the experts, as the
  balancing losses aim for (the rehearsal routes them so).
- ``pp``: given by the pipeline plan.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from megazero.model.config import GPTConfig
from megazero.model.attention.cp.exchanges import a2a_elements, a2a_head_split, allgather_elements
from megazero.model.layer_pattern import RECURRENT_MIXERS
from megazero.model.moe.routing import capacity_of
from megazero.observe.planner_offload import DTYPE_BYTES
from megazero.observe.planner_recurrent import recurrent_cp_bytes_per_layer, recurrent_tp_units

__all__ = ["traffic_bytes_per_step", "zero_bytes", "tp_bytes", "cp_bytes", "cp_bytes_per_layer", "ep_bytes_per_layer",
           "STATE_GRAD_BYTES"]

# The gradients' bytes by precision when no grad_accum_dtype is given (the engine's default:
# fp32 main grads under bf16, the weights' dtype otherwise).
STATE_GRAD_BYTES = {"bf16": 4, "fp16": 2, "fp32": 4}


def zero_bytes(psi: float, *, n: int, zero_stage: int, microbatches: int, precision: str,
               grad_accum_dtype: Optional[str] = None) -> tuple[float, float]:
    """(weights all-gathered, gradients reduced) bytes one rank sends per step for its ``psi``
    parameters partitioned over ``n`` ranks: ZeRO-0 all-reduces the gradients (2 psi), ZeRO-1
    reduce-scatters them and all-gathers the weights once, ZeRO-2 reduce-scatters each
    micro-batch's gradients as backward frees them, ZeRO-3 gathers every unit in forward and in
    backward of each micro-batch ((2 + 1) m psi). Weights in the compute dtype, gradients in the
    reduction dtype."""
    if n <= 1 or psi <= 0:
        return 0.0, 0.0
    e = DTYPE_BYTES[precision]
    g = DTYPE_BYTES[grad_accum_dtype] if grad_accum_dtype else STATE_GRAD_BYTES[precision]
    m, frac = microbatches, (n - 1) / n
    gathers, reduces = {0: (0, 2), 1: (1, 1), 2: (1, m), 3: (2 * m, m)}[zero_stage]
    return gathers * psi * e * frac, reduces * psi * g * frac


def tp_bytes(config: GPTConfig, *, tp: int, tokens: int, precision: str, layers: float, microbatches: int,
             recompute: Optional[str], own_token_moe_layers: float = 0.0, moe_layers: float = 0.0,
             sequence_parallel: bool = False, embedding: bool = True, head: float = True,
             mtp_inputs: float = 0.0, layer_numbers: Optional[Sequence[int]] = None) -> float:
    """Megatron's tensor-parallel exchanges: per layer and micro-batch 2 all-reduces of [tokens, h] in
    forward and 2 in backward (2 more with full recompute), or the same bytes as SP's all-gather +
    reduce-scatter; under SP, backward gathers the input of the QKV and dense MLP's first
    column-parallel linears again (as Megatron, rather than keep it). A mixture layer whose ranks
    route their own tokens (expert TP other than TP, no shared expert) exchanges only its attention's
    half. Multi-latent attention's input side carries its latents and the RoPE key (the query's
    input, h wide, without a query latent) instead of [tokens, h], and under SP its down-projections'
    weight gradients are all-reduced each micro-batch. Outside the layers, on the stages holding them: the embedding's output reduction (an
    all-reduce, or SP's reduce-scatter and its backward all-gather), the head's input (its gradient's
    all-reduce, or SP's all-gather, backward re-gather and reduce-scatter) and the loss's per-token
    fp32 max, target logit and sum; ``mtp_inputs``: the multi-token prediction depths' input exchanges.
    ``tokens``: the TP group's share of the sequence (s / cp x b). ``layer_numbers``: the layers of a hybrid
    stack (one-part and recurrent layers), counted part by part in place of ``layers`` x an attention layer's
    (:func:`_parts_units`)."""
    if tp <= 1:
        return 0.0
    act = DTYPE_BYTES[precision] * tokens * config.hidden_size
    if layer_numbers is not None:  # a hybrid stack: each layer's parts
        units = _parts_units(config, layer_numbers, recompute=recompute, sequence_parallel=sequence_parallel,
                             tokens=tokens, own_tokens=own_token_moe_layers > 0)
    else:
        per_layer = 6 if recompute == "full" else 4
        units = layers * per_layer - own_token_moe_layers * per_layer / 2
        units += layers * _mla_units(config, recompute=recompute, sequence_parallel=sequence_parallel, tokens=tokens)
        if sequence_parallel:  # an all-gather is half an all-reduce's bytes
            units += 0.5 * (layers + layers - moe_layers)
    units += embedding + head * (1.5 if sequence_parallel else 1.0)
    # a multi-token prediction depth's input: the embedding's output all-reduced, eh_proj's [2h] input
    # (its gradient all-reduced, or SP's all-gather and reduce-scatter), its output gathered over the
    # hidden dimension (and SP's backward all-gather of it and of the embedding's scatter)
    units += mtp_inputs * (4.5 if sequence_parallel else 3.5)
    loss = 3 * 4 * tokens * head  # all-reduced [tokens] fp32: the max, then the target logit and the sum (per head pass)
    return microbatches * 2 * (units * act + loss) * (tp - 1) / tp


def _mla_units(c: GPTConfig, *, recompute: Optional[str], sequence_parallel: bool, tokens: int) -> float:
    """What multi-latent attention changes in one attention's units: its input side exchanges the latents and
    the RoPE key, not ``[tokens, h]``; under SP its down-projections' weight gradients are all-reduced."""
    if not c.multi_latent_attention:
        return 0.0
    width = (c.q_lora_rank or c.hidden_size) + c.kv_lora_rank + c.qk_pos_emb_head_dim
    # input side: its gradient's all-reduce; or SP's gather, its reduce-scatter, backward's re-gather
    # (and the recomputed forward's gather)
    side = (1.5 + (0.5 if recompute == "full" else 0.0)) if sequence_parallel else 1.0
    units = -side * (1 - width / c.hidden_size)
    if sequence_parallel:  # the down-projections saw this rank's tokens: their weights' gradients all-reduced
        units += ((c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_pos_emb_head_dim) / tokens
    return units


def _parts_units(c: GPTConfig, numbers: Sequence[int], *, recompute: Optional[str], sequence_parallel: bool,
                 tokens: int, own_tokens: bool) -> float:
    """The TP exchanges of layers ``numbers`` of a hybrid stack part by part, in ``[tokens, h]`` all-reduces:
    an attention or a dense MLP 2 (forward's output, backward's input gradient; 3 under full recompute; SP adds
    the re-gather of its input, 0.5), a mixture 2 (3) or nothing when ranks route their own tokens, a recurrent
    mixer :func:`~megazero.observe.planner_recurrent.recurrent_tp_units`."""
    full = 1.0 if recompute == "full" else 0.0
    units = 0.0
    for number in numbers:
        kinds = c.layer_kinds(min(number, c.num_layers - 1))
        if kinds.mixer in RECURRENT_MIXERS:
            units += recurrent_tp_units(c, kinds.mixer, sequence_parallel=sequence_parallel, recompute=recompute,
                                        tokens=tokens)
        elif kinds.mixer is not None:
            units += 2 + full + (0.5 if sequence_parallel else 0.0)
            units += _mla_units(c, recompute=recompute, sequence_parallel=sequence_parallel, tokens=tokens)
        if kinds.mlp == "dense":
            units += 2 + full + (0.5 if sequence_parallel else 0.0)
        elif kinds.mlp == "moe" and not own_tokens:
            units += 2 + full
    return units


def _ring(tokens: int, kv_heads: int, qk_dim: int, v_dim: int, ranks: int, e: int, acc: int,
          window: Optional[int] = None, batch: int = 1) -> tuple[float, float]:
    """(forward, backward) bytes of ring attention (:class:`~megazero.model.attention.cp.ring.RingStats`):
    the K (``qk_dim`` wide) and V (``v_dim``) blocks passed on P - 1 times; backward again, and the dK/dV
    accumulators once around. A sliding ``window`` whose reach into the two neighbouring zigzag shards fits
    in two shards takes the halo exchange (:mod:`~megazero.model.attention.cp.halo`): about window + 1 keys
    from each neighbour, and their dK/dV back."""
    block = tokens * kv_heads * (qk_dim + v_dim)
    if window is not None and 2 * (window + 1) * batch <= 2 * tokens:
        halo = 2 * (window + 1) * batch * kv_heads * (qk_dim + v_dim)
        return halo * e, halo * acc
    return block * (ranks - 1) * e, block * (ranks - 1) * e + block * ranks * acc


def cp_bytes_per_layer(config: GPTConfig, *, tp: int, cp: int, seq_length: int, micro_batch_size: int,
                       precision: str, recompute: Optional[str], kind: str,
                       hierarchical_cp: Sequence[int] = (), window: Optional[int] = None) -> float:
    """Bytes one rank sends in one layer's context-parallel exchange per micro-batch, forward and
    backward (the forward twice under recomputation, which re-runs the core attention). ``seq_length``
    is the whole sequence; heads and KV groups are the rank's (/ tp); q/k heads are ``config.qk_dim``
    wide, v heads ``config.v_dim``; ``window``: the layer's sliding window (the ring's halo exchange)."""
    if cp <= 1:
        return 0.0
    e = DTYPE_BYTES[precision]
    acc = 4 if precision in ("bf16", "fp16") else DTYPE_BYTES[precision]  # the ring's accumulators
    heads, groups, b = config.num_attention_heads // tp, max(config.query_groups // tp, 1), micro_batch_size
    d, dv = config.qk_dim, config.v_dim
    forwards = 2 if recompute in ("full", "selective") else 1
    if kind == "p2p":
        fwd, bwd = _ring(seq_length // cp * b, groups, d, dv, cp, e, acc, window, b)
    elif kind == "a2a":
        fwd = a2a_elements(seq_length, heads, groups, d, cp, b, "forward", v_head_dim=dv) * e
        bwd = a2a_elements(seq_length, heads, groups, d, cp, b, "backward", v_head_dim=dv) * e
    elif kind == "allgather":
        fwd = bwd = allgather_elements(seq_length, groups, d, cp, b, v_head_dim=dv) * e
    elif kind == "a2a+p2p":
        a, r = hierarchical_cp
        fwd = a2a_elements(seq_length // r, heads, groups, d, a, b, "forward", v_head_dim=dv) * e
        bwd = a2a_elements(seq_length // r, heads, groups, d, a, b, "backward", v_head_dim=dv) * e
        ring_heads = groups // a if a2a_head_split(heads, groups, a) == "split" else heads // a
        ring_fwd, ring_bwd = _ring(seq_length // r * b, ring_heads, d, dv, r, e, acc, window, b)
        fwd, bwd = fwd + ring_fwd, bwd + ring_bwd
    else:
        raise ValueError(f"unknown context-parallel exchange {kind!r}")
    return forwards * fwd + bwd


def cp_bytes(config: GPTConfig, *, kinds: Union[str, Sequence[str]], layers: float, microbatches: int,
             layer_numbers: Optional[Sequence[int]] = None, **kw) -> float:
    """:func:`cp_bytes_per_layer` over ``layers`` layers of ``microbatches`` micro-batches; per-layer
    exchanges (``kinds`` a sequence) and sliding windows are averaged over the model's layers. In a hybrid
    stack a layer's bytes are its mixer's: attention's exchange, a recurrent mixer's
    (:func:`~megazero.observe.planner_recurrent.recurrent_cp_bytes_per_layer`), none for an MLP alone;
    ``layer_numbers``: the layers themselves, summed (else the model's average times ``layers``)."""
    if kw["cp"] <= 1:
        return 0.0
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    n = config.num_layers

    def one(i: int) -> float:
        mixer = config.layer_kinds(min(i, n - 1)).mixer
        if mixer is None:
            return 0.0
        if mixer in RECURRENT_MIXERS:
            return recurrent_cp_bytes_per_layer(config, mixer, **{k: kw[k] for k in _RECURRENT_KW})
        return cp_bytes_per_layer(config, kind=kinds[i % len(kinds)], window=config.layer_window(i), **kw)

    if layer_numbers is not None:
        return sum(one(i) for i in layer_numbers) * microbatches
    per_layer = sum(one(i) for i in range(n)) / n
    return per_layer * layers * microbatches


_RECURRENT_KW = ("tp", "cp", "seq_length", "micro_batch_size", "precision", "recompute")


def ep_bytes_per_layer(config: GPTConfig, *, tp: int, cp: int, ep: int, etp: int, tokens: int, precision: str,
                       recompute: Optional[str], sequence_parallel: bool) -> float:
    """Bytes one rank sends in one mixture layer's token all-to-alls per micro-batch: dispatch and
    combine in forward and their reverse in backward (the forward again under full recompute), each
    R rows of h (R: the token copies this rank sends, k per token routed; per etp rank of the expert
    when ranks route their own tokens; each expert's ``slots`` rows when padded to capacity), of
    which (n-1)/n leave the rank (n: the exchange group, ep x those etp copies). ``tokens``: the
    rank's tokens of the micro-batch (s / cp x b)."""
    own = etp != tp
    copies = etp if own else 1
    ranks = ep * copies
    if ranks <= 1:
        return 0.0
    c, k = config, config.moe_router_topk
    sp = sequence_parallel and tp > 1
    routed = tokens // tp if sp else tokens  # under SP each rank routes its share of the sequence ...
    here = routed if own else tokens  # ... or the experts take the TP group's gathered tokens
    if c.moe_expert_capacity_factor is not None and c.moe_pad_expert_input_to_capacity:
        capacity = capacity_of(tokens * cp, k, c.num_experts, c.moe_expert_capacity_factor, c.moe_min_capacity)
        rows = c.num_experts * min(capacity, here)
    else:
        kept = min(1.0, c.moe_expert_capacity_factor) if c.moe_expert_capacity_factor is not None else 1.0
        rows = here * k * kept
    one = rows * copies * c.hidden_size * DTYPE_BYTES[precision] * (ranks - 1) / ranks
    return one * (6 if recompute == "full" else 4)


def traffic_bytes_per_step(config: GPTConfig, *, psi: float, tp: int, dp: int, zero_stage: int, microbatches: int,
                           micro_batch_size: int, seq_length: int, precision: str, layers: float,
                           pp_bytes: float = 0.0, recompute: Optional[str] = None,
                           grad_accum_dtype: Optional[str] = None, psi_experts: float = 0.0, edp: int = 1,
                           ep: int = 1, etp: Optional[int] = None, moe_layers: float = 0.0, cp: int = 1,
                           cp_comm_type: Union[str, Sequence[str]] = "p2p", hierarchical_cp: Sequence[int] = (),
                           sequence_parallel: bool = False, first_stage: bool = True,
                           last_stage: bool = True, mtp_layers: int = 0, mtp_moe_layers: int = 0,
                           layer_numbers: Optional[Sequence[int]] = None) -> dict[str, float]:
    """Bytes one GPU of a stage of ``layers`` layers (``moe_layers`` of them mixtures) sends per step,
    by group: ``dp`` over the ``psi`` dense parameters partitioned over ``dp`` ranks (data x context
    parallel), ``edp`` over the ``psi_experts`` routed-expert parameters over ``edp`` ranks, ``tp``,
    ``cp``, ``ep`` (the token all-to-alls), ``pp`` (``pp_bytes``) and their ``total``;
    ``dp_all_gather`` / ``dp_reduce`` (and ``edp_*``) split ZeRO's two directions. ``seq_length`` is
    the rank's share of the sequence (s / cp), ``microbatches`` per step; ``first_stage`` /
    ``last_stage``: the stage holds the embedding / the head and the loss; ``mtp_layers`` (``mtp_moe_layers``
    of them mixtures): the last stage's multi-token prediction layers, which are never recomputed, each
    with its own pass through the head. ``layer_numbers``: the stage's layers of a hybrid stack (their tensor-
    and context-parallel exchanges counted layer by layer, part by part; None: ``layers`` average layers)."""
    m, b = microbatches, micro_batch_size
    etp = tp if etp is None else etp
    zero = dict(zero_stage=zero_stage, microbatches=m, precision=precision, grad_accum_dtype=grad_accum_dtype)
    dp_gather, dp_reduce = zero_bytes(psi, n=dp, **zero)
    edp_gather, edp_reduce = zero_bytes(psi_experts, n=edp, **zero)
    sp = sequence_parallel and tp > 1
    own = etp != tp and config.moe_shared_expert_intermediate_size is None

    def layer_bytes(n: float, moe: float, rc: Optional[str], embedding: bool, head: float,
                    mtp: float = 0.0, numbers: Optional[Sequence[int]] = None) -> tuple[float, ...]:
        """(tp, cp, ep) bytes of ``n`` layers (``moe`` mixtures; ``numbers``: which, in a hybrid stack) recomputed
        as ``rc`` says, ``head`` passes through the head, ``mtp`` multi-token prediction inputs."""
        return (tp_bytes(config, tp=tp, tokens=seq_length * b, precision=precision, layers=n, microbatches=m,
                         recompute=rc, own_token_moe_layers=moe if own else 0.0, moe_layers=moe, sequence_parallel=sp,
                         embedding=embedding, head=head, mtp_inputs=mtp, layer_numbers=numbers),
                cp_bytes(config, kinds=cp_comm_type, layers=n, microbatches=m, tp=tp, cp=cp, seq_length=seq_length * cp,
                         micro_batch_size=b, precision=precision, recompute=rc, hierarchical_cp=hierarchical_cp,
                         layer_numbers=numbers)
                if n else 0.0,
                moe * m * ep_bytes_per_layer(config, tp=tp, cp=cp, ep=ep, etp=etp, tokens=seq_length * b,
                                             precision=precision, recompute=rc, sequence_parallel=sp))

    exchanges = layer_bytes(layers, moe_layers, recompute, first_stage, last_stage, numbers=layer_numbers)
    if mtp_layers:  # the multi-token prediction layers are not recomputed; each depth has its head
        rc = None if recompute == "full" else recompute
        depths = None if layer_numbers is None else range(config.num_layers, config.num_layers + mtp_layers)
        extra = layer_bytes(mtp_layers, mtp_moe_layers, rc, False, mtp_layers, mtp_layers, numbers=depths)
        exchanges = tuple(a + x for a, x in zip(exchanges, extra))
    out = {"dp": dp_gather + dp_reduce, "dp_all_gather": dp_gather, "dp_reduce": dp_reduce,
           "edp": edp_gather + edp_reduce, "edp_all_gather": edp_gather, "edp_reduce": edp_reduce,
           "tp": exchanges[0], "cp": exchanges[1], "ep": exchanges[2], "pp": pp_bytes}
    out["total"] = sum(out[k] for k in ("dp", "edp", "tp", "cp", "ep", "pp"))
    return out
