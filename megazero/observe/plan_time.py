"""Predicted step time of a layout, as a sum of terms one can read.

Per pipeline stage and micro-batch (the slowest stage sets the pace):

- **compute**: forward + backward (twice forward) of the stage's layers, head and multi-token prediction
  depths. Each GEMM class (attention projections, attention core, dense MLP, routed experts, logits) runs
  at ``GEMM_EFFICIENCY`` x peak, reduced along each of its three dimensions d by ``d / (d + GEMM_HALF_DIM)``
  (small GEMMs fill the tensor cores worse); flash-style attention computes the causal half of the square
  (with Megatron's dropout too, at any cp: the fused kernels draw it), the math kernel the whole of it.
  Attention dropout keyed by position (``--dropout-rng position``) runs the explicit formula in tiles at
  any cp: the causal half in full fp32 (``MATH_FP32_SHARE`` of the TF32 peak) and ``KEYED_BYTES_PER_SCORE``
  through HBM per score (the scores, their exponentials and each mask's 32-bit hash). Each layer adds
  ``LAYER_OVERHEAD_S`` per micro-batch in forward (twice in backward) for its kernels' launches and tails,
  which weigh on small micro-batches. Memory-bound work
  (norms, activations, dropout, softmax, the loss) moves ``ELEMENTWISE_PASSES`` x the bytes a layer keeps
  for backward (the planner's activation formula) through HBM, twice that in backward.
- **recompute**: full recompute runs each layer's forward again, selective the attention core.
- **tp** / **ep**: the tensor-parallel collectives and the experts' all-to-alls are on the critical path
  (megazero does not overlap them); **cp**: the ring's exchange hides behind the attention core's compute
  (all-to-all and all-gather exchanges do not).
- **bubble**: (pp - 1) / v of one micro-batch's stage time (Narayanan et al. 2021, Sec. 2.2);
  **pp**: the boundary sends and receives, each micro-batch, each chunk.
- **dp**: ZeRO's traffic. ZeRO-0/1 reduce once after backward and ZeRO-1/2 gather the weights after the
  step, both exposed; ZeRO-2/3 reduce-scatter each micro-batch's gradients during its backward, ZeRO-3
  prefetches its gathers during forward and backward: overlapped, such traffic costs what exceeds the
  compute it hides behind, plus ``OVERLAP_SLOWDOWN`` of the hidden part (NCCL kernels share the SMs).
  Muon adds its exchange to and from the matrices' owners.
- **optimizer**: the step over the rank's partition, memory-bound (``OPTIMIZER_BYTES`` per parameter), plus
  Newton-Schulz for Muon over the matrices the rank owns, plus the host round trip under optimizer offload.

Collectives cost their bytes sent per rank (:mod:`.planner_traffic`, the bytes the rehearsal counts) over the
group's bus bandwidth (:mod:`.plan_devices`: NVLink inside a node, the NIC across nodes) plus a latency per
call. ``GEMM_EFFICIENCY`` is calibrated on one published point, the 1.7B row of Narayanan et al. 2021, Table 1
(137 TFLOP/s per A100); the other constants are fixed by hand and the same for every device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megazero.model.config import GPTConfig
from megazero.model.flops import (
    _mtp_flops_per_token,
    attention_matrices,
    attention_square_flops_per_token,
    expert_parameters,
    moe_layers,
    uniform_layers,
)
from megazero.model.layer_pattern import RECURRENT_MIXERS
from megazero.model.recurrent.counts import GDN_CHUNK, SSD_CHUNK, recurrent_matrices, scan_flops_per_token
from megazero.observe.plan_devices import Cluster
from megazero.observe.planner import MemoryEstimate
from megazero.observe.planner_activations import activation_bytes_per_layer, layer_activation_bytes
from megazero.observe.planner_offload import DTYPE_BYTES

__all__ = ["Layout", "StepTime", "step_time", "attention_kernel", "TIME_TERMS", "GEMM_EFFICIENCY"]

GEMM_EFFICIENCY = 0.780  # of peak for large GEMMs; calibrated: Narayanan et al. 2021 Table 1, 1.7B row
GEMM_HALF_DIM = 48  # a GEMM dimension this long halves the efficiency along it (tensor-core tiles)
LAYER_OVERHEAD_S = 2e-4  # per layer and micro-batch, forward (twice that backward): the ~30 kernels' launch and tails
ELEMENTWISE_PASSES = 2.0  # bytes moved through HBM per byte of saved activation, forward
OVERLAP_SLOWDOWN = 0.1  # what overlapped communication still costs, as a share of its time
LATENCY_S = (10e-6, 25e-6)  # per collective call: inside a node, across nodes
OPTIMIZER_BYTES = 34.0  # AdamW over an fp32 partition: read master, grad, m, v and write master, m, v, weight
HOST_ADAM_PARAMS_PER_S = 1e9  # CPU Adam (DeepSpeed-style, a GPU's share of the host's cores)
MATH_FP32_SHARE = 1 / 8  # full fp32 (torch's default, no TF32) per TF32 peak: A100 19.5 / 156, H100 67 / 495 TFLOP/s
# HBM bytes per score element of the keyed tiles, forward: a third of the ~600 that forward and backward move
# (the time model's backward is twice forward): the mask's hash twice (~220 each: ten int64 passes of xor,
# shift, multiply), the scores, their exponentials and the dropout factors (~160).
KEYED_BYTES_PER_SCORE = 200.0

TIME_TERMS = ("compute", "recompute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer")


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel sizes and the memory/speed switches ``pretrain_gpt.py`` takes."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel (None: tp)
    vpp: int = 1
    zero_stage: int = 1
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None, "selective", "full"
    micro_batch_size: int = 1
    offload_optimizer: bool = False
    first_stage_layers: Optional[int] = None  # Megatron's uneven split: the first and last stages' layers
    last_stage_layers: Optional[int] = None

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


@dataclass
class StepTime:
    """Seconds per step by term (:data:`TIME_TERMS`), summing to ``total``; and the slowest stage."""

    terms: dict = field(default_factory=dict)
    slowest_stage: int = 0
    microbatches: int = 1

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def _f(d: float) -> float:
    return d / (d + GEMM_HALF_DIM)


def _gemm(flops: float, m: float, n: float, k: float, peak: float) -> float:
    """Seconds of a GEMM of ``flops`` FLOPs with dimensions m x n x k at ``peak`` FLOP/s."""
    if flops <= 0:
        return 0.0
    return flops / (peak * GEMM_EFFICIENCY * _f(m) * _f(max(n, 1)) * _f(max(k, 1)))


def attention_kernel(c: GPTConfig, flash_attn: bool) -> str:
    """The kernel a training step's attention core runs: 'keyed' (attention dropout keyed by position: the
    explicit formula in tiles, at any cp), 'flash' (flash-attn or torch's fused ops, which draw Megatron's
    dropout themselves at any cp) or 'math' (``--attention-backend unfused``)."""
    if c.dropout_rng == "position" and c.attention_dropout > 0:
        return "keyed"
    return "flash" if flash_attn else "math"


def _attention_core(c: GPTConfig, kernel: str, *, tokens: int, seq: int, t: int, peak: float, fp32: float,
                    hbm: float, act_bytes: int) -> float:
    """Forward seconds of the attention core of ``tokens`` queries over sequences ``seq`` long on ``t`` TP ranks:
    q k^T and p v per head over the s x s square (flash and keyed: the causal half, a sliding layer's window
    only; the explicit formula masks the window, computing the whole square) and the kernel's passes."""
    full = c.replace(window_size=None, window_attn_skip_freq=None)
    square = tokens * attention_square_flops_per_token(c if kernel != "math" else full, seq) / t
    scores = square / (2 * (c.qk_dim + c.v_dim))  # elements of the square the kernel computes
    d = min(c.qk_dim, c.v_dim)
    if kernel == "keyed":
        return _gemm(square / 2, seq, seq, d, fp32 * MATH_FP32_SHARE) + KEYED_BYTES_PER_SCORE * scores / 2 / hbm
    if kernel == "flash":
        return _gemm(square / 2, seq, seq, d, peak)
    return _gemm(square, seq, seq, d, peak) + ELEMENTWISE_PASSES * (2 * act_bytes + 1) * scores / hbm  # its softmax


