#!/usr/bin/env python
"""One rank of one ``bench_zero.py`` configuration (launched by torchrun; see bench_zero.py).

    torchrun --standalone --nproc_per_node 4 benchmarks/zero_baselines.py --system megazero --tp 2 --json r.json

Systems, all ZeRO-3-style (parameters, gradients and optimizer state sharded over DP)
on the same GPT shape, AdamW, no clipping:

* ``megazero``:  megazero's GPT (mpu layers) + ``megazero.zero`` stage 3, any tp x dp.
* ``deepspeed``: the same megazero GPT + DeepSpeed ZeRO-3 via ``deepspeed.initialize(..., mpu=megazero.mpu)``.
* ``megatron-ds``: the Megatron-DeepSpeed arrangement: a GPT of megatron-core's TP layers
  (``benchmarks/megatron_ds.py``) + DeepSpeed ZeRO-3 through megatron-core's ``parallel_state``.
* ``fsdp2``:     a plain-torch GPT of the same shape, DTensor TP (``parallelize_module``) on a
  2-D mesh ``[dp, tp]`` and ``fully_shard`` (FSDP2) per layer and on the root over ``dp``.

Rank 0 writes ``{"ranks": [per-rank dict, ...]}`` to ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import math
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
# bench_zero.py --against: megazero from another checkout (a commit's worktree) through this harness. That
# checkout alone goes on the path: a commit whose megazero/ is a namespace package would lose to ROOT's.
TREE = os.environ.get("MEGAZERO_BENCH_TREE")
if TREE or __package__ in (None, ""):
    sys.path.insert(0, TREE or str(ROOT))

from megazero import mpu, zero  # noqa: E402
from megazero.model import GPTConfig, GPTModel  # noqa: E402

warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated", category=FutureWarning)

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=("megazero", "deepspeed", "megatron-ds", "fsdp2"), required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", "--num-heads", dest="num_attention_heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--micro-batch-size", "--micro-batch", dest="micro_batch_size", type=int, default=4,
                   help="sequences per DP rank per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage (megazero and DeepSpeed)")
    p.add_argument("--prefetch-bucket-size", type=float, default=None,
                   help="ZeRO-3 stage3_prefetch_bucket_size in elements (default: the engine's, the next unit)")
    p.add_argument("--max-live-parameters", type=float, default=None,
                   help="ZeRO-3 stage3_max_live_parameters in elements (default: the engine's)")
    p.add_argument("--reduce-bucket-size", type=float, default=None,
                   help="ZeRO-2/3 reduce_bucket_size in elements (default: the engine's, one unit per bucket)")
    p.add_argument("--persistence-threshold", type=int, default=10_000,
                   help="ZeRO-3 stage3_param_persistence_threshold (megazero and DeepSpeed)")
    p.add_argument("--sample-rss", action="store_true",
                   help="poll RSS every millisecond during the timed steps (step_rss_rise_bytes); the "
                        "polling thread costs CPU and GIL hand-offs, so speed runs leave it off")
    p.add_argument("--breakdown", action="store_true",
                   help="after the timed steps, one more step under LiveMemoryTracker: its peak by kind "
                        "(megazero.observe.step_kinds)")
    p.add_argument("--compute-split", action="store_true",
                   help="after the timed steps, one more step under ComputeTimer: the CPU time of the model's "
                        "own matmuls and attention kernels, which every arrangement runs alike")
    p.add_argument("--count-work", action="store_true",
                   help="after the timed steps, one more step with each rank's Python bytecodes counted "
                        "(sys.settrace); with --compute-split, its step also counts every tensor operation: "
                        "measures of the step's work that do not depend on the machine's load")
    p.add_argument("--json", "--out", dest="json", required=True, help="rank 0 writes the results here")
    return p.parse_args(argv)


def gpt_config(args) -> GPTConfig:
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                     seq_length=args.seq_length, max_position_embeddings=args.seq_length,
                     hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa")


def ds_config(args) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage, "stage3_param_persistence_threshold": args.persistence_threshold,
                              **({"stage3_prefetch_bucket_size": args.prefetch_bucket_size}
                                 if args.prefetch_bucket_size is not None else {}),
                              **({"stage3_max_live_parameters": args.max_live_parameters}
                                 if args.max_live_parameters is not None else {}),
                              **({"reduce_bucket_size": args.reduce_bucket_size}
                                 if args.reduce_bucket_size is not None else {})},
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batch(step: int, rows: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab_size, (rows, args.seq_length + 1), generator=g)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------------------ megazero / DeepSpeed

def setup_megazero(args):
    mpu.initialize_model_parallel(args.tp)
    torch.manual_seed(1234)
    engine = zero.initialize(GPTModel(gpt_config(args), device="meta"), ds_config(args), mpu=mpu)

    def step(tokens):
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        return loss

    return step, engine.model_state_bytes, mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()


def _example_module():
    spec = importlib.util.spec_from_file_location("zero_with_tp_example", ROOT / "examples/zero_with_tp/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup_deepspeed(args, megatron_core: bool = False):
    """DeepSpeed ZeRO on megazero's GPT and mpu, or (``megatron_core``) on megatron-core's."""
    import deepspeed

    example = _example_module()  # ds_model_state_bytes: DeepSpeed's buffers counted like megazero's
    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config(args)
    config["optimizer"]["params"]["foreach"] = True
    if megatron_core:
        from benchmarks import megatron_ds

        model, groups = megatron_ds.build(gpt_config(args), args.tp)
    else:
        mpu.initialize_model_parallel(args.tp)
        torch.manual_seed(1234)
        model, groups = GPTModel(gpt_config(args)), mpu
    deepspeed.zero.register_external_parameter(model, model.embedding.weight)  # the tied output
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=groups)

    def step(tokens):
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        return loss

    return (step, lambda: example.ds_model_state_bytes(engine), groups.get_data_parallel_world_size(),
            groups.get_data_parallel_rank())


# ------------------------------------------------------------------------------------ plain torch + FSDP2

class Block(torch.nn.Module):
    """The megazero layer in plain torch: pre-norm, separate q/k/v (so column-wise TP splits
    whole heads), SDPA, GeLU(tanh) MLP, biases everywhere."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.q, self.k, self.v = (torch.nn.Linear(h, h) for _ in range(3))
        self.proj = torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, s, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # local heads under TP
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(torch.nn.Module):
    """Same parameter count and FLOPs as megazero's GPT (learned positions, tied embeddings)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(c.padded_vocab_size, c.hidden_size)
        self.pos = torch.nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.layers = torch.nn.ModuleList(Block(c.hidden_size, c.num_attention_heads) for _ in range(c.num_layers))
        self.ln_f = torch.nn.LayerNorm(c.hidden_size)
        for name, p in self.named_parameters():  # GPT-2 init: N(0, 0.02), residual outputs / sqrt(2L)
            if p.dim() == 2:
                residual = name.endswith(("proj.weight", "fc2.weight"))
                torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.num_layers) if residual else 0.02)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy. Under TP the tied output is vocabulary-parallel: run it (and the
        backward) inside ``loss_parallel()`` so the loss never gathers the full logits."""
        x = self.tok(tokens) + self.pos(torch.arange(tokens.size(1)))
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        w = self.tok.weight
        if isinstance(w, DTensor):  # [vocab/tp, h] shard: logits come out sharded on the vocabulary
            x = DTensor.from_local(x, w.device_mesh, [Replicate()])
        logits = F.linear(x, w)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def setup_fsdp2(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    world = dist.get_world_size()
    dp = world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    torch.manual_seed(1234)
    model = PlainGPT(gpt_config(args))
    if args.tp > 1:
        # The Megatron split: q/k/v/fc1 column-wise, proj/fc2 row-wise; the embedding row-wise
        # (vocabulary-parallel) and the tied output column-wise via DTensor, with loss_parallel.
        plan = {"tok": RowwiseParallel(input_layouts=Replicate())}
        for i in range(args.num_layers):
            plan.update({f"layers.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")})
            plan.update({f"layers.{i}.{n}": RowwiseParallel() for n in ("proj", "fc2")})
        parallelize_module(model, tp_mesh, plan)
        for block in model.layers:
            block.heads //= args.tp
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if args.dtype == "bf16"
          else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
    ctx = loss_parallel if args.tp > 1 else contextlib.nullcontext

    def step(tokens):
        with ctx():
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradient shards allocated, as the ZeRO engines do
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def state_bytes():
        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        params = sum(nbytes(local(p)) for p in model.parameters())
        grads = sum(nbytes(local(p.grad)) for p in model.parameters() if p.grad is not None)
        optim = sum(nbytes(local(v)) for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    return step, state_bytes, dp, dp_mesh.get_local_rank()


# ------------------------------------------------------------------------------------ main

def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler:
    """Highest RSS seen by a thread polling every millisecond while the block runs."""

    def __enter__(self):
        import threading

        self.peak, self._stop = _rss_now(), threading.Event()

        def poll():
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, _rss_now())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_now())


