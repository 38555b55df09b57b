"""Which layout? The fastest tp/pp/vpp/cp/ep/ZeRO/SP/recompute/micro-batch that fits, explained.

    python tools/plan.py --world-size 64 --gpu h100-80gb --model-preset gpt-13b \\
        --global-batch-size 1024 --bf16
    python tools/plan.py --world-size 512 --gpu a100-80gb --zero-stages 0 --recompute full \\
        --no-sequence-parallel PRETRAIN_GPT_FLAGS --json plans.json --rehearse 2

The model, batch and precision are pretrain_gpt.py's flags (as tools/estimate_memory.py takes them);
a layout flag among them (--tp, --pp, --cp, --ep, --expert-tensor-parallel-size,
--virtual-pipeline-model-parallel-size, --micro-batch-size, --zero-stage, --sequence-parallel,
--recompute-granularity, --optimizer-cpu-offload) fixes that choice. Every other layout is searched:
each planned for memory per pipeline stage (megazero/observe/planner.py, what tools/rehearse.py
measures) and for time (megazero/observe/plan_time.py: compute by GEMM size, collectives by where
their group lands, bubble, ZeRO's overlap, the optimizer step). Printed: the fitting plans fastest
first with their time and memory terms, the launch flags of the best, and why every other (tp, cp,
pp, ep) family lost. MFU counts the FLOPs a step needs (the causal half of each attention square, no
recompute), TFLOP/s per GPU Narayanan et al.'s count (the whole square, recompute included). A
pipeline whose size does not divide the layers gets Megatron's uneven split (lighter first and last
stages). Installed: ``megazero-plan``. Exit status: 0 a plan, 1 nothing fits, 2 invalid input (a world
size no layout divides among them), 3 a rehearsal failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

# A rehearsal's fake process groups warn once per group as they are destroyed (see tools/rehearse.py).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from megazero.cli.common import write_output  # noqa: E402
from megazero.cli.planning import plan_config, planning_parser, tool_args  # noqa: E402
from megazero.config.arguments import build_parser as pretrain_parser  # noqa: E402
from megazero.config.train_config import ConfigError, TrainConfig  # noqa: E402
from megazero.observe.plan_devices import DEVICES, Cluster, device_preset  # noqa: E402
from megazero.observe.plan_search import (  # noqa: E402
    MEMORY_TERMS,
    Family,
    Plan,
    Restrictions,
    SearchResult,
    describe_layout,
    family_reason,
    grown_terms,
    layout_args,
    search,
    slower_because,
)
from megazero.observe.plan_time import GEMM_EFFICIENCY, TIME_TERMS  # noqa: E402
from megazero.observe.planner import GiB, plan_of  # noqa: E402

log = logging.getLogger(__name__)

# pretrain_gpt.py's layout flags: given, they fix the choice (dest -> Restrictions field)
_FIXED = {"tp": "tp", "pp": "pp", "context_parallel_size": "cp", "expert_model_parallel_size": "ep",
          "expert_tensor_parallel_size": "etp", "virtual_pipeline_model_parallel_size": "vpp",
          "micro_batch_size": "micro_batch_size", "zero_stage": "zero_stages", "sequence_parallel": "sequence_parallel",
          "recompute_granularity": "recompute", "recompute_activations": "recompute",
          "optimizer_cpu_offload": "offload", "num_layers_per_virtual_pipeline_stage": None,
          "recompute_method": None, "recompute_num_layers": None, "decoder_first_pipeline_num_layers": None,
          "decoder_last_pipeline_num_layers": None}


def _add_own(add: Callable) -> None:
    add("--world-size", type=int, help="GPUs of the launch (required)")
    add("--gpus-per-node", type=int, default=8, help="GPUs per node: groups within a node use its NVLink")
    add("--gpu", default="h100-80gb", help=f"the GPU preset: {', '.join(DEVICES)}")
    add("--device-memory-gb", type=float, help="device memory in GiB (default: the preset's)")
    add("--peak-tflops", type=float, help="dense bf16/fp16 peak TFLOP/s (default: the preset's)")
    add("--intra-node-gbps", type=float, help="collective bus bandwidth per GPU within a node, GB/s")
    add("--inter-node-gbps", type=float, help="collective bus bandwidth per GPU across nodes, GB/s")
    add("--hbm-gbps", type=float, help="device-memory bandwidth, GB/s")
    add("--host-memory-gb", type=float, help="host memory per GPU in GiB, for offloaded state (default: the preset's)")
    add("--memory-reserve-gb", type=float, default=3.0,
        help="GiB of each GPU left to the CUDA context, workspaces and fragmentation")
    add("--vpp", type=int, help="fix the virtual pipeline stages per rank")
    add("--zero-stages", help="ZeRO stages to consider, e.g. 1,3 (default: 0,1,2,3)")
    add("--recompute", help="recompute settings to consider, of none,selective,full (default: all)")
    add("--no-sequence-parallel", action="store_true", help="never sequence parallelism")
    add("--no-context-parallel", action="store_true", help="never context parallelism")
    add("--no-offload", action="store_true", help="never optimizer offload (tried where nothing else fits)")
    add("--top", type=int, default=10, help="plans printed and written to --json")
    add("--verbose", action="store_true",
        help="every other family on a line of its own (default: grouped by why they lost)")
    add("--json", metavar="PATH", help="write plans and rejected families as JSON")
    add("--rehearse", type=int, default=0, metavar="K",
        help="rehearse the top K plans (tools/rehearse.py; the first, the largest and the last pipeline stage): "
             "predicted against measured peak")


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flags and this tool's own (its --help)."""
    return planning_parser("plan.py", __doc__, _add_own)


