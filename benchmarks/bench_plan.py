#!/usr/bin/env python
"""The layout planner (tools/plan.py) against the published record, its speed, and the rehearsal.

    python benchmarks/bench_plan.py                 # record + search speed (about a minute)
    python benchmarks/bench_plan.py --rehearse      # + today's shapes: top plan rehearsed, every stage

Prints what shaped the time model (validation sets: Narayanan et al. 2021 Table 1, its published TFLOP/s
per GPU against the prediction at the published layout, restricted to that paper's features, with where
the published (tp, pp) ranks among the planner's families and the best constant's error; Korthikanti et al.
2022 Table 5, step times with full recompute and with selective + SP; the calibration of GEMM_EFFICIENCY
on Table 1's 1.7B row), then what it never saw (megazero/observe/plan_record.py: Narayanan et al.'s
Table 2 and Figures 13-16, Megatron-LM's H100 weak-scaling table, each against Table 1's mean utilization);
how long full searches take on one core; with --rehearse, each of today's shapes' best plan rehearsed
(tools/rehearse.py's loop on meta tensors) on every pipeline stage, predicted against rehearsed peak. A
measurement: it exits 0.
"""


from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.observe.plan_devices import Cluster, device_preset  # noqa: E402
from megazero.observe.plan_record import (KORTHIKANTI_2022, MEGATRON_LM_2024, NARAYANAN_2021,  # noqa: E402
                                          NARAYANAN_2021_SWEEPS, NARAYANAN_2021_TABLE2, NARAYANAN_2021_ZERO3,
                                          calibrated_gemm_efficiency, constant_baseline, predicted_tflops,
                                          row_best, row_plan, row_search, sweep_result)
from megazero.observe.plan_search import describe_layout, layout_args, search  # noqa: E402
from megazero.observe.plan_time import GEMM_EFFICIENCY  # noqa: E402
from megazero.observe.planner import GiB, plan_of  # noqa: E402
from megazero.config.arguments import parse_args  # noqa: E402

_LLAMA = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
          "--group-query-attention --num-query-groups 8 --position-embedding-type rope --no-position-embedding "
          "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
          "--attention-dropout 0.0 --hidden-dropout 0.0 --vocab-size 128256 --bf16")
SHAPES = {  # name: (GPUs, GPU, pretrain_gpt.py flags)
    "Llama-3-8B, 8K": (64, "h100-80gb", _LLAMA + " --seq-length 8192 --max-position-embeddings 8192 "
                                                 "--global-batch-size 512"),
    "Llama-3-8B, 128K": (64, "h100-80gb", _LLAMA + " --seq-length 131072 --max-position-embeddings 131072 "
                                                   "--global-batch-size 32"),
    "Mixtral-8x7B": (64, "h100-80gb", "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
                     "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 4096 "
                     "--max-position-embeddings 32768 --position-embedding-type rope --no-position-embedding "
                     "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
                     "--attention-dropout 0.0 --hidden-dropout 0.0 --num-experts 8 --moe-router-topk 2 "
                     "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
                     "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --vocab-size 32000 --bf16 "
                     "--global-batch-size 256"),
    "DeepSeek-V3": (1024, "h100-80gb", "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
                    "--num-attention-heads 128 --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
                    "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --seq-length 4096 "
                    "--max-position-embeddings 4096 --position-embedding-type rope --no-position-embedding "
                    "--mtp-num-layers 1 --normalization RMSNorm --swiglu --disable-bias-linear "
                    "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 "
                    "--num-experts 256 --moe-ffn-hidden-size 2048 --moe-layer-freq ([0]*3+[1]*58) "
                    "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-score-function "
                    "sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss "
                    "--moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
                    "--vocab-size 129280 --bf16 --global-batch-size 4096"),
}


def _mean_max(errors: list[float]) -> str:
    return f"|error| mean {100 * statistics.mean(map(abs, errors)):.1f} %, max {100 * max(map(abs, errors)):.1f} %"


def narayanan() -> None:
    print("Narayanan et al. 2021, Table 1 (A100-80GB, fp16, ZeRO-0, no SP, full recompute): validation set")
    print(f"{'model':>8} {'published layout':>22} {'TFLOP/s':>8} {'predicted':>10} {'error':>7} "
          f"{'rank of (tp,pp)':>16}  planner's pick")
    errors, top3 = [], 0
    for row in NARAYANAN_2021:
        plan = row_plan(row)
        ranked = [f for f in row_search(row).families if f.best]
        keys = [(f.key[0], f.key[2]) for f in ranked]
        rank = keys.index((row.tp, row.pp)) + 1 if (row.tp, row.pp) in keys else None
        top3 += rank is not None and rank <= 3
        err = plan.tflops_per_gpu / row.tflops - 1
        errors.append(err)
        layout = f"tp {row.tp} pp {row.pp} v {row.vpp} mbs {row.micro_batch}"
        print(f"{row.name:>8} {layout:>22} {row.tflops:>8.0f} {plan.tflops_per_gpu:>10.1f} {100 * err:>+6.1f}% "
              f"{str(rank):>16}  {describe_layout(ranked[0].best.layout)} ({ranked[0].best.tflops_per_gpu:.0f})")
    rest = NARAYANAN_2021[1:]
    constant = min((statistics.mean(abs(c / r.tflops - 1) for r in rest), c) for c in (r.tflops for r in rest))
    print(f"published (tp, pp) in the top 3: {top3}/10; without the calibration row {_mean_max(errors[1:])}; the "
          f"best constant ({constant[1]:.0f} TFLOP/s) {100 * constant[0]:.1f} % mean\n")