def _layer_forward(c: GPTConfig, lay: Layout, *, tokens: int, seq: int, moe: bool, peak: float, fp32: float,
                   hbm: float, kernel: str, act_bytes: int) -> tuple[float, float]:
    """(forward seconds of one layer on one rank, of which the attention core) for ``tokens`` tokens of
    sequences ``seq`` long (the whole sequence: CP splits the tokens, not the keys); ``kernel``: the
    attention core's (:func:`attention_kernel`)."""
    h, t = c.hidden_size, lay.tp
    proj = sum(r * k for r, k in attention_matrices(c))
    time = _gemm(2 * tokens * proj / t, tokens, proj / h / t, h, peak)
    core = _attention_core(c, kernel, tokens=tokens, seq=seq, t=t, peak=peak, fp32=fp32, hbm=hbm,
                           act_bytes=act_bytes)
    time += _mlp_forward(c, lay, tokens=tokens, moe=moe, peak=peak)
    kind = c.replace(moe_layer_freq=1) if moe else c.replace(num_experts=None)
    saved = activation_bytes_per_layer(kind, micro_batch_size=1, seq_length=tokens, tp=t,
                                       sequence_parallel=lay.sequence_parallel and t > 1, keep_attention_scores=False,
                                       act_bytes=act_bytes, expert_tp=lay.etp)
    return time + core + ELEMENTWISE_PASSES * saved / hbm + LAYER_OVERHEAD_S, core