def _fixed(words: Sequence[str]) -> tuple[list[str], dict]:
    """(the words without pretrain_gpt.py's layout flags, the Restrictions those flags set)."""
    parser = pretrain_parser()
    ns, _ = parser.parse_known_args(list(words))
    by_option = {o: a for a in parser._actions for o in a.option_strings if a.dest in _FIXED}
    kept, i = [], 0
    while i < len(words):
        name = words[i].split("=")[0]
        action = by_option.get(name)
        skip = 1 + (action is not None and action.nargs != 0 and "=" not in words[i])
        if action is None:
            kept.append(words[i])
        i += skip if action is not None else 1
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage: give --virtual-pipeline-model-parallel-size "
                          "(or --vpp) to fix the interleaving, or neither to search it")
    out: dict = {}
    for dest, field in _FIXED.items():
        value = getattr(ns, dest, None)
        if field is None or value is None:
            continue
        if field == "zero_stages":
            value = (int(value),)
        elif field == "sequence_parallel":
            value = (bool(value),)
        elif field == "recompute":
            value = ("selective",) if dest == "recompute_activations" else (None if value == "none" else value,)
        elif field == "offload":
            if value:
                raise ConfigError("--optimizer-cpu-offload: the planner offloads where nothing fits without it; "
                                  "drop the flag (or pass --no-offload never to)")
            continue
        out[field] = value
    return kept, out


def _restrictions(own: argparse.Namespace, fixed: dict) -> Restrictions:
    kw = dict(fixed)
    if own.vpp is not None:
        kw["vpp"] = own.vpp
    if own.zero_stages:
        try:
            stages = tuple(int(x) for x in own.zero_stages.split(","))
        except ValueError:
            raise ConfigError(f"--zero-stages {own.zero_stages!r}: give stages 0-3 separated by commas") from None
        if not stages or any(s not in (0, 1, 2, 3) for s in stages):
            raise ConfigError(f"--zero-stages {own.zero_stages!r}: give stages 0-3 separated by commas")
        kw["zero_stages"] = tuple(s for s in stages if s in kw.get("zero_stages", stages))
    if own.recompute:
        names = own.recompute.split(",")
        if any(n not in ("none", "selective", "full") for n in names):
            raise ConfigError(f"--recompute {own.recompute!r}: give none, selective or full, separated by commas")
        kw["recompute"] = tuple(None if n == "none" else n for n in names)
    if own.no_sequence_parallel:
        kw["sequence_parallel"] = (False,)
    if own.no_context_parallel:
        kw["context_parallel"] = False
        kw.setdefault("cp", 1)
    if own.no_offload:
        kw["offload"] = False
    return Restrictions(**kw)


def _cluster(own: argparse.Namespace) -> Cluster:
    if own.world_size is None:
        raise ConfigError("give --world-size (the GPUs of the launch)")
    device = device_preset(own.gpu, memory_gib=own.device_memory_gb, peak_tflops=own.peak_tflops,
                           intra_node_gbps=own.intra_node_gbps, inter_node_gbps=own.inter_node_gbps,
                           hbm_gbps=own.hbm_gbps, host_memory_gib=own.host_memory_gb)
    return Cluster(own.world_size, own.gpus_per_node, device, reserve_gib=own.memory_reserve_gb)


