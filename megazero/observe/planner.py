"""Per-GPU memory estimate of a GPT training plan (tp x dp x ZeRO stage x recompute).

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", Sec. 3.1 and Fig. 1),
with Psi the parameters a rank holds after tensor parallelism (Psi_local: TP-sharded
weights / tp + replicated weights such as norms, row-parallel biases and the
position table), N_d the data-parallel size and K = 12 for mixed-precision Adam:

    stage 0  (2 + 2 + K) Psi            stage 2  2 Psi + (2 + K) Psi / N_d
    stage 1  2 Psi + 2 Psi + K Psi / N_d stage 3  (2 + 2 + K) Psi / N_d

(fp32 training: 4 + 4 + 8, the master weights being the weights themselves). Multi-latent
attention's down-projections and their norms are replicated over TP, its up-projections sharded;
multi-token prediction's depths live on the last stage, beside a copy of the word embedding
(the parameter counts: :mod:`megazero.model.flops`). A hybrid stack's layers (recurrent, one-part) are
planned layer by layer, the recurrent mixers' own by :mod:`megazero.observe.planner_recurrent`.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sec. 4: per layer, with 16-bit activations,

    no parallelism          s b h (34 + 5 a s / h)
    tensor parallel t       s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence par.  s b h (34/t + 5 a s / (h t))

selective recompute (and flash attention) drop the 5as/h term (the s x s attention
scores, softmax and its dropout); full recompute keeps each layer's input, 2sbh
(/t with SP), plus one recompute chunk's full activations while it is re-run.
Outside the layers: the embedding dropout mask, the final norm and output-layer
inputs and the fp32 logits of the loss, 4 s b V / t bytes.

Pipeline parallelism (pp stages, v chunks per rank, m micro-batches per step) is
planned per stage and the largest stage is reported (:mod:`megazero.observe.planner_stages`):
a stage holds the layers training's split gives it (even, or Megatron's uneven first and
last stages) with its own dense and mixture layers, the first also the embedding (and
position table), the last the final norm and the head (with tied embeddings or multi-token prediction, a copy of
the word embedding, whose gradient the two stages exchange after backward: an fp32 buffer through
backward, then four of them at the exchange, which can be the stage's peak). Under 1F1B stage r keeps min(pp - r, m) micro-batches' activations (the first stage pp);
under interleaving the first stage keeps (pp - 1) * 2 + (v - 1) * pp + 1 chunk
micro-batches of L / (pp v) layers, i.e. L (1 + (pp - 1) / (pp v)) layers' worth
(Korthikanti et al. 2022, Sec. 4.2.3). The bubble is (pp - 1) / (v m) of the ideal
step time; PP traffic per GPU per step is each micro-batch's boundary activation
[s(/t under SP), b, h] sent forward and its gradient sent back, on each of v chunks (the first
stage's first chunk sends no gradient back, the last stage's last chunk no activation on). Bytes
sent per group (data, expert data, tensor, context parallel, the experts' all-to-alls, pipeline)
are planned per stage: :mod:`megazero.observe.planner_traffic`.

What a GPU run adds beyond its tensors (:mod:`megazero.observe.gpu_overheads`): the NCCL
communicators' buffers, an estimate per communicator from NCCL's defaults times the communicators
of more than one rank a rank joins (``nccl``, in ``device_total`` and the fit verdict, not in
``total``), and the data loader's pinned batches as torch's caching host allocator rounds them
(``host_pinned_batches``); the offloads' host memory is exact (one exact-size registered
allocation per offload object). Not counted: the CUDA context and allocator fragmentation
(typically 1-3 GiB). GPU capacities are in GiB (2**30 bytes), which
is what an "80 GB" GPU has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from megazero.model.config import GPTConfig
from megazero.model.flops import (
    expert_parameters,
    flops_per_iteration,
    moe_layers,
    mtp_parameters,
    num_parameters,
    replicated_parameters,
    uniform_layers,
)
from megazero.observe.gpu_overheads import (
    HOST_MEMORY_NOTE,
    NCCL_COMMUNICATOR_BYTES,
    gradient_communicator_note,
    loader_pinned_bytes,
    nccl_communicators,
    nccl_line,
)
from megazero.observe.planner_activations import _activations, _gathered_kv, activation_bytes_per_layer
from megazero.observe.planner_offload import DTYPE_BYTES as _DTYPE_BYTES
from megazero.observe.planner_offload import offloaded_bytes, offloaded_param_bytes
from megazero.observe.planner_stages import STATE_BYTES as _STATE_BYTES
from megazero.observe.planner_stages import embedding_params as _embedding_params
from megazero.observe.planner_stages import largest_layer, model_state_bytes, pipeline_plan, stage_layers
from megazero.observe.planner_stages import with_experts as _with_experts
from megazero.observe.planner_traffic import traffic_bytes_per_step

if TYPE_CHECKING:
    from megazero.config.train_config import TrainConfig

__all__ = ["traffic_bytes_per_step", "MemoryEstimate", "estimate_memory", "estimate_memory_for", "model_state_bytes",
           "offloaded_bytes", "offloaded_param_bytes", "plan_of", "TRAFFIC_LABELS",
           "activation_bytes_per_layer", "replicated_parameters", "GiB"]

GiB = 2 ** 30
# The groups of ``MemoryEstimate.traffic``, as the plan names them (the rehearsal's groups: dp or dp_cp,
# edp, tp, cp or hcp_a2a + hcp_p2p, ep or expert, pp).
TRAFFIC_LABELS = (("dp", "data parallel"), ("edp", "expert data parallel"), ("tp", "tensor parallel"),
                  ("cp", "context parallel"), ("ep", "expert-parallel all-to-all"), ("pp", "pipeline"))

@dataclass
class MemoryEstimate:
    """Bytes per GPU (floats: partitions are averaged over ranks) and the plan they are for."""

    params: float  # model weights
    grads: float  # gradients
    optimizer: float  # optimizer states (fp32 master + Adam moments)
    activations: float  # saved activations of one micro-batch, incl. logits
    buffers: float  # ZeRO-3 gathered-parameter working set (0 for stages 0-2)
    params_total: int  # parameters of the whole model
    params_per_rank: float  # Psi_local: parameters on one rank after TP (before ZeRO)
    flops_per_iteration: Optional[float] = None  # training FLOPs of one global batch (Narayanan 2021 Eq. 3)
    plan: dict = field(default_factory=dict)  # the inputs, for printing
    activation_detail: dict = field(default_factory=dict)  # per_layer, layers, outside_layers bytes
    pipeline: dict = field(default_factory=dict)  # pp > 1: stages, bubble, p2p bytes per step (see estimate_memory)
    traffic: dict = field(default_factory=dict)  # bytes sent per GPU per step: dp, edp, tp, cp, ep, pp, total
    grad_buckets: float = 0.0  # gradients in flight: autograd's full-size grads of a unit + reduce buckets
    # Optimizer offload (zero_optimization.offload_optimizer): host bytes, not in ``total``.
    host_optimizer: float = 0.0  # offloaded fp32 masters + Adam moments held in host memory (device cpu)
    host_ring: float = 0.0  # the step's ring of host buffers
    nvme: float = 0.0  # the offloaded state's files (device nvme)
    # Parameter offload (zero_optimization.offload_param, ZeRO-3): host bytes, not in ``total``.
    host_params: float = 0.0  # parameter partitions in host memory (aliased fp32 masters excluded)
    host_param_ring: float = 0.0  # the buffers NVMe parameter reads go through
    nvme_params: float = 0.0  # the parameter files
    # What a GPU run adds (megazero.observe.gpu_overheads): NCCL communicators a rank of the
    # largest stage joins (name -> count; estimated bytes each), and the loader's pinned batches.
    nccl_communicators: dict = field(default_factory=dict)
    nccl_note: str = ""  # what the count says of ZeRO-3's gradient communicator
    host_pinned_batches: float = 0.0  # the data loader's pinned batches, rounded as the caching allocator holds them
    # pp > 1, tied or multi-token prediction: the word embedding's gradient shared by the first and last
    # stage, its fp32 sum through backward and the exchange after it (the largest stage's)
    embedding_stash: float = 0.0
    embedding_sync: float = 0.0
    # --async-save: one staged copy of the rank's fp32 master and Adam moments partitions in host memory,
    # from the save until its background write ends (not in ``host_total``: it comes and goes with saves)
    host_checkpoint: float = 0.0

    @property
    def nccl(self) -> float:
        """Device bytes of the NCCL communicators: their number x ``NCCL_COMMUNICATOR_BYTES`` (an estimate)."""
        return float(sum(self.nccl_communicators.values()) * NCCL_COMMUNICATOR_BYTES)

    @property
    def device_total(self) -> float:
        """``total`` (the tensors) plus the NCCL communicators' estimate: what the fit verdict uses."""
        return self.total + self.nccl

    @property
    def host_total(self) -> float:
        return self.host_optimizer + self.host_ring + self.host_params + self.host_param_ring

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The tensors at the step's peak: the states, and the activations with the gradients in flight (or
        the shared embedding's gradient exchange after backward, when larger)."""
        transient = max(self.activations + self.grad_buckets + self.embedding_stash, self.embedding_sync)
        return self.params + self.grads + self.optimizer + self.buffers + transient

    def fits(self, gpu_memory_gib: float) -> bool:
        """Whether ``device_total`` (tensors and NCCL's estimate) is within ``gpu_memory_gib`` GiB."""
        return self.device_total <= gpu_memory_gib * GiB

    def to_text(self, gpu_memory_gib: Optional[float] = None) -> str:
        """A small table (GiB) with the parameter count, FLOPs and, given a capacity, the verdict."""
        p = self.plan
        rows = [("weights", self.params), ("gradients", self.grads), ("optimizer states", self.optimizer),
                ("activations", self.activations)]
        if self.buffers:
            rows.append(("ZeRO-3 gather buffers", self.buffers))
        if self.grad_buckets:
            rows.append(("gradients in flight", self.grad_buckets))
        if self.embedding_sync:
            rows.append(("embedding grad buffer", self.embedding_stash))
            rows.append(("(its exchange, after)", self.embedding_sync))
        rows.append(("total", self.total))
        host = [(name, v) for name, v in (("offloaded optimizer", self.host_optimizer),
                                          ("offload ring buffers", self.host_ring),
                                          ("offloaded parameters", self.host_params),
                                          ("parameter read buffers", self.host_param_ring)) if v]
        if host or self.nvme or self.nvme_params:
            host.append(("host total", self.host_total))
        lines = [
            f"parameters: {self.params_total:,} ({self.params_total / 1e9:.2f}B); "
            f"per GPU after TP: {self.params_per_rank:,.0f}",
            f"plan: tp {p.get('tp')} x "
            + (f"cp {p.get('cp')} (each rank's activations for seq / cp) x " if p.get("cp", 1) > 1 else "")
            + f"dp {p.get('dp')} x pp {p.get('pp')}"
            + (f" (experts: etp {p['etp']} x ep {p['ep']} x expert-dp {p['edp']})" if p.get("ep", 1) > 1 else "")
            + f", ZeRO-{p.get('zero_stage')}, "
            f"{p.get('precision')}, micro batch {p.get('micro_batch_size')}, seq {p.get('seq_length')}, "
            f"recompute {p.get('recompute') or 'none'}, sequence parallel {'on' if p.get('sequence_parallel') else 'off'}, "
            f"attention scores {'not held (flash/SDPA kernel)' if p.get('flash_attn') else 'held (math kernel)'}",
        ]
        if self.flops_per_iteration is not None:
            lines.append(f"FLOPs per iteration (global batch {p.get('global_batch_size')}): "
                         f"{self.flops_per_iteration:.4e} ({self.flops_per_iteration / 1e15:,.1f} PFLOP)")
        pl = self.pipeline
        if pl:
            lines.append(f"pipeline: pp {p.get('pp')} x v {pl['v']}, {pl['microbatches']} micro-batches per step, "
                         f"bubble (pp-1)/(v m) = {pl['bubble']:.3f}; p2p sent per GPU per step "
                         f"{pl['p2p_bytes_per_step'] / GiB:.2f} GiB (a middle stage; the end stages send one "
                         f"direction of their end chunk less)")
            worst = pl["stages"][pl["worst_stage"]]
            lines.append(f"largest stage: {worst['stage']} ({worst['layers']} layers, {worst['total'] / GiB:.2f} GiB "
                         f"per GPU, the table below)")
            for st in pl["stages"]:
                spans = ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in st["layer_ranges"] if b > a)
                moe = f", {st['moe_layers']} MoE" if self.plan.get("moe") else ""
                lines.append(f"  stage {st['stage']}: {st['layers']} layers ({spans or 'none'}{moe}){st['ends']}, "
                             f"{st['params']:,.0f} params/GPU, {st['in_flight']} micro-batch(es) in flight, "
                             f"{st['total'] / GiB:.2f} GiB, sends {st['traffic']['total'] / GiB:.2f} GiB per step")
        t = self.traffic
        if t:
            sent = [f"{label} {t[key] / GiB:.2f} GiB" for key, label in TRAFFIC_LABELS
                    if key in ("dp", "tp", "pp") or t.get(key)]
            lines.append(f"sent per GPU per step{' (the largest stage)' if pl else ''}: {', '.join(sent)} "
                         f"(total {t['total'] / GiB:.2f} GiB)")
        if self.activation_detail.get("recurrent_state"):  # a hybrid stack's recurrent layers
            state = self.activation_detail["recurrent_state"] / GiB
            lines.append(f"recurrent layers' chunk states: {state:.2f} GiB per micro-batch over all their layers "
                         "(held for backward where not recomputed; counted in the activations)")
        lines.append(f"{'per-GPU memory':<26}{'GiB':>10}")
        lines += [f"  {name:<24}{value / GiB:>10.2f}" for name, value in rows]
        lines.append("  " + nccl_line(self.nccl_communicators, self.nccl_note))
        if self.nccl:
            lines.append(f"  {'total with NCCL':<24}{self.device_total / GiB:>10.2f}")
        if host or self.nvme or self.nvme_params:
            lines.append(f"{'per-rank host memory':<26}{'GiB':>10}")
            lines += [f"  {name:<24}{value / GiB:>10.2f}" for name, value in host]
            for name, value in (("NVMe files, optimizer", self.nvme), ("NVMe files, parameters", self.nvme_params)):
                if value:
                    lines.append(f"  {name:<24}{value / GiB:>10.2f}")
            lines.append(f"  ({HOST_MEMORY_NOTE})")
        if self.host_checkpoint:
            lines.append(f"background checkpoint save (--async-save): {self.host_checkpoint / GiB:.2f} GiB of host "
                         "memory per rank while a save is written (its staged copy)")
        if self.host_pinned_batches:
            lines.append(f"pinned loader batches: {self.host_pinned_batches:,.0f} bytes of host memory "
                         "(torch's caching host allocator rounds each batch up to a power of two)")
        if gpu_memory_gib is not None:
            margin = gpu_memory_gib - self.device_total / GiB
            verdict = "fits" if margin >= 0 else "does NOT fit"
            lines.append(f"GPU memory {gpu_memory_gib:g} GiB: {verdict} "
                         f"({abs(margin):.2f} GiB {'spare' if margin >= 0 else 'over'}; "
                         f"NCCL estimated; CUDA context and fragmentation not counted)")
        return "\n".join(lines)