def _mlp_forward(c: GPTConfig, lay: Layout, *, tokens: int, moe: bool, peak: float) -> float:
    """Forward seconds of one layer's MLP (a mixture's experts, shared expert and router) on one rank."""
    h, t, gate = c.hidden_size, lay.tp, 2 if c.gated_linear_unit else 1
    if not moe:
        f = c.ffn_size
        return _gemm(2 * tokens * (gate + 1) * h * f / t, tokens, gate * f / t, h, peak)
    fm, k, experts = c.moe_ffn_size, c.moe_router_topk, c.num_experts
    etp = lay.etp or t
    per_expert = max(tokens * k * lay.ep / experts * t / etp, 1.0)  # tokens a local expert gets
    time = _gemm(2 * tokens * k * (gate + 1) * h * fm / t, per_expert, gate * fm / etp, h, peak)
    shared = c.moe_shared_expert_intermediate_size or 0
    time += _gemm(2 * tokens * (gate + 1) * h * shared / t, tokens, gate * shared / t, h, peak)
    return time + _gemm(2 * tokens * h * experts, tokens, experts, h, peak)  # the router, whole on each rank


def _kinds_forward(c: GPTConfig, lay: Layout, number: int, *, tokens: int, seq: int, peak: float, fp32: float,
                   hbm: float, kernel: str, act_bytes: int) -> tuple[float, float]:
    """(forward seconds of layer ``number`` of a hybrid stack on one rank, of which an attention core): its mixer
    (attention: projections and core; a recurrent mixer: projections and the chunked scan's matmuls, chunk-sized
    GEMMs, with no term in the sequence) and its MLP, each only where the layer has it."""
    h, t = c.hidden_size, lay.tp
    kinds = c.layer_kinds(number)
    time = core = 0.0
    if kinds.mixer in RECURRENT_MIXERS:
        proj = sum(r * k for r, k in recurrent_matrices(c, kinds.mixer))
        chunk, width = (SSD_CHUNK, c.mamba_state_dim) if kinds.mixer == "mamba" else (GDN_CHUNK, c.linear_key_head_dim)
        time += _gemm(2 * tokens * proj / t, tokens, proj / h / t, h, peak)
        time += _gemm(tokens * scan_flops_per_token(c, kinds.mixer) / t, chunk, chunk, width, peak)
    elif kinds.mixer is not None:
        proj = sum(r * k for r, k in attention_matrices(c))
        time += _gemm(2 * tokens * proj / t, tokens, proj / h / t, h, peak)
        core = _attention_core(c, kernel, tokens=tokens, seq=seq, t=t, peak=peak, fp32=fp32, hbm=hbm,
                               act_bytes=act_bytes)
    if kinds.mlp is not None:
        time += _mlp_forward(c, lay, tokens=tokens, moe=kinds.mlp == "moe", peak=peak)
    saved = layer_activation_bytes(c, number, micro_batch_size=1, seq_length=tokens, tp=t, cp=lay.cp,
                                   sequence_parallel=lay.sequence_parallel and t > 1, keep_attention_scores=False,
                                   act_bytes=act_bytes, expert_tp=lay.etp)
    return time + core + ELEMENTWISE_PASSES * saved / hbm + LAYER_OVERHEAD_S, core


