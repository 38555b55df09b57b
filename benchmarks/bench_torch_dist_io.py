#!/usr/bin/env python
"""Bytes each rank writes and reads for a torch_dist checkpoint, against its share of the state.

    python benchmarks/bench_torch_dist_io.py                  # one decoder layer of a 13B model
    python benchmarks/bench_torch_dist_io.py --hidden 1024 --ffn 2816 --layers 2   # quicker

Four gloo ranks on this machine: an Adam engine at ``--save-layout`` (tp x dp, ZeRO stage) saves a
torch_dist checkpoint of a slice of Llama-2-13B's shape (hidden 5120, 40 heads, FFN 13824, one layer,
untied 8192-row vocabulary: 13B's per-layer tensors, 400M parameters); then engines at each
``--load-layouts`` entry resume it, weights and optimizer. Per rank: the bytes written (the ``.distcp``
file) against the state it owns (16 B per owned element: the weight, the fp32 master, two Adam moments),
and the bytes read against what it loads (12 B per element of its partition: master and moments; plus 4 B
per element of the TP shard it keeps resident beyond its partition, ZeRO-0/1/2's weights, read as fp32
masters). The ratios are what the format costs over the share. A measurement: it exits 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _model(args):
    from megazero.model import GPTConfig

    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                     ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=128, max_position_embeddings=128,
                     position_embedding_type="rope", activation="swiglu", normalization="rmsnorm",
                     add_bias_linear=False, tie_embeddings=False).validate()


def _engine(config, tp: int, stage: int):
    from megazero import mpu, zero
    from megazero.model import GPTModel

    mpu.initialize_model_parallel(tp)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    engine = zero.initialize(GPTModel(config, device="meta"), ds, mpu=mpu)
    for g in engine.groups:  # Adam's moments exist after a step: make them, as a step would
        state = engine.optimizer.state[g.master]
        state["step"] = torch.tensor(1.0)
        state["exp_avg"] = torch.full_like(g.master, 1e-3)
        state["exp_avg_sq"] = torch.full_like(g.master, 1e-6)
    return engine


def _rank(rank: int, world: int, port: int, job: dict, out: dict) -> None:
    import torch.distributed as dist

    from megazero import mpu
    from megazero.config.train_config import TrainConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config, (tp, stage) = job["config"], job["layout"]
        engine = _engine(config, tp, stage)
        owned = sum(n for g in engine.groups for *_, n in g.counted_slots(engine.tp_rank == 0))
        held = sum(g.shard_numel for g in engine.groups)
        if job["kind"] == "save":
            from megazero.checkpoint.torch_dist_save import stage_torch_dist

            cfg = TrainConfig(model=config)
            cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.world_size = tp, world // tp, world
            t0 = time.perf_counter()
            pending = stage_torch_dist(job["dir"], 1, engine, config=cfg.to_dict(),
                                       train_state={"iteration": 1, "consumed_samples": 0,
                                                    "lr_scheduler": {"max_lr": 1e-4, "min_lr": 0.0, "warmup_steps": 0,
                                                                     "decay_steps": 1, "decay_style": "constant",
                                                                     "num_steps": 0}})
            pending.write()
            pending.commit()
            seconds = time.perf_counter() - t0
            written = os.path.getsize(os.path.join(job["dir"], "iter_0000001", f"__{rank}_0.distcp"))
            result = {"bytes": written, "share": 16 * owned, "seconds": seconds}
        else:
            from megazero.checkpoint.megatron_resume import read_torch_dist

            t0 = time.perf_counter()
            state = read_torch_dist(job["dir"], engine, config)
            # what the rank holds from the file: master and moments of its partition, and (ZeRO-0/1/2 and
            # ZeRO-3's persistent parameters) the whole TP shard of the weights it keeps resident, read as masters
            resident = sum(g.numel - (g.shard_numel if g.partitions > 1 else g.numel) for g in engine.groups
                           if g.resident)
            result = {"bytes": state["bytes_read"], "share": 12 * held + 4 * resident,
                      "seconds": time.perf_counter() - t0}
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, out["path"])
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def _spawn(job: dict, world: int) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = {"path": os.path.join(tmp, "result.pt")}
        mp.spawn(_rank, args=(world, port, job, out), nprocs=world, join=True)
        return torch.load(out["path"])


def _layout(text: str) -> tuple[int, int]:
    tp, stage = text.split(":")
    return int(tp), int(stage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--ffn", type=int, default=13824)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--save-layout", type=_layout, default=(2, 1), help="TP:ZERO_STAGE of the saving run")
    ap.add_argument("--load-layouts", type=_layout, nargs="+", default=[(1, 3), (4, 1), (2, 2)])
    args = ap.parse_args()
    config = _model(args)
    print(f"model: {args.layers} layer(s), hidden {args.hidden}, ffn {args.ffn}, vocab {config.padded_vocab_size}; "
          f"{args.world} ranks")
    print(f"{'what':<28}{'rank':>5}{'MiB':>10}{'share MiB':>11}{'ratio':>8}{'s':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(f"save tp {args.save_layout[0]} ZeRO-{args.save_layout[1]}",
                 _spawn({"kind": "save", "config": config, "layout": args.save_layout, "dir": tmp}, args.world))]
        for layout in args.load_layouts:
            rows.append((f"load tp {layout[0]} ZeRO-{layout[1]}",
                         _spawn({"kind": "load", "config": config, "layout": layout, "dir": tmp}, args.world)))
    for what, ranks in rows:
        for r, x in enumerate(ranks):
            print(f"{what:<28}{r:>5}{x['bytes'] / 2**20:>10.1f}{x['share'] / 2**20:>11.1f}"
                  f"{x['bytes'] / x['share']:>8.3f}{x['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
