#!/usr/bin/env python
"""The optimizer step of Muon against AdamW's at the same layout, through the ZeRO engine.

    python benchmarks/bench_muon.py                          # 2 ranks (dp 2), ZeRO-1, 5 interleaved repeats
    python benchmarks/bench_muon.py --world 4 --tp 2 --stage 3 --hidden 768 --tp-mode distributed
    python benchmarks/bench_muon.py --device cuda --world 1 --hidden 4096 --layers 4   # on a GPU

Each repeat builds the same dense GPT (SwiGLU, RoPE, no biases) twice, once per optimizer, and runs
``--iters`` iterations of forward, backward and ``engine.step()``; the step's wall time (the engine's
reduction, norm, update and publication) and the forward + backward time are taken per iteration, the
first two left out. Runs alternate within every repeat. The table gives the medians over repeats with
Muon's ratios against AdamW's, the Newton-Schulz FLOPs of a step against the model's training FLOPs
(6 x parameters x tokens), and the bytes rank 0 sent in Muon's exchanges per step (the engine's
counters). A measurement: it exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95, "betas": [0.9, 0.95],
                                        "eps": 1e-8, "weight_decay": 0.1}},
}


def _model_config(args):
    from megazero.model.config import GPTConfig

    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                     ffn_hidden_size=int(args.hidden * 8 / 3) // 64 * 64, vocab_size=8192, seq_length=args.seq,
                     max_position_embeddings=args.seq, activation="swiglu", normalization="rmsnorm",
                     position_embedding_type="rope", add_bias_linear=False, hidden_dropout=0.0,
                     attention_dropout=0.0, make_vocab_size_divisible_by=128)


def _worker(rank: int, world: int, args, port: int, out) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=rank, world_size=world)
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from megazero.zero.config import MuonConfig, load_config
    from megazero.zero.matrix_exchange import ns_cost

    mpu.initialize_model_parallel(args.tp)
    dp = mpu.get_data_parallel_world_size()
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
    results = {}
    for repeat in range(args.repeats):
        for name in (("adamw", "muon") if repeat % 2 == 0 else ("muon", "adamw")):
            torch.manual_seed(0)
            model = GPTModel(_model_config(args), device="meta")
            cfg = {"train_micro_batch_size_per_gpu": args.micro, "optimizer": OPTIMIZERS[name],
                   "zero_optimization": {"stage": args.stage}, "gradient_clipping": 1.0}
            cfg = load_config(cfg)
            if name == "muon":  # the JSON's Muon (torch.optim.Muon's update) with the TP mode asked for
                cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(
                    cfg.optimizer, muon=MuonConfig(tp_mode=args.tp_mode)))
            engine = zero.initialize(model, cfg, mpu=mpu, device=device)
            tokens = torch.randint(0, 8192, (args.micro, args.seq + 1), device=device)
            steps, passes = [], []
            for it in range(args.iters):
                t0 = time.perf_counter()
                engine.backward(engine(tokens[:, :-1], labels=tokens[:, 1:]).mean())
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                engine.comm.reset()
                engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                if it >= 2:
                    passes.append(t1 - t0)
                    steps.append(t2 - t1)
            entry = results.setdefault(name, {"step": [], "pass": []})
            entry["step"].append(statistics.median(steps))
            entry["pass"].append(statistics.median(passes))
            if name == "muon":
                sent = {k: v for k, v in engine.comm.snapshot().items() if k.startswith("all_to_all") or "/muon" in k}
                params = sum(p.numel() for p in model.parameters()) * args.tp
                ns = sum(ns_cost(m.shape) * 2 for ex in engine.muon.exchanges for m in ex.matrices)
                results["muon_info"] = {"sent": sent, "ns_flops": ns, "train_flops": 6 * params * args.micro * args.seq
                                        * dp, "describe": engine.muon.describe(), "params": params}
            del engine, model
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp-mode", default="duplicated", choices=("duplicated", "distributed", "blockwise"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, args.world, args, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = out.get()
    for p in procs:
        p.join()
    info = results.pop("muon_info")
    print(f"dense GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro {args.micro}: "
          f"{info['params'] / 1e6:.1f}M parameters; world {args.world} = tp {args.tp} x dp "
          f"{args.world // args.tp}, ZeRO-{args.stage}, {args.device}, {args.repeats} interleaved repeats, "
          f"--muon-tp-mode {args.tp_mode}")
    print(f"Muon: {info['describe']}")
    print(f"{'':8} {'step ms':>10} {'fwd+bwd ms':>12} {'step / iteration':>18}")
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in results.items()}
    for name, m in med.items():
        print(f"{name:8} {m['step'] * 1e3:10.1f} {m['pass'] * 1e3:12.1f} {m['step'] / (m['step'] + m['pass']):18.3f}")
    a, b = med["adamw"], med["muon"]
    spread = [s / t for s, t in zip(results["muon"]["step"], results["adamw"]["step"])]
    print(f"muon / adamw: step {b['step'] / a['step']:.2f}x (repeats {min(spread):.2f}-{max(spread):.2f}), "
          f"iteration {(b['step'] + b['pass']) / (a['step'] + a['pass']):.2f}x")
    print(f"Newton-Schulz FLOPs per step {info['ns_flops']:.3g} = {info['ns_flops'] / info['train_flops']:.3f} x "
          f"the step's training FLOPs (6 N tokens, all ranks); rank 0 sent per step: "
          + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in info["sent"].items()))


if __name__ == "__main__":
    main()
