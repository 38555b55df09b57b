#!/usr/bin/env python
"""Optimizer and parameter offload on a ~100M-parameter GPT: memory, bytes moved per step, the host step's speed.

    python benchmarks/bench_offload.py                 # ~6 min on a quiet 2-core machine
    python benchmarks/bench_offload.py --num-layers 2  # smoke run
    python benchmarks/bench_offload.py --pretrain      # pretrain_gpt.py, dp 2, NVMe: RSS saved vs moved

One process (dp 1: the whole partition is this rank's), fp32, seq 64, one sequence, each
configuration in a process of its own: ZeRO-1 with ``offload_optimizer.device`` none / cpu / nvme,
and ZeRO-3 with none, ``offload_param`` nvme, and both on NVMe (ZeRO-Infinity):

* peak RSS (``ru_maxrss``) and the step's RSS rise. On this CPU machine the "device" is host
  memory too, so ``cpu`` moves the state between two kinds of host memory and saves nothing (in
  fp32 it adds the host's copy of the master: the device keeps the fp32 weights); ``nvme`` keeps
  master and moments in files and should save the two moments' 8 B per parameter minus the ring
  (12 B in bf16/fp16, whose masters are not the weights);
* bytes read from and written to the NVMe files per step (24 B per offloaded parameter: master
  and moments read, then written back; parameters: 4 B read by each gather, forward and backward,
  4 B written by the step);
* the host step's throughput: the chunked, three-stage step over the ring
  (``megazero.zero.offload``) against one ``torch.optim.AdamW(fused=True).step()`` over the same
  flat partitions, in elements per second, both on this CPU, and whether they agree bit for bit.

``--pretrain``: what a user runs, ``torchrun --nproc_per_node 2 pretrain_gpt.py`` (fp32, ZeRO-2,
mock data, 3 iterations) with a DeepSpeed JSON, each configuration in a process of its own whose
children's peak RSS (the largest rank's) is measured: no offload (the baseline), ``offload_optimizer``
on NVMe with ``buffer_count`` 4 and ``buffer_size`` 2^23 (the ring sized by the largest group, as
before the ring was bounded by what it moves), and the same JSON without ``buffer_size`` (the
default ring). Moved: the two Adam moments of the rank's partition, 8 B per element in fp32 (the
weights are the masters and stay); saved: the baseline's peak RSS minus the run's.

What it means on a GPU: ``cpu`` then frees 12 B per parameter of accelerator memory (16 -> 4 B per
parameter of the partition in mixed precision); the step adds a device -> host copy of the
gradients and a host -> device copy of the weights (4 + 2 B per parameter, overlapped by the ring
with the CPU step), whose time a CPU-only run cannot show.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]



def _run_child(cmd: list[str], label: str) -> dict:
    """Run one configuration in its own process (glibc returning freed memory, so RSS follows live
    memory) and return the dict it prints on its ``RESULT`` line; exit with its output if it failed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{label}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(line[7:])

