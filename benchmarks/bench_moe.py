#!/usr/bin/env python
"""Mixture of experts: megazero's MoELayer at expert parallelism 1, 2 and 4, against its dense equivalent.

One MoE layer (fp32, Mixtral-like and scaled down: hidden 512, 8 experts, top-2, SwiGLU experts of ffn
1024, load-balancing loss 0.01), forward and backward on T tokens per rank, ep gloo ranks (one process,
one thread each; every rank holds its own tokens, as under data parallelism, and E/ep experts):

* dense:      a SwiGLU MLP of ffn = top_k x moe ffn (2048): the same active FLOPs per token, one rank;
* megazero:   ``MoELayer`` at ep 1, 2, 4 (dropless, uneven all-to-all), the experts as a per-expert loop;
* grouped:    the same with ``moe_grouped_gemm`` (a rank's experts in two ``torch._grouped_mm`` calls);
* DeepSpeed:  ``deepspeed.moe.layer.MoE`` at ep 1 (top-2 gate, ``drop_tokens=False``: the capacity is the
  busiest expert's load, every expert's buffer padded to it), when ``import deepspeed`` works;
* on 2 ranks, one sequence split over tp 2 with sequence parallelism (half the tokens per rank):
  ``etp=tp`` (each expert sharded over both ranks, the tokens gathered over TP) against ``etp 1``
  (whole experts, ep 2, each rank sending its own tokens), and ``padded`` (ep 2, capacity factor 1.25
  padded: fixed all-to-all sizes, no host read of the routing) against dropless ep 2.

Per configuration and rank: main-thread CPU time of forward + backward (median of the timed steps;
wall time too, but the ranks share the machine's cores, so per-rank CPU time is the figure), tokens/s
per rank = T / CPU s, the peak of the live tensor bytes the step allocated (``LiveMemoryTracker``;
inputs and parameters excluded, parameter gradients included), the expert parameter bytes the rank
holds, and the bytes its all-to-alls send (``layer.counter``) against the formula
(rows dispatched away + rows returned to other ranks) x h x 4 forward, the same backward (with a
balanced router, about 2 x rows leaving the rank x h x 4). Ratios against megazero at ep 1 and the dense MLP.

    python benchmarks/bench_moe.py            # 3-5 min on 2 shared cores
    python benchmarks/bench_moe.py --quick    # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ranks import run_ranks  # noqa: E402

ELEM = 4  # fp32


@dataclass(frozen=True)
class Shape:
    hidden: int
    experts: int
    topk: int
    moe_ffn: int
    seq: int
    batch: int
    steps: int

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


def _config(shape: Shape, dense: bool = False):
    from megazero.model.config import GPTConfig

    kw = dict(num_layers=1, hidden_size=shape.hidden, num_attention_heads=8, seq_length=shape.seq,
              max_position_embeddings=shape.seq, vocab_size=128, add_bias_linear=False, hidden_dropout=0.0,
              attention_dropout=0.0, activation="swiglu")
    if dense:
        return GPTConfig(**kw, ffn_hidden_size=shape.topk * shape.moe_ffn).validate()
    return GPTConfig(**kw, num_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.moe_ffn,
                     moe_aux_loss_coeff=0.01).validate()


class _Expert(torch.nn.Module):
    """megazero's expert MLP as a plain module (DeepSpeed calls its experts' forward)."""

    def __init__(self, config) -> None:
        super().__init__()
        from megazero.model.mlp import MLP

        self.mlp = MLP(config, tp_group=None, tp_size=1, expert=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.partial(x)


def _build(kind: str, shape: Shape, ep: int, rank: int):
    """(module, step(x) -> output, expert parameters) of one configuration."""
    from megazero.model.moe.layer import AuxLossScale, MoELayer
    from megazero.model.init import init_methods
    from megazero.model.mlp import MLP
    from megazero.mpu import NO_GROUP

    torch.manual_seed(0)  # the router alike on every rank
    if kind == "dense":
        mlp = MLP(_config(shape, dense=True), tp_group=None, tp_size=1)
        return mlp, lambda x: mlp.partial(x.view(-1, shape.hidden)), list(mlp.parameters())
    c = _config(shape)
    if kind == "DeepSpeed":
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend="gloo")
        moe = MoE(shape.hidden, _Expert(c), num_experts=shape.experts, ep_size=ep, k=shape.topk,
                  drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
        moe.set_deepspeed_parallelism()
        return moe, lambda x: moe(x)[0], list(moe.deepspeed_moe.experts.parameters())
    world = dist.group.WORLD
    if kind in ("etp=tp", "etp 1"):  # tp 2 with SP over the 2 ranks
        c = c.replace(sequence_parallel=True)
        whole = kind == "etp 1"
        layer = MoELayer(c, lambda: MLP(c, tp_group=NO_GROUP if whole else world, tp_size=1 if whole else 2,
                                        expert=True), tp_group=world, tp_size=2,
                         ep_group=world if whole else None, ep_size=2 if whole else 1, ep_rank=rank if whole else 0,
                         aux_scale=AuxLossScale(), init_method=init_methods(c)[0], etp_group=None if whole else world,
                         etp_size=1 if whole else 2, etp_rank=0 if whole else rank, exchange_group=world)
        return layer, layer, list(layer.experts.parameters())
    if kind == "padded":
        c = c.replace(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True)
    if kind == "grouped":
        c = c.replace(moe_grouped_gemm=True)
    layer = MoELayer(c, lambda: MLP(c, tp_group=NO_GROUP, tp_size=1, expert=True), tp_group=None, tp_size=1,
                     ep_group=world if ep > 1 else None, ep_size=ep, ep_rank=rank,
                     aux_scale=AuxLossScale(), init_method=init_methods(c)[0])
    return layer, layer, list(layer.experts.parameters())


def _routing(layer, x: torch.Tensor, shape: Shape, ep: int) -> torch.Tensor:
    """Token copies rank src sends to rank dst's experts: ``[ep, ep]`` (all ranks' rows)."""
    from megazero.model.moe.layer import route

    logits = x.detach().reshape(-1, shape.hidden) @ layer.router.weight.detach().t()
    top = route(logits, shape.topk, False)[0].flatten()
    mine = torch.bincount(top // (shape.experts // ep), minlength=ep)
    rows = [torch.empty_like(mine) for _ in range(ep)]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def _measure(kind: str, shape: Shape, ep: int, rank: int) -> dict[str, Any]:
    from megazero.utils.memory_tracker import LiveMemoryTracker

    module, step, experts = _build(kind, shape, ep, rank)
    tp = kind in ("etp=tp", "etp 1")  # one sequence over the 2 ranks: each its half (sequence parallelism)
    g = torch.Generator().manual_seed(100 + (0 if tp else rank))  # else each rank's own tokens
    x = torch.randn(shape.seq, shape.batch, shape.hidden, generator=g)
    grad = torch.randn(shape.seq, shape.batch, shape.hidden, generator=g)
    if tp:
        x, grad = x.chunk(2)[rank].contiguous(), grad.chunk(2)[rank].contiguous()
    x, grad = x.requires_grad_(), grad.view(-1, shape.hidden)

    def once() -> None:
        step(x).reshape(-1, shape.hidden).backward(grad)
        module.zero_grad(set_to_none=True)
        x.grad = None

    once()  # warm-up
    cpus, walls = [], []
    for _ in range(shape.steps):
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        once()
        cpus.append(time.thread_time() - cpu0)
        walls.append(time.perf_counter() - wall0)
    dist.barrier()
    if kind not in ("dense", "DeepSpeed"):
        module.counter = {}
    with LiveMemoryTracker("cpu", scan_existing=False) as tracker:
        step(x).reshape(-1, shape.hidden).backward(grad)
    out = dict(cpu=statistics.median(cpus), wall=statistics.median(walls), peak=tracker.peak_bytes,
               expert_bytes=sum(p.numel() * p.element_size() for p in experts), fwd=0, bwd=0, formula=0, rows=0,
               tokens=x.shape[0] * x.shape[1])
    if kind in ("megazero", "grouped"):  # dropless: the bytes against the routing's formula
        table = _routing(module, x, shape, ep)
        away = int(table[rank].sum() - table[rank, rank])
        back = int(table[:, rank].sum() - table[rank, rank])
        out.update(fwd=module.counter.get("forward", 0), bwd=module.counter.get("backward", 0),
                   formula=(away + back) * shape.hidden * ELEM, rows=int(table[:, rank].sum()), away=away)
    elif kind not in ("dense", "DeepSpeed"):
        out.update(fwd=module.counter.get("forward", 0), bwd=module.counter.get("backward", 0), formula=None)
    return out


def _rank(rank: int, ep: int, kinds: list, shape: Shape) -> list[dict]:
    results = []
    for kind in kinds:
        try:
            results.append(_measure(kind, shape, ep, rank))
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run here is reported, not fatal
            results.append(dict(error=f"{type(e).__name__}: {e}"))
    return results


def run_ep(ep: int, kinds: list, shape: Shape) -> list[list[dict]]:
    """Every kind on ``ep`` ranks: per kind, the ranks' results."""
    got = run_ranks(ep, _rank, kinds, shape)
    return [[got[r][i] for r in range(ep)] for i in range(len(kinds))]