def _validated(result: SearchResult, words: list[str], world: int, top: int) -> list[Plan]:
    """The first ``top`` plans whose flags pretrain_gpt.py accepts (the others become rejected families)."""
    out = []
    for plan in result.plans:
        if len(out) == top:
            break
        try:
            plan_config(words + layout_args(plan.layout), world, build_parser())
            out.append(plan)
        except (ConfigError, ValueError) as e:
            lay = plan.layout
            result.families.append(Family(key=(lay.tp, lay.cp, lay.pp, lay.ep, lay.etp),
                                          invalid=f"{describe_layout(lay)}: pretrain_gpt.py refuses it: {e}",
                                          rule="pretrain_gpt.py refuses the flags"))
    return out


def _table(plans: list[Plan], peak: float) -> list[str]:
    """The plans, fastest first; a ``host GiB`` column (per GPU) when one of them offloads."""
    host = any(p.layout.offload_optimizer for p in plans)
    head = (f"{'#':>2} {'layout':<58} {'step s':>8} {'TFLOP/s':>8} {'MFU':>5} {'peak GiB':>9}"
            + (f" {'host GiB':>9}" if host else "") + "  " + " ".join(f"{t:>9}" for t in TIME_TERMS))
    lines = [head]
    for i, p in enumerate(plans, 1):
        lines.append(f"{i:>2} {describe_layout(p.layout):<58} {p.step_time_s:>8.3f} {p.tflops_per_gpu:>8.1f} "
                     f"{100 * p.mfu(peak):>4.1f}% {p.memory.device_total / GiB:>9.2f}"
                     + (f" {p.memory.host_total / GiB:>9.2f}" if host else "") + "  "
                     + " ".join(f"{p.time.terms[t]:>9.3f}" for t in TIME_TERMS))
    return lines


