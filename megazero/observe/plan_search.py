"""The layout search: every tp x cp x pp x vpp x ep (x etp) x ZeRO stage x SP x recompute x micro-batch
a launch could use, each planned for memory (:func:`.planner.estimate_memory`, per pipeline stage) and
time (:mod:`.plan_time`), the fitting ones ranked fastest first, the others explained by family.

Two priors bound the search: TP stays within a node unless fixed, and each context-parallel rank keeps at
least ``MIN_CP_TOKENS`` tokens. Beyond them no candidate that could win is dropped: sizes must divide what
they split (the world, the layers, the heads, the experts, the global batch), selective recompute is left
out where the attention kernel holds no s x s scores (it would save nothing and cost time), micro-batches
grow only while they fit (memory grows with the micro-batch), and optimizer offload is tried only for
candidates that do not fit without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional

from megazero.model.config import GPTConfig
from megazero.model.flops import attention_square_flops_per_token, flops_per_iteration, moe_layers
from megazero.observe.plan_devices import Cluster
from megazero.observe.plan_time import TIME_TERMS, Layout, StepTime, step_time
from megazero.observe.planner import GiB, MemoryEstimate, estimate_memory
from megazero.zero.optimizers import component

__all__ = ["Restrictions", "Plan", "Family", "SearchResult", "search", "evaluate", "layout_args", "MIN_CP_TOKENS",
           "MEMORY_TERMS"]

MIN_CP_TOKENS = 1024  # context parallelism below this many tokens per rank only adds exchanges
MAX_MICRO_BATCH = 64
MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "buffers", "in_flight_grads", "nccl")


@dataclass(frozen=True)
class Restrictions:
    """What the search may choose; ``None`` leaves a dimension free."""

    tp: Optional[int] = None
    pp: Optional[int] = None
    cp: Optional[int] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
    vpp: Optional[int] = None
    micro_batch_size: Optional[int] = None
    zero_stages: tuple = (0, 1, 2, 3)
    recompute: tuple = (None, "selective", "full")
    sequence_parallel: tuple = (False, True)
    context_parallel: bool = True
    offload: bool = True  # optimizer offload where nothing fits without it


@dataclass
class Plan:
    """One evaluated candidate."""

    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    flops: float  # Narayanan et al.'s count of one step (recompute included when full)
    model_flops: float  # without recompute, the attention's causal half only (what MFU counts)
    fits: bool  # the peak with NCCL's estimate within the device's memory (what tools/rehearse.py checks)
    usable: float  # bytes a plan may use: the device's less the cluster's reserve
    host: float = float("inf")  # host bytes per GPU offloaded state may use

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def world(self) -> int:
        return self.layout.dp * self.layout.model_parallel

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops / self.time.total / self.world / 1e12

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilization: the FLOPs a step needs (no recompute, the causal half of the attention
        square) per second per GPU over ``peak``."""
        return self.model_flops / self.time.total / self.world / peak

    @property
    def stage_peak_bytes(self) -> list[float]:
        """Each pipeline stage's peak without NCCL's buffers (with the ZeRO-3 gather buffers and the gradients
        in flight, which every stage has alike)."""
        e = self.memory
        st = e.pipeline.get("stages")
        if not st:
            return [float(e.total)]
        return [float(sum(s["states"]) + e.buffers + max(s["activations"] + s["embedding_stash"] + e.grad_buckets,
                                                         s["embedding_sync"])) for s in st]

    @property
    def shortfall(self) -> float:
        """Bytes over what a plan may use on the device (<= 0 when it can be chosen; offloaded state beyond the
        host's share of memory counts as a shortfall of infinity)."""
        if self.memory.host_total > self.host:
            return float("inf")
        return self.memory.device_total - self.usable

    def memory_terms(self) -> dict[str, float]:
        """The largest stage's peak by kind (:data:`MEMORY_TERMS`), summing to ``memory.device_total``: at the
        peak either backward's start (activations with the embedding's gradient buffer, gradients in flight)
        or, when larger, the shared embedding's gradient exchange after backward (as ``activations``)."""
        e = self.memory
        exchange = e.embedding_sync > e.activations + e.grad_buckets + e.embedding_stash
        return {"weights": e.params, "gradients": e.grads, "optimizer": e.optimizer,
                "activations": e.embedding_sync if exchange else e.activations + e.embedding_stash,
                "buffers": e.buffers, "in_flight_grads": 0.0 if exchange else e.grad_buckets, "nccl": e.nccl}