def _row(kind: str, ep: int, ranks: list[dict], shape: Shape) -> dict[str, Any]:
    if any("error" in r for r in ranks):
        return dict(kind=kind, ep=ep, error=next(r["error"] for r in ranks if "error" in r))
    cpu = [r["cpu"] for r in ranks]
    rows = [r["rows"] for r in ranks]
    return dict(kind=kind, ep=ep, cpu_max=max(cpu), cpu_mean=sum(cpu) / ep, wall=max(r["wall"] for r in ranks),
                tps=ranks[0]["tokens"] / max(cpu), peak=max(r["peak"] for r in ranks),
                expert=max(r["expert_bytes"] for r in ranks), fwd=max(r["fwd"] for r in ranks),
                bwd=max(r["bwd"] for r in ranks),
                formula=max(r["formula"] for r in ranks) if ranks[0]["formula"] is not None else None,
                exact=all(r["fwd"] == r["formula"] == r["bwd"] for r in ranks) if ranks[0]["formula"] is not None
                else "-",
                away=max(r.get("away", 0) for r in ranks),
                load=max(rows) / (sum(rows) / ep) if sum(rows) else 1.0, tokens=ranks[0]["tokens"],
                hidden=shape.hidden)


def _print(rows: list[dict]) -> None:
    mib = 2 ** 20
    print(f"{'layer':<10}{'ep':>3}{'CPU s max':>10}{'mean':>7}{'wall s':>8}{'tokens/s':>9}{'peak MiB':>9}"
          f"{'experts MiB':>12}{'a2a fwd MiB':>12}{'formula':>8}{'bwd MiB':>8}{'= formula':>10}{'load max/mean':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:<10}{r['ep']:>3}  not run: {r['error'][:200]}")
            continue
        print(f"{r['kind']:<10}{r['ep']:>3}{r['cpu_max']:10.3f}{r['cpu_mean']:7.3f}{r['wall']:8.3f}{r['tps']:9.0f}"
              f"{r['peak'] / mib:9.1f}{r['expert'] / mib:12.1f}{r['fwd'] / mib:12.2f}"
              f"{r['formula'] / mib if r['formula'] is not None else float('nan'):8.2f}"
              f"{r['bwd'] / mib:8.2f}{str(r['exact']):>10}{r['load']:14.2f}")


