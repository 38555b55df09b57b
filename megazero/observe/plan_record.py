"""The published record the layout planner is checked against, and the check itself.

**What shaped the time model** (validation sets: the model was chosen while looking at them, so they say
how well it fits, not how well it predicts):

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21), Table 1: ten GPT models (1.7B-1T, V = 51,200, s = 2048) on A100-80GB, 8 per node,
  fp16, no distributed optimizer, no sequence parallelism, full recompute (micro-batch and interleaving
  from Megatron-LM's ``examples/sc21/run_table_1.sh``), with their measured TFLOP/s per GPU. The 1.7B row
  calibrates :data:`~megazero.observe.plan_time.GEMM_EFFICIENCY`; the hand-set constants were chosen with
  the other nine in view.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 5
  (configurations as calculon's ``validation/seqsel/tab5``): step times with full recompute and with
  selective recompute + sequence parallelism. The time model's per-layer overhead
  (``LAYER_OVERHEAD_S``) replaced a token-dimension penalty because that earlier form missed these eight
  times by 12.3 % mean, 22.2 % max.

**Held out** (never used to choose or check the model before these checks were written; each result
stands as it came out):

- Narayanan et al. 2021, Table 2: the PTD-P rows (174.6B at model-parallel size 96 and 529.6B at 280,
  micro-batch 1, fixed global batch, 2-4x the GPUs), read as tp 8 (the paper's rule: tensor parallelism
  up to the node) x pp 12 and x pp 35; the interleaving is not given, so the planner picks it. And its
  ZeRO-3 rows (DeepSpeed's ZeRO-3 of 2021, no model parallelism, full recompute assumed as in the
  paper's FLOP count), which the planner prices as megazero's ZeRO-3.
- Narayanan et al. 2021, Sec. 5.4-5.5, Figures 13-16: layouts compared at one model, 64 A100s and a
  batch (configurations from Megatron-LM's ``examples/sc21/run_figure_1[3-6].sh``: mbs 1 unless swept,
  full recompute, fp16). The figures' values are not in the text; what is checked is the finding the
  text states (:data:`NARAYANAN_2021_SWEEPS`). The caption of Figure 14 names three batch sizes, its
  script two (32, 512): those two are used.
- Megatron-LM's README, the weak-scaling table (``images/model_table.png``, added in commit f2e5db4 of
  2024-07-15: Megatron-Core r0.8.0 on H100, V = 131,072, s = 4096, untied embeddings, bf16, with DP, TP
  and PP communication overlapped), nine GPT models 1.7B-462B with their TFLOP/s per GPU in Megatron's
  count (``num_floating_point_operations``: no recompute, the whole attention square). The table gives
  tp, pp and dp, not the micro-batch, recompute or interleaving: the planner picks those.

A constant baseline rides along: Table 1's mean utilization (145.9 TFLOP/s of the A100's 312) at the
row's device, what a planner that knew nothing but Table 1 would say.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Optional

from megazero.model.flops import flops_per_iteration
from megazero.observe.plan_devices import Cluster, device_preset
from megazero.observe.plan_search import Plan, Restrictions, evaluate, search
from megazero.observe.plan_time import Layout

__all__ = ["Setting", "RecordRow", "Sweep", "NARAYANAN_2021", "KORTHIKANTI_2022", "NARAYANAN_2021_TABLE2",
           "NARAYANAN_2021_ZERO3", "NARAYANAN_2021_SWEEPS", "MEGATRON_LM_2024", "A100_2021", "H100_2024",
           "row_flags", "row_plan", "row_search", "row_best", "predicted_tflops", "constant_baseline",
           "sweep_result", "TABLE1_RESTRICTIONS", "calibrated_gemm_efficiency"]

# What the 2021 runs could use: fp16, ZeRO-0 (no distributed optimizer), no SP, full recompute, no CP.
TABLE1_RESTRICTIONS = Restrictions(zero_stages=(0,), recompute=("full",), sequence_parallel=(False,),
                                   context_parallel=False, offload=False)


@dataclass(frozen=True)
class Setting:
    """What a published table ran on, beside each row's model and layout."""

    gpu: str  # the device preset
    precision: str
    seq: int
    vocab: int
    flags: tuple  # further pretrain_gpt.py flags (the attention kernel, untied embeddings)
    restrictions: Restrictions  # what the runs could use, for a search
    counts_recompute: bool  # the published TFLOP/s count the recomputed forward (Narayanan's 96 B s l h^2)