class ComputeTimer(TorchDispatchMode):
    """CPU seconds of this thread spent inside the model's matmul and attention kernels.

    Those kernels are the same FLOPs in every arrangement (same GPT shape, same TP split), so
    the step's CPU time minus theirs is what an arrangement adds: its collectives and waits,
    copies, hooks and optimizer. On a CPU without native bf16 (AVX2 only) bf16 matmuls run
    several times slower than fp32 ones and this split shows the step is theirs. The mode's
    own Python cost lands outside the kernels, so only the kernels' share is read from it.
    """

    MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"}

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {"matmul": 0.0, "attention": 0.0}
        self.calls = 0
        self.ops = 0  # every operation dispatched, kernels or not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func._overloadpacket.__name__
        kind = ("matmul" if name in self.MATMUL else
                "attention" if "scaled_dot_product" in name else None)
        if kind is None:
            return func(*args, **(kwargs or {}))
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        self.seconds[kind] += time.thread_time() - t0
        self.calls += 1
        return out


def count_opcodes(fn, *args) -> int:
    """Python bytecodes this thread executes in ``fn(*args)`` (autograd's hooks included: on CPU,
    backward runs them on the calling thread). The same code path gives the same count on any
    machine and under any load, which timings do not."""
    count = 0

    def opcode(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return opcode

    def call(frame, event, arg):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return opcode

    sys.settrace(call)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    mpu.init_distributed(backend="gloo")
    setup = {"megazero": setup_megazero, "deepspeed": setup_deepspeed, "fsdp2": setup_fsdp2,
             "megatron-ds": lambda a: setup_deepspeed(a, megatron_core=True)}[args.system]
    step, state_bytes, dp, dp_rank = setup(args)
    rows = args.micro_batch_size
    losses, times, cpu = [], [], []
    rss_rise = 0
    for i in range(args.warmup + args.steps):
        tokens = batch(i, dp * rows, args)[dp_rank * rows:(dp_rank + 1) * rows]
        dist.barrier()
        rss_before = _rss_now()
        sampler = _RssSampler() if i >= args.warmup and args.sample_rss else contextlib.nullcontext()
        t0, c0 = time.perf_counter(), time.process_time()
        with sampler:
            loss = step(tokens)
        if i >= args.warmup and args.sample_rss:
            # the timed step's own RSS high-water mark above RSS before it (with MALLOC_MMAP_THRESHOLD_
            # set, freed tensors leave RSS, so this is the step's transient)
            rss_rise = max(rss_rise, sampler.peak - rss_before)
        c1 = time.process_time()  # this process's CPU time (all its threads), before the barrier's wait
        dist.barrier()
        times.append(time.perf_counter() - t0)
        cpu.append(c1 - c0)
        losses.append(float(loss.detach().float()))
    breakdown = None
    if args.breakdown:  # apart from the RSS-measured steps: the tracker's hooks slow every op
        from megazero.utils.memory_tracker import LiveMemoryTracker
        from megazero.observe.step_kinds import StepKinds

        tokens = batch(args.warmup + args.steps, dp * rows, args)[dp_rank * rows:(dp_rank + 1) * rows]
        kinds = StepKinds()
        with kinds, LiveMemoryTracker("cpu", kind_of=kinds.kind_of) as tracker:
            tracker.reset_peak(relabel="state")
            step(tokens)
        by_kind = tracker.peak_by_kind
        breakdown = {"above_start": tracker.absolute_peak_bytes - by_kind.get("state", 0),
                     "by_kind": {k: v for k, v in by_kind.items() if k != "state"}}
        dist.barrier()
    compute = None
    if args.compute_split:  # apart from the timed steps: the mode's dispatch slows every op
        tokens = batch(args.warmup + args.steps + 1, dp * rows, args)[dp_rank * rows:(dp_rank + 1) * rows]
        timer = ComputeTimer()
        with timer:
            step(tokens)
        compute = {**timer.seconds, "kernel_calls": timer.calls, "ops": timer.ops}
        dist.barrier()
    opcodes = None
    if args.count_work:  # apart from the timed steps: tracing slows every line of Python
        tokens = batch(args.warmup + args.steps + 2, dp * rows, args)[dp_rank * rows:(dp_rank + 1) * rows]
        opcodes = count_opcodes(step, tokens)
        dist.barrier()
    timed = sum(times[args.warmup:])
    tokens_per_step = dp * rows * args.seq_length
    me = {
        "rank": dist.get_rank(),
        "tokens_per_s": tokens_per_step * args.steps / timed,
        "step_s": times,
        "cpu_s": cpu,
        "timed_cpu_s": sum(cpu[args.warmup:]),
        "timed_tokens": tokens_per_step * args.steps,
        "model_state": state_bytes(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_rss_rise_bytes": rss_rise,
        "breakdown": breakdown,
        "compute_s": compute,
        "python_opcodes": opcodes,
        "loss": losses,
        "dp": dp,
        "tp": dist.get_world_size() // dp,
        "megazero": str(Path(zero.__file__).resolve().parents[2]),  # the checkout megazero came from
    }
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, me)
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": out}, indent=1))
    dist.barrier()
    mpu.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
