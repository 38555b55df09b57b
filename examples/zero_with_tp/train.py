#!/usr/bin/env python
"""Tensor parallelism x ZeRO-3 on one GPT, with megazero's ZeRO engine or DeepSpeed's.

    torchrun --standalone --nproc_per_node 4 examples/zero_with_tp/train.py --engine megazero --steps 10
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 examples/zero_with_tp/train.py --engine deepspeed --steps 10

The model is megazero's GPT built from ``megazero.mpu`` layers at tp=2; the four ranks
form tp=2 x dp=2 (TP groups [0,1] [2,3], DP groups [0,2] [1,3]). Both engines get the
same DeepSpeed-schema config, seed, data and AdamW hyper-parameters, and the same
``mpu`` object: the module ``megazero.mpu`` itself. Rank 0 prints the DP-averaged loss
and the global gradient norm of every step, then each rank's model-state bytes and the
traffic of the last step. ``--trace-mpu`` lists which ``mpu`` functions the engine called.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megazero import mpu, zero  # noqa: E402
from megazero.model import GPTConfig, GPTModel  # noqa: E402

# DeepSpeed still calls the flat collectives by their pre-2.13 names.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated", category=FutureWarning)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("megazero", "deepspeed"), default="megazero")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size; dp = world size / tp")
    p.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per DP rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global-norm clipping; 0 disables it")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ds-zero-init", action="store_true",
                   help="deepspeed: build the model inside deepspeed.zero.Init (README: it partitions nothing here)")
    p.add_argument("--trace-mpu", action="store_true", help="print the mpu functions the engine called")
    p.add_argument("--json", default=None, help="rank 0 writes losses, norms, bytes and traffic to this file")
    return p.parse_args(argv)


def model_config(args) -> GPTConfig:
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
                     vocab_size=args.vocab_size, seq_length=args.seq_length, max_position_embeddings=args.seq_length,
                     hidden_dropout=0.0, attention_dropout=0.0, attention_backend="math")


def ds_config(args) -> dict:
    """One DeepSpeed-schema config for both engines: fp32, ZeRO-3, AdamW (decay on every parameter)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": args.weight_decay, "torch_adam": True}},
        # 0: partition every parameter, however small (DeepSpeed's default keeps those <= 1e5 whole).
        "zero_optimization": {"stage": args.zero_stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": args.clip_grad,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def global_batch(step: int, args) -> torch.Tensor:
    """Step ``step``'s ``[dp * micro, seq + 1]`` tokens, the same on every rank and for both engines.

    Each row is an arithmetic sequence ``(start + i * stride) mod vocab`` with a random start
    and stride, so the next token follows from the previous two and the loss can fall.
    """
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    rows = mpu.get_data_parallel_world_size() * args.micro_batch
    start = torch.randint(0, args.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 17, (rows, 1), generator=g)
    return (start + stride * torch.arange(args.seq_length + 1)) % args.vocab_size


class TracedMPU:
    """Stands in for the ``megazero.mpu`` module and records which names the engine looks up."""

    def __init__(self, module) -> None:
        self._module = module
        self.called: collections.Counter[str] = collections.Counter()
        self.missing: set[str] = set()

    def __getattr__(self, name: str):
        try:
            value = getattr(self._module, name)
        except AttributeError:
            self.missing.add(name)  # probed with hasattr()/getattr(..., default)
            raise
        if not callable(value):
            return value

        def traced(*a, **kw):
            self.called[name] += 1
            return value(*a, **kw)

        return traced


class AllReduceMeter:
    """Counts ``torch.distributed.all_reduce`` bytes per process group: the TP activation
    all-reduces of the mpu layers and cross-entropy (both engines), plus small norm/overflow
    reductions. ZeRO's own gathers and reduce-scatters are counted by ``engine.comm``."""

    def __init__(self) -> None:
        self.bytes: collections.Counter = collections.Counter()
        self._orig = dist.all_reduce

        def all_reduce(tensor, *a, **kw):
            group = kw.get("group", a[1] if len(a) > 1 else None)
            self.bytes[group] += tensor.numel() * tensor.element_size()
            return self._orig(tensor, *a, **kw)

        dist.all_reduce = all_reduce

    def snapshot(self) -> dict[str, int]:
        names = {mpu.get_tensor_model_parallel_group(): "tp", mpu.get_data_parallel_group(): "dp",
                 mpu.get_model_parallel_group(): "mp", None: "world"}
        out: collections.Counter[str] = collections.Counter()
        for g, n in self.bytes.items():
            out[names.get(g, "other")] += n
        return {f"all_reduce/{k}": v for k, v in sorted(out.items())}

    def reset(self) -> None:
        self.bytes.clear()


# ---------------------------------------------------------------------------------------- engines

def megazero_engine(args, mpu_obj):
    torch.manual_seed(args.seed)
    model = GPTModel(model_config(args), device="meta")  # ZeRO-3 materializes it partition by partition
    return zero.initialize(model, ds_config(args), mpu=mpu_obj)


def deepspeed_engine(args, mpu_obj):
    import deepspeed

    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator would JIT-compile a shared-memory all-reduce kernel first (about a
        # minute of C++ build, redone for each install path); gloo's all-reduce serves these sizes.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group main() started
    config = ds_config(args)  # the very dict megazero gets
    torch.manual_seed(args.seed)
    if args.ds_zero_init:
        with deepspeed.zero.Init(data_parallel_group=mpu.get_data_parallel_group(), mpu=mpu_obj,
                                 config_dict_or_path=config, enabled=args.zero_stage == 3):
            model = GPTModel(model_config(args))
    else:
        model = GPTModel(model_config(args))  # this rank's whole TP shard; deepspeed.initialize partitions it
    if args.zero_stage == 3:
        # The tied output layer reads embedding.weight outside the embedding's own forward.
        # Megatron-DeepSpeed registers it like this; DeepSpeed 0.19.8 also detects the access by itself.
        deepspeed.zero.register_external_parameter(model, model.embedding.weight)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu_obj)
    return engine


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ds_model_state_bytes(engine) -> dict[str, int]:
    """DeepSpeed ZeRO-3's model state on this rank, counted like megazero's ``model_state_bytes``:
    compute-dtype parameter partitions (``ds_tensor``; persistent parameters whole), the flat
    gradient-partition buffer, fp32 master partitions when they are separate storage
    (bf16/fp16; in fp32 DeepSpeed reuses the parameter partitions), and the Adam moments.
    Communication buffers (the reduce bucket, gathered parameters) are not model state."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 3:
        return {}  # counted for ZeRO-3 only
    params = 0
    for p in engine.module.parameters():
        params += _nbytes(p.ds_tensor)
        if getattr(p, "ds_persist", False):
            params += _nbytes(p.data)
    grads = _nbytes(opt.grad_partitions_flat_buffer)
    low = {t.data_ptr() for t in opt.fp16_partitioned_groups_flat}
    optim = sum(_nbytes(t) for t in opt.fp32_partitioned_groups_flat if t.data_ptr() not in low)
    for state in opt.optimizer.state.values():
        optim += sum(_nbytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


# ---------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    mpu.init_distributed(backend="gloo")
    mpu.initialize_model_parallel(args.tp)
    mpu.model_parallel_manual_seed(args.seed)
    rank, dp, dp_rank = dist.get_rank(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mpu_obj = TracedMPU(mpu) if args.trace_mpu else mpu
    engine = (megazero_engine if args.engine == "megazero" else deepspeed_engine)(args, mpu_obj)
    meter = AllReduceMeter()
    if rank == 0:
        print(f"engine={args.engine} world={dist.get_world_size()} tp={args.tp} dp={dp} zero_stage={args.zero_stage}",
              flush=True)

    losses, norms, traffic = [], [], {}
    start = time.perf_counter()
    for step in range(args.steps):
        rows = global_batch(step, args)[dp_rank * args.micro_batch:(dp_rank + 1) * args.micro_batch]
        meter.reset()
        if args.engine == "megazero":
            engine.comm.reset()
        loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        traffic = meter.snapshot()
        if args.engine == "megazero":  # the engine's count includes its own all-reduces
            traffic = {**{k: v for k, v in traffic.items() if k == "all_reduce/tp"}, **engine.comm.snapshot()}
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=mpu.get_data_parallel_group())
        losses.append(float(avg) / dp)
        norms.append(float(engine.get_global_grad_norm()))
        if rank == 0:
            print(f"step {step + 1:3d}  loss {losses[-1]:.6f}  grad_norm {norms[-1]:.6f}", flush=True)
    seconds = time.perf_counter() - start

    state = engine.model_state_bytes() if args.engine == "megazero" else ds_model_state_bytes(engine)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, state)
    if rank == 0:
        print(f"{args.steps} steps in {seconds:.2f} s")
        for r, s in enumerate(per_rank):
            if s:
                print(f"rank {r} model-state bytes: " + " ".join(f"{k}={v}" for k, v in s.items()))
        print("traffic of the last step on rank 0 (bytes, logical sizes): " + json.dumps(traffic))
        if args.trace_mpu:
            print("mpu functions called: " + json.dumps(dict(sorted(mpu_obj.called.items()))))
            print("mpu names probed but absent: " + json.dumps(sorted(mpu_obj.missing)))
        if args.json:
            Path(args.json).write_text(json.dumps({"engine": args.engine, "losses": losses, "grad_norms": norms,
                                                   "model_state_bytes": per_rank, "traffic": traffic,
                                                   "seconds": seconds}, indent=1))
    dist.barrier()
    mpu.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