# 2021-22 on A100: the attention kernel that holds the s x s scores.
A100_2021 = Setting("a100-80gb", "fp16", 2048, 51200, ("--attention-backend", "unfused"), TABLE1_RESTRICTIONS,
                    True)
# Megatron-Core r0.8.0 on H100: flash attention, the layout's dp as published (no CP), no offload.
H100_2024 = Setting("h100-80gb", "bf16", 4096, 131072, ("--untie-embeddings-and-output-weights",),
                    Restrictions(cp=1, context_parallel=False, offload=False), False)


@dataclass(frozen=True)
class RecordRow:
    """One published run: the model, its layout (None: not published) and what was measured."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: Optional[int]
    vpp: Optional[int] = 1
    tflops: Optional[float] = None  # measured TFLOP/s per GPU
    step_full_s: Optional[float] = None  # measured step time, full recompute (Korthikanti)
    step_selective_s: Optional[float] = None  # with selective recompute and sequence parallelism
    zero_stage: Optional[int] = 0
    setting: Setting = A100_2021


NARAYANAN_2021 = (
    RecordRow("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, tflops=137),
    RecordRow("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, tflops=138),
    RecordRow("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, tflops=142),
    RecordRow("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, tflops=135),
    RecordRow("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, tflops=138),
    RecordRow("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, vpp=3, tflops=140),
    RecordRow("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, vpp=2, tflops=148),
    RecordRow("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, vpp=2, tflops=155),
    RecordRow("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, vpp=3, tflops=163),
    RecordRow("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, tflops=163),
)

KORTHIKANTI_2022 = (
    RecordRow("22B", 64, 6144, 48, 8, 1, 8, 4, 4, step_full_s=1.42, step_selective_s=1.10),
    RecordRow("175B", 96, 12288, 96, 8, 8, 64, 64, 1, vpp=3, step_full_s=18.13, step_selective_s=13.75),
    RecordRow("530B", 128, 20480, 105, 8, 35, 280, 280, 1, vpp=3, step_full_s=49.05, step_selective_s=37.83),
    RecordRow("1T", 160, 25600, 128, 8, 64, 512, 512, 1, step_full_s=94.42, step_selective_s=71.49),
)

NARAYANAN_2021_TABLE2 = (
    RecordRow("174.6B", 96, 12288, 96, 8, 12, 384, 1536, 1, vpp=None, tflops=153),
    RecordRow("174.6B", 96, 12288, 96, 8, 12, 768, 1536, 1, vpp=None, tflops=149),
    RecordRow("174.6B", 96, 12288, 96, 8, 12, 1536, 1536, 1, vpp=None, tflops=141),
    RecordRow("529.6B", 128, 20480, 105, 8, 35, 560, 2240, 1, vpp=None, tflops=171),
    RecordRow("529.6B", 128, 20480, 105, 8, 35, 1120, 2240, 1, vpp=None, tflops=167),
    RecordRow("529.6B", 128, 20480, 105, 8, 35, 2240, 2240, 1, vpp=None, tflops=159),
)

NARAYANAN_2021_ZERO3 = (
    RecordRow("174.6B", 96, 12288, 96, 1, 1, 384, 1536, 4, tflops=144, zero_stage=3),
    RecordRow("174.6B", 96, 12288, 96, 1, 1, 768, 1536, 2, tflops=88, zero_stage=3),
    RecordRow("174.6B", 96, 12288, 96, 1, 1, 1536, 1536, 1, tflops=44, zero_stage=3),
    RecordRow("529.6B", 128, 20480, 105, 1, 1, 640, 2560, 4, tflops=138, zero_stage=3),
    RecordRow("529.6B", 128, 20480, 105, 1, 1, 1120, 2240, 2, tflops=98, zero_stage=3),
    RecordRow("529.6B", 128, 20480, 105, 1, 1, 2240, 2240, 1, tflops=48, zero_stage=3),
)


def _h100(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
          tflops: float) -> RecordRow:
    return RecordRow(name, heads, hidden, layers, tp, pp, gpus, batch, None, vpp=None, tflops=tflops,
                     zero_stage=None, setting=H100_2024)


MEGATRON_LM_2024 = (
    _h100("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _h100("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _h100("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _h100("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _h100("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _h100("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _h100("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _h100("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _h100("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)


@dataclass(frozen=True)
class Sweep:
    """Layouts the paper compared at one model, GPU count and batch size, and the finding its text states."""

    figure: str
    heads: int
    hidden: int
    layers: int
    gpus: int
    batches: tuple
    points: tuple  # (tp, pp, micro-batch) compared
    best: Optional[int]  # index of the point the text names best; None: the text has throughput fall along points
    finding: str  # the text's words


NARAYANAN_2021_SWEEPS = (
    Sweep("Figure 13 (162.2B)", 128, 20480, 32, 64, (32, 128), ((32, 2, 1), (16, 4, 1), (8, 8, 1), (4, 16, 1),
                                                                (2, 32, 1)), 2,
          "peak performance when the tensor-parallel size is equal to the number of GPUs in a single node"),
    Sweep("Figure 14 (5.9B)", 32, 3840, 32, 64, (32, 512), ((1, 2, 1), (1, 4, 1), (1, 8, 1), (1, 16, 1),
                                                            (1, 32, 1)), None,
          "for each batch size, the throughput decreases as the pipeline-parallel size increases"),
    Sweep("Figure 15 (5.9B)", 32, 3840, 32, 64, (32, 128, 512), ((2, 1, 1), (4, 1, 1), (8, 1, 1), (16, 1, 1),
                                                                 (32, 1, 1)), None,
          "as the tensor-model-parallel size increases, [...] decreasing utilization on each GPU"),
    Sweep("Figure 16 (91B)", 128, 15360, 32, 64, (128, 512), ((8, 8, 1), (8, 8, 2), (8, 8, 4), (8, 8, 8)), 1,
          "the best microbatch size is 2 for this model"),
)


def row_flags(row: RecordRow) -> list[str]:
    """``pretrain_gpt.py``'s model, batch and precision flags of ``row`` (GPT-3-style, its setting's)."""
    s = row.setting
    return ["--num-layers", str(row.layers), "--hidden-size", str(row.hidden), "--num-attention-heads",
            str(row.heads), "--seq-length", str(s.seq), "--max-position-embeddings", str(s.seq), "--vocab-size",
            str(s.vocab), f"--{s.precision}", *s.flags, "--global-batch-size", str(row.batch)]


def _setup(row: RecordRow):
    from megazero.config.arguments import parse_args
    from megazero.observe.planner import plan_of

    config = parse_args(row_flags(row), 1, check_files=False, planning=True)
    return config, plan_of(config), Cluster(row.gpus, 8, device_preset(row.setting.gpu))


def row_plan(row: RecordRow, *, recompute: str = "full", sequence_parallel: bool = False) -> Plan:
    """The planner's plan of ``row`` at its published layout (every choice published)."""
    config, base, cluster = _setup(row)
    lay = Layout(tp=row.tp, pp=row.pp, dp=row.gpus // (row.tp * row.pp), vpp=row.vpp, zero_stage=row.zero_stage,
                 sequence_parallel=sequence_parallel, recompute=recompute, micro_batch_size=row.micro_batch)
    return evaluate(config.model, lay, cluster, base, global_batch_size=row.batch, precision=row.setting.precision,
                    optimizer="adamw")