def _ratios(rows: list[dict]) -> None:
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["kind"] == "megazero" and r["ep"] == 1), None)
    dense = next((r for r in ok if r["kind"] == "dense"), None)
    print("\nratios (largest rank): expert parameter bytes and CPU time against megazero ep 1; CPU time against dense")
    for r in ok:
        line = f"{r['kind']:<10} ep {r['ep']}"
        if base:
            line += f"  vs megazero ep 1: experts {r['expert'] / base['expert']:.2f}x, CPU {r['cpu_max'] / base['cpu_max']:.2f}x"
        if dense:
            line += f"; vs dense: CPU {r['cpu_max'] / dense['cpu_max']:.2f}x, peak {r['peak'] / dense['peak']:.2f}x"
        print(line)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (hidden 64, moe ffn 128, 256 tokens per rank)")
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (median)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed row")
    p.add_argument("--kinds", nargs="+", default=None, help="only these rows (e.g. megazero grouped)")
    a = p.parse_args(argv)
    shape = Shape(64, 8, 2, 128, 128, 2, a.steps or 2) if a.quick else Shape(512, 8, 2, 1024, 2048, 2, a.steps or 3)
    print(f"MoE layer, fp32, hidden {shape.hidden}, {shape.experts} experts, top-{shape.topk}, SwiGLU moe ffn "
          f"{shape.moe_ffn} (dense: ffn {shape.topk * shape.moe_ffn}); {shape.tokens} tokens per rank; forward + "
          f"backward; ep gloo ranks x 1 thread on {os.cpu_count()} cores, torch {torch.__version__}")
    print("CPU s: main-thread CPU time per rank (median of steps); wall s is contended; tokens/s = tokens per rank / "
          "max CPU s; peak: live bytes the step allocated; a2a: bytes sent per rank per step, formula (rows away + "
          "rows back) x h x 4; load: token copies the rank's experts get, max / mean over ranks\n")
    rows = []
    for ep in a.eps:
        kinds = ["megazero", "grouped"]
        if ep == 1:
            kinds = ["dense"] + kinds + ([] if a.no_deepspeed else ["DeepSpeed"])
        if ep == 2:
            kinds += ["padded", "etp=tp", "etp 1"]
        kinds = [k for k in kinds if a.kinds is None or k in a.kinds]
        for kind, ranks in zip(kinds, run_ep(ep, kinds, shape)):
            rows.append(_row(kind, ep, ranks, shape))
    _print(rows)
    _ratios(rows)
    _expert_tp(rows)
    _grouped(rows)
    return 0


