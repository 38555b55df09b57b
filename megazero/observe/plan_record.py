"""The published record the layout planner is checked against, and the check itself.

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1: ten GPT models (1.7B-1T, V = 51,200, s = 2048) on A100-80GB, 8 per node, fp16,
  no distributed optimizer, no sequence parallelism, full recompute (micro-batch and interleaving from
  Megatron-LM's ``examples/sc21/run_table_1.sh``), with their measured TFLOP/s per GPU. The 1.7B row
  calibrates :data:`~megazero.observe.plan_time.GEMM_EFFICIENCY`.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 5
  (configurations as calculon's ``validation/seqsel/tab5``): step times with full recompute and with
  selective recompute + sequence parallelism, out of sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megazero.observe.plan_devices import Cluster, device_preset
from megazero.observe.plan_search import Plan, Restrictions, evaluate, search
from megazero.observe.plan_time import Layout

__all__ = ["RecordRow", "NARAYANAN_2021", "KORTHIKANTI_2022", "row_flags", "row_plan", "row_search",
           "TABLE1_RESTRICTIONS", "calibrated_gemm_efficiency"]


@dataclass(frozen=True)
class RecordRow:
    """One published run: the model, its layout and what was measured."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    vpp: int = 1
    tflops: Optional[float] = None  # measured TFLOP/s per GPU (Narayanan)
    step_full_s: Optional[float] = None  # measured step time, full recompute (Korthikanti)
    step_selective_s: Optional[float] = None  # with selective recompute and sequence parallelism


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

# What the 2021 runs could use: fp16, ZeRO-0 (no distributed optimizer), no SP, full recompute, no CP.
TABLE1_RESTRICTIONS = Restrictions(zero_stages=(0,), recompute=("full",), sequence_parallel=(False,),
                                   context_parallel=False, offload=False)


def row_flags(row: RecordRow) -> list[str]:
    """``pretrain_gpt.py``'s model, batch and precision flags of ``row`` (GPT-3-style, fp16, the 2021-22
    attention kernel, which holds the s x s scores)."""
    return ["--num-layers", str(row.layers), "--hidden-size", str(row.hidden), "--num-attention-heads",
            str(row.heads), "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "51200",
            "--fp16", "--attention-backend", "unfused", "--global-batch-size", str(row.batch)]


def _setup(row: RecordRow):
    from megazero.observe.planner import plan_of
    from megazero.training.arguments import parse_args

    config = parse_args(row_flags(row), 1, check_files=False, planning=True)
    return config, plan_of(config), Cluster(row.gpus, 8, device_preset("a100-80gb"))


def row_plan(row: RecordRow, *, recompute: str = "full", sequence_parallel: bool = False) -> Plan:
    """The planner's plan of ``row`` at its published layout."""
    config, base, cluster = _setup(row)
    lay = Layout(tp=row.tp, pp=row.pp, dp=row.gpus // (row.tp * row.pp), vpp=row.vpp, zero_stage=0,
                 sequence_parallel=sequence_parallel, recompute=recompute, micro_batch_size=row.micro_batch)
    return evaluate(config.model, lay, cluster, base, global_batch_size=row.batch, precision="fp16",
                    optimizer="adamw")


def row_search(row: RecordRow, restrictions: Restrictions = TABLE1_RESTRICTIONS):
    """The planner's search for ``row``'s model and cluster (by default restricted to 2021's features)."""
    config, base, cluster = _setup(row)
    return search(config.model, cluster, base, global_batch_size=row.batch, precision="fp16",
                  restrictions=restrictions)


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
