"""The planner's model states and pipeline stages (:mod:`.planner` puts them beside the rest).

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1): (2 + 2 + K) Psi bytes
for mixed-precision Adam, partitioned over the data-parallel ranks by stage. A pipeline stage
holds the layers :func:`megazero.model.pipeline_split.layers_per_chunk_table` gives it, the split
training builds (even, or Megatron's ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``), with its own dense and mixture layers
(``--moe-layer-freq``); the first stage also the embedding, the last the final norm and the head. In a hybrid
stack (one-part and recurrent layers, ``GPTConfig.layer_kinds``) a stage holds its layers' own parameters and
activations, layer by layer.
"""

from __future__ import annotations

from typing import Optional

from megazero.model.config import GPTConfig
from megazero.model.flops import layer_parameters, mlp_parameters, moe_layers, mtp_parameters, uniform_layers
from megazero.model.pipeline_split import layers_per_chunk_table
from megazero.observe.planner_offload import DTYPE_BYTES

__all__ = ["STATE_BYTES", "model_state_bytes", "stage_layers", "pipeline_plan", "embedding_params",
           "layer_local_parameters", "largest_layer"]

# bytes per parameter: (weights, gradients, optimizer states) — ZeRO paper's 2 + 2 + K with K = 12
# (fp32 master copy 4 + Adam m 4 + v 4); in fp32 the master copy is the weight itself.
# bf16 gradients are accumulated and reduced in fp32 by default (megazero.zero, as Megatron's
# main_grad): 2 + 4 + 12 = 18 bytes; fp16 keeps fp16 gradients under the loss scale.
STATE_BYTES = {"bf16": (2, 4, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}


def model_state_bytes(psi: float, *, dp: int, zero_stage: int, precision: str = "bf16",
                      grad_accum_dtype: Optional[str] = None, offload_ratio: float = 0.0,
                      weights_on_device: float = 1.0, optimizer_bytes: Optional[float] = None
                      ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per rank on the device for ``psi`` parameters (ZeRO
    paper, Sec. 3.1/5).

    Gradients are fp32 for bf16 (the engine's default, Megatron's fp32 main grads) and
    have the weights' dtype otherwise; ``grad_accum_dtype`` overrides (``'bf16'``: the
    paper's 2 + 2 + 12). ``offload_ratio`` of the optimizer partition lives on the host
    (:func:`offloaded_bytes`): the device keeps the rest; ``weights_on_device`` of the ZeRO-3
    weight partition stays there (the rest is offloaded, :func:`offloaded_param_bytes`).
    ``optimizer_bytes``: the optimizer's bytes per parameter, master included (default: Adam's, the table's K).
    """
    if precision not in STATE_BYTES:
        raise ValueError(f"precision must be one of {sorted(STATE_BYTES)}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    w, g, o = STATE_BYTES[precision]
    if optimizer_bytes is not None:
        o = optimizer_bytes
    if grad_accum_dtype is not None:
        g = DTYPE_BYTES[grad_accum_dtype]
    return (w * psi / (dp if zero_stage >= 3 else 1) * (weights_on_device if zero_stage >= 3 else 1.0),
            g * psi / (dp if zero_stage >= 2 else 1),
            o * psi / (dp if zero_stage >= 1 else 1) * (1.0 - offload_ratio))


def with_experts(dense: tuple, experts: tuple) -> tuple:
    """(weights, grads, optimizer) bytes of the dense parameters plus those of the routed experts."""
    return tuple(a + b for a, b in zip(dense, experts))


def embedding_params(config: GPTConfig) -> int:
    """TP-sharded embedding rows (the output layer too when untied)."""
    return config.padded_vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)


def stage_layers(config: GPTConfig, pp: int, v: int = 1, first: Optional[int] = None,
                 last: Optional[int] = None) -> list[list[range]]:
    """``out[stage][chunk]``: the global layer indices each pipeline stage's chunks build, as training
    splits them (:func:`~megazero.model.pipeline_split.layers_per_chunk_table`; its errors name the
    numbers that clash)."""
    table = layers_per_chunk_table(config.num_layers, pp, v, first, last, config.pipeline_segments)
    return [[table[c][r] for c in range(v)] for r in range(pp)]


def _stage_activations(act: dict, *, n: int, moe: int, moe_share: float, r: int, pp: int, v: int,
                       m: int, numbers: Optional[list[int]] = None) -> tuple[float, int]:
    """(activation bytes, micro-batches in flight) of stage ``r`` holding ``n`` layers, ``moe`` of them
    mixtures (the model's share ``moe_share``); ``numbers``: which (a hybrid stack's layers keep their own)."""
    saved, live = act["saved_per_layer"], act["recompute_live"]
    if "saved_by_kind" in act and n:  # the stage's own mix of dense and mixture layers
        dense, mixed = act["saved_by_kind"]
        saved = act["saved_per_layer"] + (moe / n - moe_share) * (mixed - dense)
    if "saved_by_layer" in act and n:  # a hybrid stack: its layers' own, averaged over the stage's
        saved = sum(act["saved_by_layer"][i] for i in numbers) / n
    # Each micro-batch in flight also keeps the stage's output it sent (every stage but the last;
    # the pipeline keeps it for backward), and on the first stage the embedding's dropout mask.
    output = act["layer_input"] if r < pp - 1 or v > 1 else 0.0
    mask = act["embedding_mask"] if r == 0 else 0.0
    if v == 1:
        in_flight = min(pp - r, m)
        acts = in_flight * (n * saved + output + mask) + live
    else:
        in_flight = min((pp - r - 1) * 2 + (v - 1) * pp + 1, m * v)
        acts = in_flight * ((n // v) * saved + output) + min(m, pp) * mask + live
    if r == pp - 1:
        acts += act["outside_layers"]  # the loss's logits: one micro-batch at a time
    return acts, in_flight


def _embedding_sync(c: GPTConfig, word: float) -> tuple[float, float]:
    """(bytes alive through backward, bytes at the exchange after it) of the word embedding's gradient
    shared by the first and the last stage (tied, or read by multi-token prediction): each micro-batch's
    gradient summed into an fp32 buffer, then all-gathered over the embedding group (the two stages) and
    the peer's added: the buffer, the two gathered and the sum (``TiedEmbeddingGradSync``)."""
    if not (c.tie_embeddings or c.mtp_num_layers):
        return 0.0, 0.0
    return 4 * word, 4 * 4 * word


def layer_local_parameters(c: GPTConfig, tp: int) -> list[float]:
    """Each decoder layer's parameters on one TP rank, routed experts left out (they are planned apart): its
    sharded ones / tp and its replicated ones whole."""
    out = []
    for i in range(c.num_layers):
        total, replicated, experts = layer_parameters(c, i)
        out.append((total - experts - replicated) / tp + replicated)
    return out


def largest_layer(c: GPTConfig, tp: int) -> tuple[float, float]:
    """(the largest decoder layer's sharded parameters on one TP rank, those with its replicated ones), routed
    experts among the sharded: the unit a ZeRO buffer holds, for a hybrid stack whose layers differ."""
    return max(((t - r) / tp, (t - r) / tp + r) for t, r, _ in map(lambda i: layer_parameters(c, i),
                                                                   range(c.num_layers)))


def pipeline_plan(config: GPTConfig, layers: list[list[range]], *, total: int, replicated: int, tp: int,
                  act: dict, state_of, expert_states: tuple, psi_experts: float, m: int, micro_batch_size: int,
                  seq_length: int, sequence_parallel: bool, precision: str) -> tuple[dict, dict]:
    """Per-stage parameters, model states and activations in flight, the bubble and p2p bytes; and
    the largest stage (its dict). ``layers[stage][chunk]`` from :func:`stage_layers`; ``total`` the
    dense parameters; ``state_of(psi)`` a stage's dense (weights, grads, optimizer) bytes;
    ``expert_states`` / ``psi_experts`` those of an average stage's routed experts (the model's over
    pp), which each stage holds in proportion to its mixture layers (the last stage's multi-token prediction
    layers among them). ``total`` and ``replicated`` include the prediction depths, which the last stage
    holds beside a copy of the word embedding (their input; tied, it is the head's copy as well)."""
    c = config
    L, h, pp, v = c.num_layers, c.hidden_size, len(layers), len(layers[0])
    norm = h * (2 if c.normalization == "layernorm" else 1)
    pos = c.max_position_embeddings * h if c.position_embedding_type == "learned" else 0
    word = c.padded_vocab_size * h / tp
    mtp_all, mtp_replicated, mtp_experts = mtp_parameters(c)
    mtp_local = (mtp_all - mtp_experts - mtp_replicated) / tp + mtp_replicated
    total, replicated = total - (mtp_all - mtp_experts), replicated - mtp_replicated  # the decoder layers'
    mtp_moe = c.mtp_num_layers if mtp_experts else 0
    layer = (total - replicated - embedding_params(c)) / L / tp + (replicated - pos - norm) / L
    dense_mlp, mixture = mlp_parameters(c)
    # TP-local: the router (and the shared expert's gate) whole on every rank, the rest sharded
    gate = bool(c.moe_shared_expert_gate and c.moe_shared_expert_intermediate_size)
    router = (c.hidden_size + (1 if c.moe_router_bias else 0)) * (c.num_experts or 0) + c.hidden_size * gate
    dense_mlp, mixture = dense_mlp / tp, (mixture - router) / tp + router if mixture else 0.0
    moe_total = moe_layers(c)
    own = None if uniform_layers(c) else layer_local_parameters(c, tp)
    stages, worst = [], None
    for r, chunks in enumerate(layers):
        n = sum(len(rg) for rg in chunks)
        numbers = [i for rg in chunks for i in rg]
        here = sum(c.is_moe_layer(i) for i in numbers)
        if own is not None:  # a hybrid stack: its layers' own parameters
            params = float(sum(own[i] for i in numbers))
        else:  # the average layer, corrected for the stage's mixtures (a pattern puts dense layers where it says)
            params = n * layer + (here - n * moe_total / L) * (mixture - dense_mlp)
        ends = []
        if r == 0:
            params += word + pos
            ends.append("embedding")
        if r == pp - 1:
            params += norm + word  # the head: its own weight, or the tied copy of the embedding
            ends.append("head")
            if c.mtp_num_layers:  # the depths, and the embedding's copy they read (tied: the head's)
                params += mtp_local + (0 if c.tie_embeddings else word)
                ends.append(f"{c.mtp_num_layers} MTP")
        acts, in_flight = _stage_activations(act, n=n, moe=here, moe_share=moe_total / L, r=r, pp=pp, v=v, m=m,
                                             numbers=numbers)
        # of the average stage's experts (the model's, the prediction depths' included, over pp)
        held = here + (mtp_moe if r == pp - 1 else 0)
        share = held * pp / (moe_total + mtp_moe) if moe_total + mtp_moe else 0.0
        states = with_experts(state_of(params), tuple(x * share for x in expert_states))
        stash, sync = _embedding_sync(c, word) if r in (0, pp - 1) else (0.0, 0.0)
        st = dict(stage=r, layers=n, moe_layers=here, mtp_layers=c.mtp_num_layers if r == pp - 1 else 0, layer_ranges=[(rg.start, rg.stop) for rg in chunks],
                  ends=f" + {' + '.join(ends)}" if ends else "", params=params + psi_experts * share,
                  expert_params=psi_experts * share, states=states, activations=acts, in_flight=in_flight,
                  embedding_stash=stash, embedding_sync=sync, total=sum(states) + max(acts + stash, sync))
        stages.append(st)
        if worst is None or st["total"] > worst["total"]:
            worst = st
    boundary = DTYPE_BYTES[precision] * seq_length * micro_batch_size * h / (tp if sequence_parallel else 1)
    info = dict(v=v, microbatches=m, bubble=(pp - 1) / (v * m), p2p_bytes_per_step=2 * m * v * boundary,
                boundary_bytes=boundary, stages=stages, worst_stage=worst["stage"])
    return info, worst