def _exposed(comm: float, window: float) -> float:
    """What communication of ``comm`` seconds overlapped with ``window`` seconds of compute adds."""
    return max(comm - window, 0.0) + OVERLAP_SLOWDOWN * min(comm, window)


def _comm(cluster: Cluster, kind: str, lay: Layout, sent: float, calls: float) -> float:
    """Seconds to send ``sent`` bytes in ``calls`` collectives over the layout's ``kind`` groups."""
    if sent <= 0:
        return 0.0
    inter = cluster.crosses_nodes(kind, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, etp=lay.etp)
    gbps = cluster.device.inter_node_gbps if inter else cluster.device.intra_node_gbps
    return sent / (gbps * 1e9) + calls * LATENCY_S[inter]


def _stage(c: GPTConfig, lay: Layout, cluster: Cluster, st: dict, layer: dict, *, first: bool, last: bool, m: int,
           precision: str, ring: bool) -> dict:
    """One stage's per-micro-batch seconds: fwd, bwd, recompute, tp, cp, ep (``st``: the planner's stage;
    ``layer``: forward seconds of a dense and a mixture layer and of their attention cores; ``ring``: the
    context-parallel exchange is the ring, which overlaps the attention core)."""
    peak, hbm = cluster.device.peak(precision), cluster.device.hbm_gbps * 1e9
    e = DTYPE_BYTES[precision]
    tokens = lay.micro_batch_size * c.seq_length // lay.cp
    n, n_moe = st["layers"], st["moe_layers"]
    if "by_layer" in layer:  # a hybrid stack: the stage's own layers
        mine = [i for a, b in st.get("layer_ranges", [(0, c.num_layers)]) for i in range(a, b)]
        layers_f = sum(layer["by_layer"][i][0] for i in mine)
        cores = sum(layer["by_layer"][i][1] for i in mine)
    else:
        layers_f = (n - n_moe) * layer["dense"] + n_moe * layer["moe"]
        cores = (n - n_moe) * layer["dense_core"] + n_moe * layer["moe_core"]
    fwd = layers_f
    if last:
        V, h = c.padded_vocab_size, c.hidden_size
        fwd += _gemm(2 * tokens * h * V / lay.tp, tokens, V / lay.tp, h, peak)
        fwd += ELEMENTWISE_PASSES * (4 + e) * tokens * V / lay.tp / hbm  # the loss's softmax
        fwd += _gemm(tokens * _mtp_flops_per_token(c, c.seq_length) / lay.tp, tokens, c.ffn_size / lay.tp, h, peak)
    recompute = {"full": layers_f, "selective": cores}.get(lay.recompute or "", 0.0)
    traffic = st["traffic"]
    calls = 6 if lay.recompute == "full" else 4  # collectives per layer and micro-batch (with recompute's)
    tp = _comm(cluster, "tp", lay, traffic["tp"] / m, calls * (n + c.mtp_num_layers * last) + 2 * (first + last))
    cp = _comm(cluster, "cp", lay, traffic["cp"] / m, 2 * n * max(lay.cp - 1, 1))
    if ring:
        cp = _exposed(cp, 3 * cores)
    ep = _comm(cluster, "ep", lay, traffic["ep"] / m, calls * n_moe)
    return dict(fwd=fwd, bwd=2 * fwd, recompute=recompute, tp=tp, cp=cp, ep=ep)


