#!/usr/bin/env python
"""Pipeline parallelism on CPU processes: tokens/s, peak memory per rank and the measured bubble.

Four processes (gloo, one thread each) train the same GPT with the same global batch:

* pp 2 x tp 2, 1F1B                      (m micro-batches per step through the pipeline)
* pp 2 x tp 2, interleaved 1F1B, v = 2
* pp 1 x tp 2 x dp 2                     (the baseline: no pipeline)

The measured bubble is the share of a step a pipeline rank spends waiting in its
point-to-point exchanges (idle + transfer time), averaged over ranks, printed beside the
schedule's (pp - 1) / (v m). Figures only, not a test:

    python benchmarks/bench_pipeline.py [--steps 6] [--micro-batches 8]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ranks import run_ranks  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 8, 256, 8, 128, 4096, 2


def _config():
    from megazero.model import GPTConfig

    return GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                     seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                     attention_backend="math")


def _ds(accum: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}


def _run(rank: int, world: int, layout: dict, steps: int, m_global: int) -> dict:
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from megazero.model.pipeline_split import build_pipeline_model
    from megazero.pipeline import PipelineStage

    pp, tp, v = layout["pp"], layout["tp"], layout.get("v", 1)
    groups = mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=v if v > 1 else None)
    mpu.model_parallel_manual_seed(1234)
    dp = groups.dp_size
    m = m_global // dp  # micro-batches per DP rank per step: the same global batch for every layout
    cfg = _config()
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (steps + 1, m_global, MICRO, SEQ + 1), generator=g)
    waited = [0.0]
    if pp > 1:
        module, chunks = build_pipeline_model(cfg, groups, device="meta")
        engine = zero.initialize(module, _ds(m), mpu=mpu)
        stage = PipelineStage(engine, chunks, groups, micro_batch_size=MICRO, seq_length=SEQ)
        exchange = stage.p2p.exchange

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return exchange(*a, **k)
            finally:
                waited[0] += time.perf_counter() - t0

        stage.p2p.exchange = timed

        def step(i):
            stage.train_step([(data[i, j, :, :-1], data[i, j, :, 1:]) for j in range(m)])
    else:
        engine = zero.initialize(GPTModel(cfg, device="meta"), _ds(m), mpu=mpu)
        lo = groups.dp_rank * m

        def step(i):
            for j in range(lo, lo + m):
                engine.backward(engine(data[i, j, :, :-1], labels=data[i, j, :, 1:]).mean())
                engine.step()

    step(0)  # warm-up
    dist.barrier()
    waited[0] = 0.0
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    tokens = steps * m_global * MICRO * SEQ
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = dict(tokens_per_s=tokens / elapsed, peak_mib=peak_mib, bubble=waited[0] / elapsed,
                  state_mib=engine.model_state_bytes()["total"] / 2 ** 20)
    mpu.shutdown_distributed()
    return result


def measure(layout: dict, steps: int, m_global: int) -> list[dict]:
    return run_ranks(4, _run, layout, steps, m_global, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batches", "--microbatches", dest="micro_batches", type=int, default=8,
                    help="micro-batches per step over the whole batch")
    a = ap.parse_args()
    layouts = [("pp 2 x tp 2, 1F1B", dict(pp=2, tp=2)), ("pp 2 x tp 2, interleaved v 2", dict(pp=2, tp=2, v=2)),
               ("pp 1 x tp 2 x dp 2", dict(pp=1, tp=2))]
    print(f"GPT {LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, vocab {VOCAB}; global batch {a.micro_batches} x "
          f"{MICRO} sequences; {a.steps} timed steps, 4 processes x 1 thread (gloo)")
    print(f"{'layout':<32}{'tokens/s':>10}{'peak RSS MiB/rank':>30}{'state MiB/rank':>26}{'bubble meas.':>14}"
          f"{'(pp-1)/(v m)':>14}")
    base = None
    for name, layout in layouts:
        r = measure(layout, a.steps, a.micro_batches)
        tps = r[0]["tokens_per_s"]
        base = base or tps
        pp, v = layout["pp"], layout.get("v", 1)
        formula = (pp - 1) / (v * a.micro_batches) if pp > 1 else 0.0
        bubble = sum(x["bubble"] for x in r) / len(r) if pp > 1 else 0.0
        peaks = " / ".join(f"{x['peak_mib']:.0f}" for x in r)
        states = " / ".join(f"{x['state_mib']:.1f}" for x in r)
        print(f"{name:<32}{tps:>10.0f}{peaks:>30}{states:>26}{bubble:>14.3f}{formula:>14.3f}")


if __name__ == "__main__":
    main()