def row_search(row: RecordRow, restrictions: Optional[Restrictions] = None):
    """The planner's search for ``row``'s model and cluster (by default within its setting's features)."""
    config, base, cluster = _setup(row)
    return search(config.model, cluster, base, global_batch_size=row.batch, precision=row.setting.precision,
                  restrictions=restrictions or row.setting.restrictions)


def row_best(row: RecordRow) -> Plan:
    """The planner's fastest plan with what ``row`` publishes fixed (tp, pp and, where given, the micro-batch,
    interleaving and ZeRO stage) and the rest its own pick within the setting; when the planner finds no
    such plan fits, its closest (the run did fit: a miss of the memory model)."""
    if None not in (row.micro_batch, row.vpp, row.zero_stage):
        return row_plan(row)
    r = replace(row.setting.restrictions, tp=row.tp, pp=row.pp, cp=1, micro_batch_size=row.micro_batch,
                vpp=row.vpp)
    if row.zero_stage is not None:
        r = replace(r, zero_stages=(row.zero_stage,))
    found = row_search(row, r)
    return found.plans[0] if found.plans else found.closest


def predicted_tflops(row: RecordRow, plan: Plan) -> float:
    """``plan``'s TFLOP/s per GPU in the count ``row``'s source reports."""
    if row.setting.counts_recompute:
        return plan.tflops_per_gpu
    config, _, _ = _setup(row)
    flops = flops_per_iteration(config.model.replace(vocab_padding_tp=plan.layout.tp), row.batch)
    return flops / plan.step_time_s / plan.world / 1e12