def _matrices(c: GPTConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(a layer's attention and dense MLP matrices, one routed expert's), whole (before TP), as Muon
    orthogonalizes them (Q, K and V apart)."""
    h, gate = c.hidden_size, 2 if c.gated_linear_unit else 1
    mlp = [(gate * c.ffn_size, h), (h, c.ffn_size)]
    expert = [(gate * c.moe_ffn_size, h), (h, c.moe_ffn_size)] if c.num_experts else []
    return attention_matrices(c) + mlp, expert


def _optimizer(c: GPTConfig, lay: Layout, cluster: Cluster, est: MemoryEstimate, stage: dict, optimizer: str,
               precision: str, zdp: int, edp: int) -> tuple[float, float]:
    """(optimizer seconds, Muon exchange seconds) of a rank of ``stage``: its partition of the stage's
    dense parameters (over data x context) and routed experts (over expert data parallel)."""
    from megazero.zero.matrix_exchange import ns_cost
    from megazero.zero.optimizers import component

    experts = stage["expert_params"]
    dense = stage["params"] - experts
    zdp, edp = (zdp, edp) if lay.zero_stage else (1, 1)
    local = dense / zdp + experts / edp
    seconds = OPTIMIZER_BYTES * local / (cluster.device.hbm_gbps * 1e9)
    if lay.offload_optimizer:  # fp32 gradients down, weights up, the step on the host
        seconds = local * (4 + DTYPE_BYTES[precision]) / (cluster.device.pcie_gbps * 1e9) \
            + local / HOST_ADAM_PARAMS_PER_S
    if not component(optimizer).per_matrix:
        return seconds, 0.0
    # Newton-Schulz once per whole matrix, the owners spread over the partitioning's ranks (ZeRO-0: every
    # rank runs all of them); each holder sends its fp32 part to the owner and gets the update back.
    layer, expert = _matrices(c)
    dense_ns = stage["layers"] * sum(2 * ns_cost(m) for m in layer) / zdp
    expert_ns = stage["moe_layers"] * c.num_experts * sum(2 * ns_cost(m) for m in expert) / (edp * lay.ep) \
        if expert else 0.0
    seconds += (dense_ns + expert_ns) / (cluster.device.peak("fp32") * GEMM_EFFICIENCY)
    kind = "dp_cp" if lay.cp > 1 else "dp"
    exchange = _comm(cluster, kind, lay, 2 * 4 * dense / zdp * (zdp - 1) / zdp, 2) \
        + _comm(cluster, "edp", lay, 2 * 4 * experts / edp * (edp - 1) / edp, 2)
    return seconds, exchange


def step_time(config: GPTConfig, lay: Layout, cluster: Cluster, est: MemoryEstimate, *, global_batch_size: int,
              precision: str = "bf16", flash_attn: bool = True, optimizer: str = "adamw",
              cp_comm_type: str = "p2p") -> StepTime:
    """The predicted step time of ``lay`` on ``cluster`` (``est``: the planner's memory estimate of the same
    plan, whose per-stage layers and bytes sent it reads)."""
    c = config
    m = max(global_batch_size // (lay.micro_batch_size * lay.dp), 1)
    experts = expert_parameters(c) / ((lay.etp or lay.tp) * lay.ep)
    stages = est.pipeline["stages"] if est.pipeline else [dict(
        layers=c.num_layers, moe_layers=moe_layers(c), traffic=est.traffic, params=est.params_per_rank,
        expert_params=experts)]
    kw = dict(tokens=lay.micro_batch_size * c.seq_length // lay.cp, seq=c.seq_length,
              peak=cluster.device.peak(precision), fp32=cluster.device.peak("fp32"), hbm=cluster.device.hbm_gbps * 1e9,
              kernel=attention_kernel(c, flash_attn), act_bytes=DTYPE_BYTES[precision])
    if uniform_layers(c):
        layer = dict(zip(("dense", "dense_core"), _layer_forward(c, lay, moe=False, **kw)))
        layer.update(zip(("moe", "moe_core"), _layer_forward(c, lay, moe=True, **kw) if moe_layers(c) else (0.0, 0.0)))
    else:  # each kind of layer timed once
        by_kind: dict = {}
        for i in range(c.num_layers):
            by_kind.setdefault(c.layer_kinds(i), i)
        timed = {kinds: _kinds_forward(c, lay, i, **kw) for kinds, i in by_kind.items()}
        layer = dict(by_layer=[timed[c.layer_kinds(i)] for i in range(c.num_layers)])
    per, seen = [], {}
    for r, st in enumerate(stages):  # stages alike in layers, ends and bytes sent cost alike
        key = (st["layers"], st["moe_layers"], r == 0, r == len(stages) - 1, tuple(sorted(st["traffic"].items())),
               tuple(st.get("layer_ranges", ())) if "by_layer" in layer else ())
        if key not in seen:
            seen[key] = _stage(c, lay, cluster, st, layer, first=key[2], last=key[3], m=m, precision=precision,
                               ring=cp_comm_type == "p2p")
        per.append(seen[key])
    busy = [sum(p.values()) for p in per]
    slow = max(range(len(per)), key=busy.__getitem__)
    s = per[slow]
    terms = {"compute": m * (s["fwd"] + s["bwd"]), "recompute": m * s["recompute"], "tp": m * s["tp"],
             "cp": m * s["cp"], "ep": m * s["ep"], "bubble": (lay.pp - 1) / lay.vpp * busy[slow]}
    traffic = stages[slow]["traffic"]
    terms["pp"] = _comm(cluster, "pp", lay, traffic["pp"], 2 * m * lay.vpp) if lay.pp > 1 else 0.0
    zdp = lay.dp * lay.cp
    edp = max(est.plan.get("edp", zdp), 1)
    backward, both = m * s["bwd"], m * (s["fwd"] + s["bwd"])
    kind = "dp_cp" if lay.cp > 1 else "dp"
    dp = 0.0
    for group, key, n in ((kind, "dp", zdp), ("edp", "edp", edp)):
        reduce_ = _comm(cluster, group, lay, traffic[f"{key}_reduce"], 1 + (m if lay.zero_stage >= 2 else 0))
        gather = _comm(cluster, group, lay, traffic[f"{key}_all_gather"], 1 + (2 * m if lay.zero_stage == 3 else 0))
        dp += _exposed(reduce_, backward) if lay.zero_stage >= 2 else reduce_
        dp += _exposed(gather, both) if lay.zero_stage == 3 else gather
    opt, exchange = _optimizer(c, lay, cluster, est, stages[slow], optimizer, precision, zdp, edp)
    terms["dp"], terms["optimizer"] = dp + exchange, opt
    return StepTime(terms={k: terms[k] for k in TIME_TERMS}, slowest_stage=slow, microbatches=m)