def _explain(best: Plan, words: list[str], cluster: Cluster) -> list[str]:
    """The chosen plan: its time and memory terms (each summing to the total) and its launch line."""
    t, m = best.time.terms, best.memory_terms()
    stages = best.stage_peak_bytes
    nodes = max(cluster.world // cluster.gpus_per_node, 1)
    host = [f"  host {best.memory.host_total / GiB:.2f} GiB per GPU for the offloaded optimizer state (the "
            f"preset's {cluster.device.host_memory_gib:g} GiB per GPU; --host-memory-gb)"] \
        if best.layout.offload_optimizer else []
    return [
        f"chosen: {describe_layout(best.layout)}",
        f"  step {best.step_time_s:.3f} s = " + " + ".join(f"{k} {v:.3f}" for k, v in t.items() if v)
        + f" ({best.time.microbatches} micro-batches per step, slowest stage {best.time.slowest_stage})",
        f"  peak {best.memory.device_total / GiB:.2f} GiB = " + " + ".join(
            f"{k.replace('_', ' ')} {v / GiB:.2f}" for k, v in m.items() if v)
        + f" (stage {best.memory.pipeline.get('worst_stage', 0)}; per stage: "
        + ", ".join(f"{b / GiB:.1f}" for b in stages) + " GiB without NCCL)",
        *host,
        f"  launch: torchrun --nnodes {nodes} --nproc-per-node {min(cluster.gpus_per_node, cluster.world)} "
        f"pretrain_gpt.py {shlex.join(words + layout_args(best.layout))}",
    ]


def _family_key(f: Family) -> str:
    tp, cp, pp, ep, etp = f.key
    return f"tp {tp} cp {cp} pp {pp}" + (f" ep {ep} etp {etp}" if etp is not None else "")


def _why_lost(f: Family, best: Plan) -> str:
    """The group ``f`` falls in: the rule it breaks, no fit, or the time term that grew most."""
    if f.invalid:
        return f"cannot run, {f.rule}"
    if f.best is None:
        return "fits at no setting"
    grown = grown_terms(f.best, best)
    return f"slower, most by {grown[0][0]}" if grown else "slower by under 0.5 % in each term"


def _others(families: list[Family], best: Plan, verbose: bool) -> list[str]:
    """The families that lost: one line each with ``verbose``, else one line per reason (how many, and the
    nearest or an example)."""
    others = [f for f in families if f.best is not best]
    if verbose:
        return ["the other families (tp, cp, pp, ep):"] + [f"  {_family_key(f)}: {family_reason(f, best)}"
                                                           for f in others]
    groups: dict[str, list[Family]] = {}
    for f in others:  # in the search's order: the fastest first, then those that fit nowhere, then the invalid
        groups.setdefault(_why_lost(f, best), []).append(f)
    lines = [f"the other {len(others)} families (tp, cp, pp, ep) by why they lost (--verbose: each):"]
    for why, fams in groups.items():
        n = f"{len(fams)} famil{'y' if len(fams) == 1 else 'ies'}"
        first = fams[0]
        if first.best is not None:
            worst = max(f.best.step_time_s for f in fams) / best.step_time_s - 1
            lines.append(f"  {why}: {n}, up to {100 * worst:.1f} % slower; the nearest, {_family_key(first)}, "
                         f"{slower_because(first.best, best)}")
        elif not first.invalid:
            closest = min(fams, key=lambda f: f.closest.shortfall if f.closest else float("inf"))
            lines.append(f"  {why}: {n}; the closest, {_family_key(closest)}: {family_reason(closest, best)}")
        else:
            lines.append(f"  {why}: {n}, such as {_family_key(first)}: {first.invalid}")
    return lines


def _plan_json(p: Plan, words: list[str], peak: float) -> dict:
    lay = p.layout
    return dict(tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, etp=lay.etp or lay.tp, vpp=lay.vpp,
                zero_stage=lay.zero_stage, sequence_parallel=lay.sequence_parallel, recompute=lay.recompute or "none",
                micro_batch_size=lay.micro_batch_size, offload_optimizer=lay.offload_optimizer,
                microbatches=p.time.microbatches, step_time_s=p.step_time_s, tflops_per_gpu=p.tflops_per_gpu,
                mfu=p.mfu(peak), peak_bytes=max(p.stage_peak_bytes), stage_peak_bytes=p.stage_peak_bytes,
                peak_bytes_with_nccl=p.memory.device_total, host_bytes=p.memory.host_total, fits=p.fits,
                time_terms=p.time.terms,
                memory_terms=p.memory_terms(), args=words + layout_args(lay))


def _family_json(f: Family, reason: str) -> dict:
    tp, cp, pp, ep, etp = f.key
    out = dict(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp or tp, reason=reason)
    if f.best is not None:
        out["step_time_s"] = f.best.step_time_s
    return out


def _rehearse(plans: list[Plan], words: list[str], world: int) -> list[dict]:
    """Each plan's first, largest and last pipeline stage rehearsed: predicted against measured peak (bytes)."""
    from megazero.observe.rehearsal import rehearsal_config, rehearse_rank

    rows = []
    for i, p in enumerate(plans, 1):
        lay = p.layout
        config, _ = rehearsal_config(words + layout_args(lay), world, micro_batches=lay.pp * lay.vpp,
                                     parser=build_parser())
        stage = world // lay.pp
        for pp_rank in dict.fromkeys((0, p.memory.pipeline.get("worst_stage", 0), lay.pp - 1)):
            report = rehearse_rank(config, pp_rank * stage)
            predicted = p.stage_peak_bytes[pp_rank]
            rows.append(dict(plan=i, stage=pp_rank, rank=pp_rank * stage, predicted_bytes=predicted,
                             rehearsed_bytes=report.peak_bytes, error=predicted / report.peak_bytes - 1))
            write_output(f"  plan {i} stage {pp_rank}: predicted {predicted / GiB:.2f} GiB, rehearsed "
                         f"{report.peak_bytes / GiB:.2f} GiB ({100 * rows[-1]['error']:+.1f} %)")
    return rows


def _nothing_fits(result: SearchResult, config: TrainConfig, base: dict, cluster: Cluster,
                  restrictions: Restrictions) -> str:
    """One line: why no layout runs, or the closest plan and what would close its gap (more GPUs of this
    kind, or as many GPUs with more memory: each the smallest such change, searched again)."""
    if result.closest is None:
        reasons = sorted({f.invalid for f in result.families if f.invalid})
        return (f"no layout of {cluster.world} GPUs runs this model: " + "; ".join(reasons[:3])
                + ("; ..." if len(reasons) > 3 else "") + ". Change --world-size, or the sizes the flags fix")
    p = result.closest
    kw = dict(global_batch_size=config.schedule.global_batch_size, precision=config.precision.dtype,
              optimizer=config.optim.type.lower(), restrictions=restrictions)
    knobs = []
    for factor in (2, 4, 8, 16, 32):
        bigger = replace(cluster, world=cluster.world * factor)
        if search(config.model, bigger, base, **kw).plans:
            knobs.append(f"--world-size {bigger.world}")
            break
    for name, device in DEVICES.items():
        if device.memory_gib > cluster.device.memory_gib and \
                search(config.model, replace(cluster, device=device), base, **kw).plans:
            knobs.append(f"--gpu {name} ({device.memory_gib:g} GiB)")
            break
    return (f"no layout fits in {cluster.usable_bytes / GiB:.1f} GiB per GPU ({cluster.device.memory_gib:g} GiB less "
            f"--memory-reserve-gb {cluster.reserve_gib:g}): the closest, {describe_layout(p.layout)}, needs "
            f"{p.memory.device_total / GiB:.2f} GiB, {p.shortfall / GiB:.2f} GiB more"
            + (f"; a plan fits with {' or with '.join(knobs)}" if knobs else
               "; nor with 32 times the GPUs or a larger preset: give --global-batch-size room for more data parallel "
               "ranks, or shrink the model"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parsed = tool_args(argv, build_parser, _add_own)
    if isinstance(parsed, int):
        return parsed
    own, rest = parsed
    try:
        cluster = _cluster(own)
        rest, fixed = _fixed(rest)
        restrictions = _restrictions(own, fixed)
        config = plan_config(rest, 1, build_parser())  # the model and batch, at one rank
        if not any(w.split("=")[0] == "--global-batch-size" for w in rest):
            raise ConfigError("give --global-batch-size: the plan keeps the batch and chooses the micro-batch")
        base = plan_of(config)
        t0 = time.perf_counter()
        result = search(config.model, cluster, base, global_batch_size=config.schedule.global_batch_size,
                        precision=config.precision.dtype, optimizer=config.optim.type.lower(),
                        restrictions=restrictions)
        plans = _validated(result, rest, cluster.world, max(own.top, own.rehearse))
    except (ConfigError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    peak = cluster.device.peak(config.precision.dtype)
    d = cluster.device
    write_output(f"{cluster.world} x {d.name} ({cluster.gpus_per_node} per node; {d.memory_gib:g} GiB, "
                 f"{d.peak_tflops[config.precision.dtype]:g} TFLOP/s {config.precision.dtype}, "
                 f"HBM {d.hbm_gbps:g} GB/s, "
                 f"NVLink {d.intra_node_gbps:g} GB/s, network {d.inter_node_gbps:g} GB/s per GPU); "
                 f"{result.evaluated} layouts planned in {time.perf_counter() - t0:.1f} s, {len(result.plans)} fit in "
                 f"{cluster.usable_bytes / GiB:.1f} GiB (GEMM efficiency {GEMM_EFFICIENCY:g}: Narayanan et al. 2021, "
                 "Table 1, 1.7B)")
    if not plans:
        log.error("error: %s", _nothing_fits(result, config, base, cluster, restrictions))
        return 1 if result.closest is not None else 2
    best = plans[0]
    shown = plans[:own.top]
    write_output("\n".join(_table(shown, peak) + _explain(best, rest, cluster)))
    write_output("\n".join(_others(result.families, best, own.verbose)))
    reasons = [(f, family_reason(f, best)) for f in result.families]
    rehearsed = []
    if own.rehearse:
        write_output(f"rehearsing the top {min(own.rehearse, len(plans))} plans (tools/rehearse.py):")
        try:
            rehearsed = _rehearse(plans[:own.rehearse], rest, cluster.world)
        except Exception:  # noqa: BLE001 - the rehearsed run failed: its traceback, then exit 3
            log.exception("error: a rehearsal failed")
            return 3
    if own.json:
        doc = dict(cluster=dict(world=cluster.world, gpus_per_node=cluster.gpus_per_node, gpu=d.name,
                                memory_gib=d.memory_gib, reserve_gib=cluster.reserve_gib),
                   evaluated=result.evaluated, memory_terms=list(MEMORY_TERMS), time_terms=list(TIME_TERMS),
                   plans=[_plan_json(p, rest, peak) for p in shown],
                   rejected=[_family_json(f, why) for f, why in reasons if f.best is not best],
                   rehearsed=rehearsed)
        with open(own.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0