def _child(args: argparse.Namespace) -> dict:
    """One configuration, measured inside its own process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1")
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from megazero import mpu, zero
    from megazero.model import GPTConfig, GPTModel

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1)
    cfg = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.hidden_size // 64,
                    vocab_size=args.vocab_size, seq_length=args.seq_length, max_position_embeddings=args.seq_length,
                    hidden_dropout=0.0, attention_dropout=0.0)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
          "zero_optimization": {"stage": args.stage}}
    if args.device != "none":
        ds["zero_optimization"]["offload_optimizer"] = {"device": args.device, "nvme_path": args.nvme_path,
                                                        "buffer_count": 4, "buffer_size": 1 << 22}
    if args.param_device != "none":  # every partition to the files (max_in_cpu 0)
        ds["zero_optimization"]["offload_param"] = {"device": args.param_device, "nvme_path": args.nvme_path,
                                                    "max_in_cpu": 0, "buffer_count": 4, "buffer_size": 1 << 22}
    torch.manual_seed(0)
    engine = zero.initialize(GPTModel(cfg), ds, mpu=mpu)
    params = sum(g.numel for g in engine.groups)
    x = torch.randint(0, args.vocab_size, (1, args.seq_length + 1), generator=torch.Generator().manual_seed(1))

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def step() -> None:
        loss = engine(x[:, :-1], labels=x[:, 1:]).mean()
        engine.backward(loss)
        engine.step()

    def io() -> tuple[int, int]:
        pairs = [o.io_bytes() for o in (engine.offload, engine.param_offload) if o is not None]
        return sum(a for a, _ in pairs), sum(b for _, b in pairs)

    step()  # warm-up: creates the moments
    read0 = io()
    before, high, running = rss(), [0], [True]

    def sample() -> None:
        while running[0]:
            high[0] = max(high[0], rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    running[0] = False
    t.join()
    read1 = io()
    out = {"device": args.device, "params": params, "step_s": seconds, "rss_before": before,
           "rss_rise": max(high[0], rss()) - before,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "read_per_step": read1[0] - read0[0], "written_per_step": read1[1] - read0[1],
           "state": engine.model_state_bytes()}
    if args.device == "cpu" and args.stage == 1:
        out["host_step"] = _host_step_speed(engine, torch)
    return out


def _host_step_speed(engine, torch) -> dict:
    """The offloaded step alone vs torch's fused AdamW over copies of the same flat partitions and
    state, group by group with the same hyperparameters (3 rounds each, the best), and whether the
    two give the same bits."""
    off, opt = engine.offload, engine.optimizer
    grads = {g: torch.randn(g.shard_numel, generator=torch.Generator().manual_seed(i))
             for i, g in enumerate(off.groups)}
    copies, groups = {}, []
    for pg in opt.param_groups:
        mine = [g for g in off.groups if any(p is g.master for p in pg["params"])]
        copies.update({g: torch.nn.Parameter(g.master.detach().clone()) for g in mine})
        groups.append({"params": [copies[g] for g in mine], "weight_decay": pg["weight_decay"]})
    first = opt.param_groups[0]
    ref = torch.optim.AdamW(groups, lr=first["lr"], betas=first["betas"], eps=first["eps"], fused=True)
    for g, p in copies.items():
        ref.state[p] = {k: v.clone() for k, v in opt.state[g.master].items()}
    n = sum(g.shard_numel for g in off.groups)
    times = {"offload": [], "fused": []}
    stages = []
    for _ in range(3):
        off.events = []
        t0 = time.perf_counter()
        off.step(opt, grads, 1.0)
        times["offload"].append(time.perf_counter() - t0)
        stages.append({k: sum(b - a for kind, _, a, b in off.events if kind == k) for k in ("fetch", "step", "return")})
        for g, p in copies.items():
            p.grad = grads[g]
        t0 = time.perf_counter()
        ref.step()
        times["fused"].append(time.perf_counter() - t0)
    same = all(torch.equal(p.detach(), g.master) for g, p in copies.items())
    best = min(range(3), key=lambda i: times["offload"][i])
    return {"elements": n, "offload_s": min(times["offload"]), "fused_s": min(times["fused"]), "stages": stages[best],
            "offload_elems_per_s": n / min(times["offload"]), "fused_elems_per_s": n / min(times["fused"]),
            "bit_identical": same}


# name: the offload_optimizer block of the JSON (None: no offload)
PRETRAIN_CONFIGS = {"none": None,
                    "nvme, ring by largest group": {"buffer_count": 4, "buffer_size": 1 << 23},
                    "nvme, default ring": {"buffer_count": 4}}


def _pretrain_flags(args: argparse.Namespace, ds_path: str) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.hidden_size // 64), "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--vocab-size", str(args.vocab_size),
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-4",
            "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--deepspeed_config", ds_path]


def _pretrain_child(args: argparse.Namespace) -> dict:
    """One configuration: torchrun with 2 ranks of pretrain_gpt.py; the largest descendant's peak RSS."""
    ds = {"zero_optimization": {"stage": 2}}
    block = PRETRAIN_CONFIGS[args.pretrain_config]
    if block is not None:
        ds["zero_optimization"]["offload_optimizer"] = dict(block, device="nvme", nvme_path=args.nvme_path)
    path = os.path.join(args.nvme_path, "ds_config.json")
    with open(path, "w") as f:
        json.dump(ds, f)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
           "--master_port", str(args.port), str(ROOT / "pretrain_gpt.py"), *_pretrain_flags(args, path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=args.nvme_path)
    if proc.returncode != 0:
        sys.exit(f"{args.pretrain_config}: pretrain_gpt.py failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return {"peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "seconds": time.perf_counter() - t0}