def constant_baseline(row: RecordRow) -> float:
    """Table 1's mean utilization at ``row``'s device: TFLOP/s per GPU (145.9 on an A100)."""
    a100 = device_preset("a100-80gb").peak_tflops["fp16"]
    mean = statistics.mean(r.tflops for r in NARAYANAN_2021)
    return mean / a100 * device_preset(row.setting.gpu).peak_tflops[row.setting.precision]


def sweep_result(sweep: Sweep) -> list[tuple[int, list[float], bool]]:
    """Per batch size: the predicted TFLOP/s per GPU at each point and whether the stated finding holds."""
    out = []
    for batch in sweep.batches:
        got = [row_plan(RecordRow(sweep.figure, sweep.heads, sweep.hidden, sweep.layers, tp, pp, sweep.gpus, batch,
                                  mbs)).tflops_per_gpu for tp, pp, mbs in sweep.points]
        holds = got.index(max(got)) == sweep.best if sweep.best is not None else \
            all(a > b for a, b in zip(got, got[1:]))
        out.append((batch, got, holds))
    return out


def calibrated_gemm_efficiency(row: RecordRow = NARAYANAN_2021[0], *, tolerance: float = 1e-4) -> float:
    """The :data:`~megazero.observe.plan_time.GEMM_EFFICIENCY` at which the planner predicts ``row``'s
    published TFLOP/s at its published layout (bisection; predicted throughput grows with the constant)."""
    from megazero.observe import plan_time

    saved, (lo, hi) = plan_time.GEMM_EFFICIENCY, (0.2, 1.0)
    try:
        while hi - lo > tolerance:
            plan_time.GEMM_EFFICIENCY = (lo + hi) / 2
            lo, hi = (plan_time.GEMM_EFFICIENCY, hi) if row_plan(row).tflops_per_gpu < row.tflops else \
                (lo, plan_time.GEMM_EFFICIENCY)
    finally:
        plan_time.GEMM_EFFICIENCY = saved
    return (lo + hi) / 2