def _expert_tp(rows: list[dict]) -> None:
    """Whole experts against experts sharded over TP, and padding against dropless, on 2 ranks."""
    by = {r["kind"]: r for r in rows if "error" not in r and r["ep"] == 2}
    if "etp=tp" in by and "etp 1" in by:
        a, b = by["etp 1"], by["etp=tp"]
        # etp = tp sends over TP, not by all-to-all: the tokens' all-gather and the output's reduce-scatter,
        # each this rank's T/2 rows of h fp32 to the other rank, forward (the same backward)
        tp_bytes = 2 * a["tokens"] * a["hidden"] * ELEM
        print(f"\ntp 2 (SP), whole experts (etp 1, ep 2) vs sharded over TP (etp = tp 2): bytes sent forward "
              f"{a['fwd'] / 2 ** 20:.2f} MiB (all-to-all) vs {tp_bytes / 2 ** 20:.2f} MiB (TP gather + reduce-scatter, "
              f"formula), {a['fwd'] / tp_bytes:.2f}x; CPU {a['cpu_max'] / b['cpu_max']:.2f}x, peak "
              f"{a['peak'] / b['peak']:.2f}x, expert bytes per rank {a['expert'] / b['expert']:.2f}x")
    if "padded" in by and "megazero" in by:
        a, b = by["padded"], by["megazero"]
        print(f"ep 2, padded to capacity 1.25 vs dropless: a2a bytes {a['fwd'] / max(b['fwd'], 1):.2f}x, CPU "
              f"{a['cpu_max'] / b['cpu_max']:.2f}x, peak {a['peak'] / b['peak']:.2f}x")


def _grouped(rows: list[dict]) -> None:
    """The grouped matmuls against the per-expert loop at each ep."""
    by = {(r["kind"], r["ep"]): r for r in rows if "error" not in r}
    for ep in sorted({r["ep"] for r in rows}):
        a, b = by.get(("grouped", ep)), by.get(("megazero", ep))
        if a and b:
            print(f"ep {ep}, grouped matmuls vs per-expert loop: CPU {a['cpu_max'] / b['cpu_max']:.2f}x, peak "
                  f"{a['peak'] / b['peak']:.2f}x ({(a['peak'] - b['peak']) / 2 ** 20:+.1f} MiB; the rank's experts: "
                  f"{a['expert'] / 2 ** 20:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