@dataclass
class Family:
    """Candidates sharing tp, pp, cp, ep (and etp): their best plan, or why none is usable."""

    key: tuple
    best: Optional[Plan] = None  # the fastest fitting
    closest: Optional[Plan] = None  # the smallest shortfall when none fits
    invalid: str = ""  # why the sizes cannot run at all
    rule: str = ""  # the rule ``invalid`` breaks, a few words alike for every family that breaks it


@dataclass
class SearchResult:
    plans: list  # fitting Plans, fastest first
    families: list  # Family, in the order of their best plan
    evaluated: int = 0
    closest: Optional[Plan] = None  # the smallest shortfall overall, when nothing fits


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_args(lay: Layout) -> list[str]:
    """``pretrain_gpt.py``'s flags that launch ``lay`` (beside the model's and the batch's)."""
    args = ["--tp", str(lay.tp), "--pp", str(lay.pp), "--zero-stage", str(lay.zero_stage),
            "--micro-batch-size", str(lay.micro_batch_size)]
    if lay.cp > 1:
        args += ["--cp", str(lay.cp)]
    if lay.etp is not None:  # a mixture of experts
        args += ["--ep", str(lay.ep), "--expert-tensor-parallel-size", str(lay.etp)]
    if lay.vpp > 1:
        args += ["--virtual-pipeline-model-parallel-size", str(lay.vpp)]
    if lay.first_stage_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(lay.first_stage_layers),
                 "--decoder-last-pipeline-num-layers", str(lay.last_stage_layers)]
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    if lay.recompute:
        args += ["--recompute-granularity", lay.recompute]
        if lay.recompute == "full":
            args += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if lay.offload_optimizer:
        args.append("--optimizer-cpu-offload")
    return args


def causal_flops(config: GPTConfig, global_batch_size: int) -> float:
    """Training FLOPs of a step without recompute, counting only the causal half of each attention square
    (Narayanan et al.'s count, :func:`~megazero.model.flops.flops_per_iteration`, has all of it)."""
    c, s = config, config.seq_length
    layers = c.num_layers + (c.mtp_num_layers or 0)
    square = attention_square_flops_per_token(c)  # per token and layer, forward
    return flops_per_iteration(c, global_batch_size) - 3 * global_batch_size * s * layers * square / 2