def pretrain_main(args: argparse.Namespace) -> None:
    """The --pretrain figures: peak RSS saved against what the NVMe offload moves, before and after."""
    from megazero.model import GPTModel
    from megazero.config import parse_args

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as work:
        cfg = parse_args(_pretrain_flags(args, "")[:-2], 2)  # the model, without the JSON
        n = sum(p.numel() for p in GPTModel(cfg.model, device="meta").parameters())
        for i, name in enumerate(PRETRAIN_CONFIGS):
            nvme = os.path.join(work, f"run{i}")
            os.makedirs(nvme)
            cmd = [sys.executable, __file__, "--pretrain-config", name, "--nvme-path", nvme,
                   "--port", str(args.port + i)] + [f"--{k.replace('_', '-')}={getattr(args, k)}"
                                                    for k in ("num_layers", "hidden_size", "vocab_size", "seq_length")]
            results[name] = _run_child(cmd, name)
    mib = 2 ** 20
    moved = 8 * n / 2  # the two fp32 moments of a rank's half of the parameters
    base = results["none"]["peak_rss"]
    print(f"pretrain_gpt.py, torchrun --nproc_per_node 2 (dp 2), ZeRO-2, fp32: GPT {args.num_layers} layers, "
          f"hidden {args.hidden_size}, vocab {args.vocab_size}, seq {args.seq_length}: {n / 1e6:.1f}M parameters; "
          f"moved off each rank: {moved / mib:.0f} MiB of Adam moments")
    print(f"{'offload_optimizer':<30}{'peak RSS MiB/rank':>19}{'saved MiB':>11}{'saved / moved':>15}{'run s':>8}")
    for name, r in results.items():
        saved = base - r["peak_rss"]
        print(f"{name:<30}{r['peak_rss'] / mib:>19.0f}{saved / mib:>11.0f}"
              f"{(f'{saved / moved:.2f}' if name != 'none' else '-'):>15}{r['seconds']:>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="none", help=argparse.SUPPRESS)
    p.add_argument("--param-device", default="none", help=argparse.SUPPRESS)
    p.add_argument("--zero-stage", "--stage", dest="stage", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--nvme-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29731, help=argparse.SUPPRESS)
    p.add_argument("--pretrain", action="store_true",
                   help="pretrain_gpt.py at dp 2 with an NVMe-offload JSON: peak RSS saved vs the moments moved")
    p.add_argument("--pretrain-config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.pretrain_config is not None:
        print("RESULT " + json.dumps(_pretrain_child(args)), flush=True)
        return
    if args.pretrain:
        pretrain_main(args)
        return
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return
    results = {}
    # name: (ZeRO stage, offload_optimizer.device, offload_param.device)
    configs = {"none": (1, "none", "none"), "cpu": (1, "cpu", "none"), "nvme": (1, "nvme", "none"),
               "z3 none": (3, "none", "none"), "z3 param nvme": (3, "none", "nvme"),
               "z3 both nvme": (3, "nvme", "nvme")}
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as nvme:
        for i, (device, (stage, opt, param)) in enumerate(configs.items()):
            cmd = [sys.executable, __file__, "--child", "--device", opt, "--param-device", param,
                   "--zero-stage", str(stage), "--nvme-path", nvme, "--port", str(args.port + i)] + [
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in ("num_layers", "hidden_size", "vocab_size", "seq_length", "threads")]
            results[device] = _run_child(cmd, device)
    mib = 2 ** 20
    base = results["none"]
    n = base["params"]
    print(f"GPT {args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}: {n / 1e6:.1f}M "
          f"parameters, fp32, seq {args.seq_length}, dp 1 (the whole partition offloaded); ZeRO-1 rows against "
          f"'none', ZeRO-3 rows against 'z3 none'")
    print(f"{'offload':<20}{'peak RSS MiB':>14}{'vs base':>9}{'step rise MiB':>15}{'step s':>8}"
          f"{'NVMe read/step':>16}{'written/step':>14}{'host state MiB':>16}{'rings MiB':>10}")
    for device, r in results.items():
        s = r["state"]
        ref = results["z3 none" if device.startswith("z3") else "none"]
        print(f"{device:<20}{r['peak_rss'] / mib:>14.0f}{r['peak_rss'] / ref['peak_rss']:>9.2f}"
              f"{r['rss_rise'] / mib:>15.0f}{r['step_s']:>8.2f}{r['read_per_step'] / mib:>12.0f} MiB"
              f"{r['written_per_step'] / mib:>10.0f} MiB"
              f"{(s.get('host_optimizer', 0) + s.get('host_params', 0)) / mib:>16.0f}"
              f"{(s.get('host_ring', 0) + s.get('host_param_ring', 0)) / mib:>10.0f}")
    nv = results["nvme"]
    saved = base["peak_rss"] - nv["peak_rss"]
    # fp32: the weights are the masters, so the files take the two moments (8 B) off the host and the
    # master's copy lives in the file beside them; in bf16/fp16 it would be 12 B.
    expect = 8 * n - nv["state"].get("host_ring", 0)
    print(f"NVMe saves {saved / mib:.0f} MiB of peak RSS; expected (fp32: the weights are the masters) 8 B x "
          f"parameters - ring = {expect / mib:.0f} MiB ({saved / expect:.2f}x of that); cpu adds the host master "
          f"copy (4 B) and the ring. Bytes per step per offloaded parameter: "
          f"read {nv['read_per_step'] / n:.1f}, written {nv['written_per_step'] / n:.1f} (expected 12 and 12).")
    z3, zp, zi = results["z3 none"], results["z3 param nvme"], results["z3 both nvme"]
    print(f"ZeRO-3: parameters on NVMe save {(z3['peak_rss'] - zp['peak_rss']) / mib:.0f} MiB of peak RSS (the "
          f"4 B fp32 partition is the optimizer's master here, which stays: expected about 0 beyond the ring); "
          f"both on NVMe save {(z3['peak_rss'] - zi['peak_rss']) / mib:.0f} MiB (expected 12 B x parameters - rings "
          f"= {(12 * n - zi['state'].get('host_ring', 0) - zi['state'].get('host_param_ring', 0)) / mib:.0f} MiB). "
          f"Parameter bytes per step per parameter: read {(zp['read_per_step']) / n:.1f} (4 B per gather, forward "
          f"and backward: 8), written {zp['written_per_step'] / n:.1f} (expected 4).")
    h = results["cpu"]["host_step"]
    print(f"host step over {h['elements'] / 1e6:.1f}M elements: offload's chunked three-stage step "
          f"{h['offload_s']:.3f} s ({h['offload_elems_per_s'] / 1e6:.0f} M/s) vs torch AdamW(fused=True) "
          f"{h['fused_s']:.3f} s ({h['fused_elems_per_s'] / 1e6:.0f} M/s): {h['fused_s'] / h['offload_s']:.2f}x; "
          f"bit-identical: {h['bit_identical']}")
    st = h["stages"]
    print(f"  stage seconds (summed over chunks, on their threads): fetch (gradient copy) {st['fetch']:.3f}, step "
          f"(scale + fused AdamW) {st['step']:.3f}, return (weights copy) {st['return']:.3f}: on this CPU the copies "
          f"that a GPU does over PCIe compete with the kernel for the same cores and memory bandwidth")


if __name__ == "__main__":
    main()