def korthikanti() -> None:
    print("Korthikanti et al. 2022, Table 5 (A100-80GB, fp16, step seconds): validation set")
    print(f"{'model':>6} {'layout':>18} {'full':>7} {'predicted':>10} {'error':>7} {'sel+SP':>8} {'predicted':>10} "
          f"{'error':>7}")
    errors = []
    for row in KORTHIKANTI_2022:
        full, sel = row_plan(row), row_plan(row, recompute="selective", sequence_parallel=True)
        e1, e2 = full.step_time_s / row.step_full_s - 1, sel.step_time_s / row.step_selective_s - 1
        errors += [e1, e2]
        print(f"{row.name:>6} {f'tp {row.tp} pp {row.pp} v {row.vpp}':>18} {row.step_full_s:>7.2f} "
              f"{full.step_time_s:>10.2f} {100 * e1:>+6.1f}% {row.step_selective_s:>8.2f} {sel.step_time_s:>10.2f} "
              f"{100 * e2:>+6.1f}%")
    print(f"{_mean_max(errors)}\n")


def held_out() -> None:
    print("held out: TFLOP/s per GPU, published against the planner's best plan with the published choices fixed, "
          "and against Table 1's mean utilization")
    for title, rows in (("Narayanan et al. 2021, Table 2, PTD-P (A100)", NARAYANAN_2021_TABLE2),
                        ("Narayanan et al. 2021, Table 2, ZeRO-3 without model parallelism (A100)",
                         NARAYANAN_2021_ZERO3),
                        ("Megatron-LM README, weak scaling (H100, Megatron-Core r0.8.0)", MEGATRON_LM_2024)):
        print(title)
        ours, const = [], []
        for row in rows:
            plan = row_best(row)
            tflops, base = predicted_tflops(row, plan), constant_baseline(row)
            ours.append(tflops / row.tflops - 1)
            const.append(base / row.tflops - 1)
            print(f"  {row.name:>7} {row.gpus:>5} GPUs, batch {row.batch:>5}: {row.tflops:>6.1f} published, "
                  f"{tflops:>6.1f} predicted ({100 * ours[-1]:+.1f} %; constant {100 * const[-1]:+.1f} %)  "
                  f"{describe_layout(plan.layout)}{'' if plan.fits else ' [does not fit, by the planner]'}")
        print(f"  planner {_mean_max(ours)}; constant {_mean_max(const)}")
    print("Narayanan et al. 2021, Sec. 5.4-5.5: the finding each text states, and the planner's TFLOP/s per GPU")
    for sweep in NARAYANAN_2021_SWEEPS:
        print(f"  {sweep.figure}: \"{sweep.finding}\"; points (tp, pp, mbs) {list(sweep.points)}")
        for batch, got, holds in sweep_result(sweep):
            print(f"    batch {batch:>4}: {' '.join(f'{g:.1f}' for g in got)}  {'holds' if holds else 'DOES NOT hold'}")
    print()


def _setup(flags: str):
    config = parse_args(flags.split(), 1, check_files=False, planning=True)
    return config, plan_of(config)


def speed() -> None:
    print("full searches on one core")
    cases = {"1T GPT (Table 1's), 3072 x a100-80gb": (3072, "a100-80gb", " ".join(
        ["--num-layers 128 --hidden-size 25600 --num-attention-heads 160 --seq-length 2048",
         "--max-position-embeddings 2048 --vocab-size 51200 --bf16 --global-batch-size 3072"]))}
    cases.update({f"{k}, {v[0]} x {v[1]}": v for k, v in SHAPES.items()})
    for name, (world, gpu, flags) in cases.items():
        config, base = _setup(flags)
        t0 = time.perf_counter()
        found = search(config.model, Cluster(world, 8, device_preset(gpu)), base,
                       global_batch_size=config.schedule.global_batch_size, precision=config.precision.dtype)
        best = found.plans[0]
        print(f"  {name}: {found.evaluated} layouts in {time.perf_counter() - t0:.1f} s; best "
              f"{describe_layout(best.layout)}, {best.step_time_s:.2f} s, {best.tflops_per_gpu:.0f} TFLOP/s")
    print()


def rehearse() -> None:
    from megazero.observe.rehearsal import rehearsal_config, rehearse_rank

    print("today's shapes: the best plan's predicted against rehearsed peak (GiB, without NCCL)")
    for name, (world, gpu, flags) in SHAPES.items():
        config, base = _setup(flags)
        cluster = Cluster(world, 8, device_preset(gpu))
        best = search(config.model, cluster, base, global_batch_size=config.schedule.global_batch_size,
                      precision=config.precision.dtype).plans[0]
        lay = best.layout
        rc, _ = rehearsal_config(flags.split() + layout_args(lay), world, micro_batches=lay.pp * lay.vpp)
        for stage in range(lay.pp):
            t0 = time.perf_counter()
            peak = rehearse_rank(rc, stage * world // lay.pp).peak_bytes
            predicted = best.stage_peak_bytes[stage]
            print(f"  {name} ({describe_layout(lay)}), stage {stage}: predicted {predicted / GiB:.2f}, rehearsed "
                  f"{peak / GiB:.2f} ({100 * (predicted / peak - 1):+.1f} %; device {cluster.device.memory_gib:g}) "
                  f"[{time.perf_counter() - t0:.0f} s]")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rehearse", action="store_true", help="also rehearse today's shapes' best plans")
    args = p.parse_args()
    print(f"GEMM_EFFICIENCY {GEMM_EFFICIENCY:g} in megazero/observe/plan_time.py; calibrated on Table 1's 1.7B row: "
          f"{calibrated_gemm_efficiency():.4f}\n")
    narayanan()
    korthikanti()
    held_out()
    speed()
    if args.rehearse:
        rehearse()
    return 0


if __name__ == "__main__":
    sys.exit(main())