def uneven_split(layers: int, pp: int) -> Optional[tuple[int, int]]:
    """(first, last) stage layers of Megatron's uneven split when ``pp`` does not divide ``layers``: the
    middle stages ceil(layers / pp) each, the rest to the ends (the first one more when odd, as the last
    holds the head); None when that leaves an end empty."""
    if pp < 3:
        return None
    middle = -(-layers // pp)
    rest = layers - (pp - 2) * middle
    return (rest - rest // 2, rest // 2) if rest >= 2 and rest - rest // 2 <= middle else None


def _model_at(config: GPTConfig, tp: int) -> GPTConfig:
    """The model as a launch at ``tp`` builds it: the vocabulary padded for that TP size."""
    return config.replace(vocab_padding_tp=tp)


def _why_not(config: GPTConfig, tp: int) -> str:
    try:
        config.validate(tp)
        return ""
    except ValueError as e:
        return str(e)


def _families(config: GPTConfig, cluster: Cluster, r: Restrictions,
              gbs: int) -> Iterator[tuple[tuple, tuple[str, str]]]:
    """(tp, cp, pp, ep, etp) families and why each cannot run: (the rule it breaks, the reason), empty
    strings when it can."""
    world, L, s = cluster.world, config.num_layers, config.seq_length
    moe = bool(moe_layers(config))
    for tp in ([r.tp] if r.tp else [d for d in _divisors(world) if d <= cluster.gpus_per_node]):
        cps = [r.cp] if r.cp else [d for d in _divisors(world // tp) if d == 1 or (
            r.context_parallel and s % (2 * d) == 0 and s // d >= MIN_CP_TOKENS)]
        for cp in cps:
            for pp in ([r.pp] if r.pp else [d for d in _divisors(world // (tp * cp)) if d <= L]):
                eps = [1]
                if moe:
                    eps = [r.ep] if r.ep else _divisors(config.num_experts)
                for ep in eps:
                    etps = ([r.etp] if r.etp else sorted({1, tp})) if moe else [None]
                    for etp in etps:
                        key = (tp, cp, pp, ep, etp)
                        if world % (tp * cp * pp):
                            yield key, ("the sizes do not divide the world",
                                        f"tp x cp x pp = {tp * cp * pp} does not divide the world of {world}")
                            continue
                        dp = world // (tp * cp * pp)
                        why = _why_not(_model_at(config, tp), tp)
                        rule = "the model does not split over tp" if why else ""
                        if not why and L % pp and uneven_split(L, pp) is None:
                            rule = "the layers do not split over pp"
                            why = f"{L} layers do not split over pp {pp}, evenly or with lighter end stages"
                        if not why and gbs % dp:
                            rule = "dp does not divide the batch"
                            why = f"global batch {gbs} is not divisible by dp {dp}"
                        if not why and moe and (tp * cp * dp) % (ep * etp):
                            rule = "ep x etp does not divide a stage's ranks"
                            why = f"ep {ep} x etp {etp} does not divide the stage's {tp * cp * dp} ranks"
                        yield key, (rule, why)


def evaluate(config: GPTConfig, lay: Layout, cluster: Cluster, base: dict, *, global_batch_size: int,
             precision: str, optimizer: str) -> Plan:
    """Memory and time of ``lay`` (``base``: :func:`~megazero.observe.planner.plan_of` of the user's run,
    whose other settings, bucket sizes, kernels, optimizer, are kept)."""
    model = _model_at(config, lay.tp)
    m = global_batch_size // (lay.micro_batch_size * lay.dp)
    kw = dict(base, tp=lay.tp, dp=lay.dp, pp=lay.pp, context_parallel=lay.cp, expert_parallel=lay.ep,
              expert_tensor_parallel=lay.etp or lay.tp, zero_stage=lay.zero_stage,
              sequence_parallel=lay.sequence_parallel,
              recompute=lay.recompute, micro_batch_size=lay.micro_batch_size, virtual_pp=lay.vpp, num_microbatches=m,
              global_batch_size=global_batch_size, first_stage_layers=lay.first_stage_layers,
              last_stage_layers=lay.last_stage_layers,
              offload_optimizer="cpu" if lay.offload_optimizer else base.get("offload_optimizer", "none"),
              offload_ratio=1.0 if lay.offload_optimizer else base.get("offload_ratio", 1.0))
    est = estimate_memory(model, **kw)
    cp_type = base.get("cp_comm_type", "p2p")
    t = step_time(model, lay, cluster, est, global_batch_size=global_batch_size, precision=precision,
                  flash_attn=base.get("flash_attn", True), optimizer=optimizer,
                  cp_comm_type=cp_type if isinstance(cp_type, str) else cp_type[0])
    full = lay.recompute == "full"
    return Plan(layout=lay, memory=est, time=t,
                flops=flops_per_iteration(model, global_batch_size, recompute_full=full),
                model_flops=causal_flops(model, global_batch_size), fits=est.fits(cluster.device.memory_gib),
                usable=cluster.usable_bytes, host=cluster.device.host_memory_gib * GiB)


def _layouts(key: tuple, config: GPTConfig, cluster: Cluster, r: Restrictions, gbs: int,
             flash: bool) -> Iterator[list[Layout]]:
    """Each (vpp, ZeRO, SP, recompute) setting of a family, its micro-batch sizes smallest first."""
    tp, cp, pp, ep, etp = key
    dp = cluster.world // (tp * cp * pp)
    per_rank = gbs // dp
    mbs = [b for b in _divisors(per_rank) if (b == r.micro_batch_size if r.micro_batch_size else b <= MAX_MICRO_BATCH)]
    per_stage = config.num_layers // pp
    ends = uneven_split(config.num_layers, pp) if config.num_layers % pp else None
    vpps = [r.vpp] if r.vpp else ([1] + [v for v in _divisors(per_stage) if v > 1]) if pp > 1 and not ends else [1]
    for vpp in vpps:
        for zero in r.zero_stages:
            # experts split other than the attention route each rank's own tokens: Megatron's SP
            sps = {s and tp > 1 for s in r.sequence_parallel}
            for sp in sorted(sps - ({False} if etp not in (None, tp) and tp > 1 else set())):
                for rc in r.recompute:
                    if rc == "selective" and flash and len(r.recompute) > 1:
                        continue  # a flash kernel holds no s x s scores for selective recompute to drop
                    seq = []
                    for b in mbs:
                        m = per_rank // b
                        if vpp > 1 and m % pp:  # interleaving takes micro-batches in groups of pp
                            continue
                        seq.append(Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, zero_stage=zero,
                                          sequence_parallel=sp, recompute=rc, micro_batch_size=b,
                                          first_stage_layers=ends[0] if ends else None,
                                          last_stage_layers=ends[1] if ends else None))
                    if seq:
                        yield seq


def search(config: GPTConfig, cluster: Cluster, base: dict, *, global_batch_size: int, precision: str,
           optimizer: str = "adamw", restrictions: Restrictions = Restrictions()) -> SearchResult:
    """Every candidate layout of ``config`` on ``cluster``: the fitting ones fastest first, and each family's
    best or closest plan (``base``: the user's plan, :func:`~megazero.observe.planner.plan_of`)."""
    r, gbs = restrictions, global_batch_size
    plans, families, evaluated = [], [], 0
    kw = dict(global_batch_size=gbs, precision=precision, optimizer=optimizer)
    for key, (rule, why) in _families(config, cluster, r, gbs):
        fam = Family(key=key, invalid=why, rule=rule)
        families.append(fam)
        if why:
            continue
        layouts = list(_layouts(key, config, cluster, r, gbs, base.get("flash_attn", True)))
        if not layouts:
            per_rank = gbs // (cluster.world // (key[0] * key[1] * key[2]))
            fam.rule = "no micro-batch size splits the batch"
            fam.invalid = (f"no micro-batch size{f' {r.micro_batch_size}' if r.micro_batch_size else ''} splits each "
                           f"data-parallel rank's {per_rank} sequences as the schedule needs")
            continue
        for seq in layouts:
            for lay in seq:
                plan = evaluate(config, lay, cluster, base, **kw)
                evaluated += 1
                if plan.shortfall > 0 and r.offload and lay.zero_stage \
                        and not component(optimizer).per_matrix:
                    offloaded = evaluate(config, replace(lay, offload_optimizer=True), cluster, base, **kw)
                    evaluated += 1
                    plan = offloaded if offloaded.shortfall < plan.shortfall else plan
                if plan.shortfall > 0:
                    if fam.closest is None or plan.shortfall < fam.closest.shortfall:
                        fam.closest = plan
                    break  # a larger micro-batch needs more memory
                plans.append(plan)
                if fam.best is None or plan.step_time_s < fam.best.step_time_s:
                    fam.best = plan
    plans.sort(key=lambda p: p.step_time_s)
    families.sort(key=lambda f: (f.best is None, f.best.step_time_s if f.best else 0.0,
                                 f.closest.shortfall if f.closest else float("inf")))
    closest = min((f.closest for f in families if f.closest), key=lambda p: p.shortfall, default=None)
    return SearchResult(plans=plans, families=families, evaluated=evaluated, closest=None if plans else closest)


def grown_terms(plan: Plan, best: Plan) -> list[tuple[str, float]]:
    """The time terms of ``plan`` that exceed ``best``'s by more than 0.5 % of its step, as (term, excess
    over ``best``'s step), the largest first."""
    diffs = ((k, (plan.time.terms[k] - best.time.terms[k]) / best.step_time_s) for k in TIME_TERMS)
    return sorted(((k, d) for k, d in diffs if d > 0.005), key=lambda kd: -kd[1])


def slower_because(plan: Plan, best: Plan) -> str:
    """``'12.3 % slower: bubble +8.1 %, tp +3.0 %'``: the terms that grew most against ``best``."""
    ratio = plan.step_time_s / best.step_time_s - 1
    grown = [f"{k} +{100 * d:.1f} %" for k, d in grown_terms(plan, best)[:2]]
    return f"{100 * ratio:.1f} % slower" + (f": {', '.join(grown)}" if grown else "")


def describe_layout(lay: Layout) -> str:
    """``tp 4 pp 8 v 2 dp 16 cp 1 ZeRO-1 SP full mbs 1``."""
    parts = [f"tp {lay.tp}", f"pp {lay.pp}"] + ([f"v {lay.vpp}"] if lay.vpp > 1 else [])
    if lay.first_stage_layers is not None:
        parts.append(f"({lay.first_stage_layers}+...+{lay.last_stage_layers} layers)")
    parts.append(f"dp {lay.dp}")
    parts += [f"cp {lay.cp}"] if lay.cp > 1 else []
    parts += [f"ep {lay.ep} etp {lay.etp}"] if lay.etp is not None else []
    parts += [f"ZeRO-{lay.zero_stage}"] + (["SP"] if lay.sequence_parallel else [])
    parts += [f"recompute {lay.recompute or 'none'}", f"mbs {lay.micro_batch_size}"]
    parts += ["optimizer offload"] if lay.offload_optimizer else []
    return " ".join(parts)


def family_reason(fam: Family, best: Optional[Plan]) -> str:
    """Why ``fam`` did not give the chosen plan."""
    if fam.invalid:
        return fam.invalid
    if fam.best is None:
        p = fam.closest
        if p is None:
            return "no micro-batch size divides the batch as it needs"
        stage = p.memory.pipeline.get("worst_stage", 0)
        return (f"OOM by {p.shortfall / GiB:.2f} GiB on stage {stage} at best "
                f"({describe_layout(p.layout)}: "
                f"{p.memory.device_total / GiB:.1f} GiB)")
    if best is None or fam.best is best:
        return "chosen"
    return slower_because(fam.best, best)