def estimate_memory(config: GPTConfig, *, tp: int, dp: int, pp: int = 1, zero_stage: int, micro_batch_size: int,
                    seq_length: Optional[int] = None, precision: str = "bf16", recompute: Optional[str] = None,
                    sequence_parallel: bool = False, flash_attn: bool = False,
                    grad_accum_dtype: Optional[str] = None,
                    global_batch_size: Optional[int] = None, virtual_pp: int = 1,
                    num_microbatches: Optional[int] = None, reduce_bucket_size: Optional[float] = None,
                    prefetch_bucket_size: Optional[float] = None, offload_optimizer: str = "none",
                    offload_ratio: float = 1.0, offload_buffer_count: int = 4,
                    offload_buffer_size: Optional[int] = None, offload_param: str = "none",
                    offload_param_max_in_cpu: float = 1e9, offload_param_buffer_count: int = 5,
                    offload_param_buffer_size: Optional[float] = None, keep_gathered: bool = False,
                    num_workers: int = 0, context_parallel: int = 1,
                    cp_comm_type: Union[str, tuple[str, ...]] = "p2p",
                    hierarchical_cp: tuple[int, ...] = (), expert_parallel: int = 1,
                    expert_tensor_parallel: Optional[int] = None, first_stage_layers: Optional[int] = None,
                    last_stage_layers: Optional[int] = None, async_save: bool = False,
                    optimizer: str = "adam") -> MemoryEstimate:
    """Per-GPU memory of training ``config`` under a parallel plan.

    The execution options come from the keyword arguments, not from ``config``'s
    fields (so one config can be evaluated under several plans), except
    ``recompute_method``/``recompute_num_layers``. With ``pp > 1`` every stage is planned
    with the layers training gives it (even, or ``first_stage_layers`` / ``last_stage_layers``
    on the first / last stage, Megatron's ``--decoder-first/last-pipeline-num-layers``;
    ``virtual_pp`` chunks per rank, ``num_microbatches`` per step, default global batch /
    (micro x dp)) and the largest is returned, with all of them in ``.pipeline``.
    ``global_batch_size`` (default micro x dp) sets the FLOPs and m.

    Transients follow the engine (``megazero.zero``): ZeRO-3 holds the unit in use, the
    units prefetched within ``prefetch_bucket_size`` elements (None, the engine's default:
    the next unit), and (tied) the embedding for the output layer; ZeRO-2/3 hold, at the
    step's peak (the start of backward, every activation alive), one unit's full-size
    autograd gradients and one bucket of ``reduce_bucket_size`` (None: a unit; a larger
    unit is a bucket of its own) in the reduction dtype.

    ``offload_optimizer`` (``cpu`` / ``nvme``, with DeepSpeed's ``ratio``, ``buffer_count`` and
    megazero's ``buffer_size``) moves that share of the optimizer states off the device; the host's
    bytes are reported apart (``host_optimizer``, ``host_ring``, ``nvme``), not in ``total``.
    ``offload_param`` (ZeRO-3, ``cpu`` / ``nvme`` with ``max_in_cpu`` and the read buffers) does the
    same for the weight partition (``host_params``, ``host_param_ring``, ``nvme_params``).

    ``optimizer`` (any registered --optimizer value): the state bytes per parameter its component keeps
    (``megazero/zero/optimizers/``): Muon one momentum on the layers' matrices (every routed expert
    weight) and Adam's two moments on the embeddings, output layer, norms and biases (the dense parameters'
    average is used on every stage).
    ``async_save``: ``host_checkpoint`` is the staged copy a background save holds, the rank's partition of
    the fp32 masters and Adam's two moments (the whole of them at ZeRO-0).

    On a GPU: ``nccl_communicators`` are those a first-stage rank joins (ZeRO-3's gradient
    communicator as the engine decides it, ``keep_gathered`` being ``stage3_keep_gathered_in_step``),
    and ``host_pinned_batches`` the loader's (``num_workers`` DataLoader workers) pinned batches.
    """
    if offload_param not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload_param must be none, cpu or nvme, got {offload_param!r}")
    if offload_param != "none" and zero_stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3 (it offloads the rank's weight partition)")
    if offload_optimizer not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload_optimizer must be none, cpu or nvme, got {offload_optimizer!r}")
    if offload_optimizer != "none" and zero_stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (it offloads the rank's partition)")
    ratio = offload_ratio if offload_optimizer != "none" else 0.0
    if recompute not in (None, "full", "selective"):
        raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
    if tp < 1 or pp < 1 or micro_batch_size < 1:
        raise ValueError(f"tp, pp and micro_batch_size must be >= 1, got {tp}, {pp}, {micro_batch_size}")
    s = seq_length or config.seq_length
    s_rank = s // context_parallel  # the tokens of each sequence one rank holds (context parallelism)
    zdp = dp * context_parallel  # the ranks ZeRO partitions and reduces over: data x context parallel
    total = num_parameters(config)
    replicated = replicated_parameters(config)
    # Routed experts: sharded over etp (default tp) and ep, partitioned by ZeRO over expert data parallel:
    # the stage's tp x dp x cp ranks over etp x ep.
    etp = tp if expert_tensor_parallel is None else expert_tensor_parallel
    experts = expert_parameters(config)
    psi_experts, edp = experts / (etp * expert_parallel * pp), zdp * tp // (expert_parallel * etp)
    psi = ((total - experts - replicated) / tp + replicated) / pp
    # the decoder layers' parameters (an average layer below), without the multi-token prediction depths
    mtp_all, mtp_replicated, mtp_experts = mtp_parameters(config)
    mtp_moe = bool(mtp_experts)  # the prediction depths are mixtures (the last layer is)
    layers_total, layers_replicated = total - mtp_all, replicated - mtp_replicated

    # The largest flat group's partition (a layer's weights, or the word embedding): what one
    # offload buffer needs at most.
    hybrid = not uniform_layers(config)  # one-part or recurrent layers: counted layer by layer
    big = largest_layer(config, tp) if hybrid else None  # in place of the average layer
    largest = max(big[0] if hybrid else (layers_total - layers_replicated - _embedding_params(config))
                  / config.num_layers / tp,
                  config.padded_vocab_size * config.hidden_size / tp) / (zdp if zero_stage else 1)

    def param_host(n: float) -> dict[str, float]:
        return offloaded_param_bytes(n, dp=zdp, precision=precision, device=offload_param, largest=largest,
                                     max_in_cpu=offload_param_max_in_cpu, buffer_count=offload_param_buffer_count,
                                     buffer_size=offload_param_buffer_size, optimizer_device=offload_optimizer,
                                     optimizer_ratio=ratio)

    kept = param_host(psi)["weights_on_device"]
    dense_k, expert_k = optimizer_bytes(optimizer, precision, 1.0 - _embedding_params(config) / max(total - experts, 1))
    expert_states = model_state_bytes(psi_experts, dp=edp, zero_stage=zero_stage, precision=precision,
                                      grad_accum_dtype=grad_accum_dtype, offload_ratio=ratio, weights_on_device=kept,
                                      optimizer_bytes=expert_k)
    weights, grads, optim = _with_experts(
        model_state_bytes(psi, dp=zdp, zero_stage=zero_stage, precision=precision, grad_accum_dtype=grad_accum_dtype,
                          offload_ratio=ratio, weights_on_device=kept, optimizer_bytes=dense_k), expert_states)
    act_kw = dict(micro_batch_size=micro_batch_size, seq_length=s_rank, tp=tp, recompute=recompute,
                  sequence_parallel=sequence_parallel and tp > 1, flash_attn=flash_attn,
                  act_bytes=_DTYPE_BYTES[precision], expert_tp=etp)
    act = _activations(config, cp=context_parallel, **act_kw)
    if not hybrid and 0 < moe_layers(config) < config.num_layers:  # a dense and a mixture layer's, for stages
        act["saved_by_kind"] = tuple(_activations(c, **act_kw)["saved_per_layer"] for c in (
            config.replace(num_experts=None), config.replace(moe_layer_freq=1)))
    kinds = [cp_comm_type] * config.num_layers if isinstance(cp_comm_type, str) else list(cp_comm_type)
    # the attention layers whose exchange is the all-gather (every layer is attention but in a hybrid stack)
    gathered = [i for i, k in enumerate(kinds)
                if k == "allgather" and config.layer_kinds(i).mixer in ("standard", "mla")]
    if context_parallel > 1 and gathered:
        act = _gathered_kv(act, config, seq_length=s, micro_batch_size=micro_batch_size, tp=tp, cp=context_parallel,
                           recompute=recompute, act_bytes=_DTYPE_BYTES[precision], layers=len(gathered),
                           numbers=gathered)
    buffers = 0.0
    if zero_stage == 3:
        # The layer being computed plus the one being prefetched, gathered to full (TP-local) size.
        layer = (layers_total - layers_replicated - _embedding_params(config)) / config.num_layers / tp
        layer += (layers_replicated - (config.max_position_embeddings * config.hidden_size
                                if config.position_embedding_type == "learned" else 0)) / config.num_layers
        layer = big[1] if hybrid else layer
        emb = config.padded_vocab_size * config.hidden_size / tp
        if prefetch_bucket_size is None:
            ahead = min(1, config.num_layers - 1)
        else:
            ahead = min(max(1, math.ceil(prefetch_bucket_size / layer)), config.num_layers - 1) \
                if prefetch_bucket_size > 0 else 0
        # the unit in use (the embedding, tied or not, while the head runs) and the prefetched ones
        buffers = (max(layer, emb) + ahead * layer) * _STATE_BYTES[precision][0]
    grad_buckets = 0.0
    if zero_stage >= 2:
        layer_local = big[0] if hybrid else \
            (layers_total - layers_replicated - _embedding_params(config)) / config.num_layers / tp
        unit = max(layer_local, config.padded_vocab_size * config.hidden_size / tp)
        reduce_bytes = _DTYPE_BYTES[grad_accum_dtype] if grad_accum_dtype else _STATE_BYTES[precision][1]
        # At the step's peak (backward's start, all activations alive) one unit's autograd
        # gradients and one bucket exist; later buckets in flight replace activations already freed.
        grad_buckets = unit * _DTYPE_BYTES[precision] + min(max(reduce_bucket_size or 0, unit), psi) * reduce_bytes
    gbs = global_batch_size or micro_batch_size * dp
    m_steps = num_microbatches or max(gbs // (micro_batch_size * dp), 1)
    common = dict(tp=tp, dp=zdp, zero_stage=zero_stage, microbatches=m_steps, micro_batch_size=micro_batch_size,
                  seq_length=s_rank, precision=precision, recompute=recompute,
                  grad_accum_dtype=grad_accum_dtype, edp=edp, ep=expert_parallel, etp=etp, cp=context_parallel,
                  cp_comm_type=cp_comm_type, hierarchical_cp=hierarchical_cp, sequence_parallel=sequence_parallel)
    pipeline: dict = {}
    if pp > 1:  # each stage its own layers (training's split), mixtures and experts
        def state_of(n: float) -> tuple[float, float, float]:
            return model_state_bytes(n, dp=zdp, zero_stage=zero_stage, precision=precision,
                                     grad_accum_dtype=grad_accum_dtype, offload_ratio=ratio, weights_on_device=kept,
                                     optimizer_bytes=dense_k)

        pipeline, stage = pipeline_plan(
            config, stage_layers(config, pp, virtual_pp, first_stage_layers, last_stage_layers), total=total - experts,
            replicated=replicated, tp=tp, act=act, state_of=state_of, expert_states=expert_states,
            psi_experts=psi_experts, m=m_steps, micro_batch_size=micro_batch_size, seq_length=s_rank,
            sequence_parallel=sequence_parallel and tp > 1, precision=precision)
        for st in pipeline["stages"]:  # the end stages send one direction of their end chunk less
            r = st["stage"]
            sends = 2 * virtual_pp - (r == 0) - (r == pp - 1)
            st["traffic"] = traffic_bytes_per_step(
                config, psi=st["params"] - st["expert_params"], psi_experts=st["expert_params"],
                layers=st["layers"], moe_layers=st["moe_layers"], mtp_layers=st["mtp_layers"],
                mtp_moe_layers=st["mtp_layers"] if mtp_moe else 0, pp_bytes=sends * m_steps * pipeline["boundary_bytes"],
                first_stage=r == 0, last_stage=r == pp - 1,
                layer_numbers=[i for a, b in st["layer_ranges"] for i in range(a, b)] if hybrid else None, **common)
        psi_experts = stage["expert_params"]  # the largest stage's
        psi, (weights, grads, optim) = stage["params"] - psi_experts, stage["states"]
        act = dict(act, total=stage["activations"], in_flight=stage["in_flight"])
        embedding = dict(embedding_stash=stage["embedding_stash"], embedding_sync=stage["embedding_sync"])
        traffic = stage["traffic"]
    else:
        embedding = {}
        traffic = traffic_bytes_per_step(config, psi=psi, psi_experts=psi_experts,
                                         layers=config.num_layers, moe_layers=moe_layers(config),
                                         layer_numbers=range(config.num_layers) if hybrid else None,
                                         mtp_layers=config.mtp_num_layers,
                                         mtp_moe_layers=config.mtp_num_layers if mtp_moe else 0, **common)
    host = offloaded_bytes(psi, dp=zdp, ratio=ratio, device=offload_optimizer, buffer_count=offload_buffer_count,
                           buffer_size=offload_buffer_size, largest=largest)
    host.update({k: v for k, v in param_host(psi).items() if k != "weights_on_device"})
    nccl = nccl_communicators(tp=tp, pp=pp, dp=dp, cp=context_parallel, hierarchical_cp=hierarchical_cp,
                              ep=expert_parallel, etp=etp, zero_stage=zero_stage, keep_gathered=keep_gathered)
    return MemoryEstimate(
        **host, **embedding,
        traffic=traffic,
        params=weights, grads=grads, optimizer=optim, activations=act["total"], buffers=buffers,
        grad_buckets=grad_buckets,
        params_total=total, params_per_rank=psi + psi_experts,
        flops_per_iteration=flops_per_iteration(config, gbs, s, recompute_full=recompute == "full"),
        plan=dict(tp=tp, dp=dp, pp=pp, cp=context_parallel, ep=expert_parallel, etp=etp, edp=edp, zero_stage=zero_stage,
                  micro_batch_size=micro_batch_size,
                  seq_length=s,
                  precision=precision, recompute=recompute, sequence_parallel=sequence_parallel,
                  flash_attn=flash_attn, global_batch_size=gbs, offload_optimizer=offload_optimizer,
                  offload_ratio=ratio, offload_param=offload_param, moe=bool(moe_layers(config))),
        activation_detail=act, pipeline=pipeline,
        nccl_communicators=nccl, nccl_note=gradient_communicator_note(nccl, zero_stage, zdp),
        host_pinned_batches=float(loader_pinned_bytes(micro_batch_size, s, num_workers)),
        host_checkpoint=12.0 * (psi + psi_experts if zero_stage == 0 else psi / zdp + psi_experts / edp)
        if async_save else 0.0)


def optimizer_bytes(optimizer: str, precision: str, matrix_share: float) -> tuple[float, float]:
    """Optimizer bytes per parameter (the fp32 master where it is apart, and the state its component keeps)
    for the dense parameters (``matrix_share`` of them are the layers' matrices) and the routed experts."""
    from megazero.zero.optimizers import OptimizerConfig, component

    kind = component(optimizer)
    oc = kind.default_config()
    adam = component("adam")
    master = _STATE_BYTES[precision][2] - adam.state_bytes(OptimizerConfig())  # the table's K: master + Adam's
    matrix = kind.state_bytes(oc, matrix=kind.per_matrix)
    other = kind.state_bytes(oc, matrix=False)
    return master + matrix * matrix_share + other * (1 - matrix_share), master + matrix


def plan_of(config: "TrainConfig", *, grad_accum_dtype: Optional[str] = None) -> dict:
    """The keyword arguments of :func:`estimate_memory` for a parsed ``TrainConfig`` (the plan
    pretrain_gpt.py would run), with what its ZeRO engine gets from the --deepspeed_config JSON
    (else the engine's defaults): bucket sizes, optimizer and parameter offload."""
    m, p = config.model, config.parallel
    engine = config.zero_config()
    zc = engine.zero_optimization
    grad_accum_dtype = grad_accum_dtype or engine.grad_accum_dtype  # the JSON's data_types, or the fp32 flag
    off, par = zc.offload_optimizer, zc.offload_param
    # Context parallelism: each rank's activations are those of a sequence cp times shorter, and
    # ZeRO partitions over dp x cp.
    return dict(
        tp=p.tp, dp=p.dp, pp=p.pp, zero_stage=p.zero_stage, micro_batch_size=config.schedule.micro_batch_size,
        context_parallel=p.cp, cp_comm_type=p.cp_comm_type, hierarchical_cp=p.hierarchical_cp, expert_parallel=p.ep,
        expert_tensor_parallel=p.etp,
        seq_length=m.seq_length, precision=config.precision.dtype, recompute=m.recompute_granularity,
        # flash-attn and SDPA's fused kernels (auto picks one of them) never hold the s x s scores;
        # only the math kernel does
        sequence_parallel=p.sequence_parallel, flash_attn=m.attention_backend != "math",
        grad_accum_dtype=grad_accum_dtype, global_batch_size=config.schedule.global_batch_size,
        virtual_pp=p.virtual_pp, num_microbatches=config.schedule.grad_accum_steps,
        first_stage_layers=p.decoder_first_pipeline_num_layers, last_stage_layers=p.decoder_last_pipeline_num_layers,
        reduce_bucket_size=zc.reduce_bucket_size, prefetch_bucket_size=zc.stage3_prefetch_bucket_size,
        offload_optimizer=off.device if off.enabled else "none", offload_ratio=off.ratio,
        offload_buffer_count=off.buffer_count, offload_buffer_size=off.buffer_size,
        offload_param=par.device if par.enabled else "none", offload_param_max_in_cpu=par.max_in_cpu,
        offload_param_buffer_count=par.buffer_count, offload_param_buffer_size=par.buffer_size,
        keep_gathered=zc.stage3_keep_gathered_in_step, num_workers=config.data.num_workers,
        async_save=config.checkpoint.async_save, optimizer=config.optim.type.lower())


def estimate_memory_for(config: "TrainConfig", *, grad_accum_dtype: Optional[str] = None) -> MemoryEstimate:
    """``estimate_memory`` for a parsed ``TrainConfig`` (see :func:`plan_of`)."""
    return estimate_memory(config.model, **plan_of(config, grad_accum_dtype=grad_accum_dtype))
