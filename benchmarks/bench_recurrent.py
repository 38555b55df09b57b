#!/usr/bin/env python
"""The recurrent layers on the CPU: megazero's chunked kernels against transformers', a Gated DeltaNet layer against
causal attention as the sequence grows, and the context-parallel exchange's bytes against the planner's formula.

* **kernels**: the chunked gated delta rule (``delta_rule.py``, chunk 64) against transformers'
  ``torch_chunk_gated_delta_rule`` (Qwen3-Next's PyTorch fallback), and the chunked SSD scan (``ssd.py``, chunk
  128) against ``mamba2_chunk_scan`` (Nemotron-H's), forward + backward of the same inputs, fp32, batch 1. Ratio:
  transformers' CPU time / megazero's, the median of the rounds' pairs.
* **layers**: megazero's ``GatedDeltaNet`` against its ``SelfAttention`` (causal, ``sdpa``) of the same hidden
  size, forward + backward of one layer, batch 1, fp32, at each sequence length; the forward FLOPs per token
  ``megazero.model.flops`` gives each (attention's grows with the sequence, the recurrent layer's does not).
* **exchange**: a Gated DeltaNet and a Mamba-2 mixer run context-parallel on gloo ranks (state passing over the
  zigzag layout, and Megatron's heads all-to-all); the bytes a rank's collectives send (ring volumes: an
  all-gather's or reduce-scatter's whole X, (n-1)/n of it; an all-to-all's input, (n-1)/n of it), forward and
  backward, against ``planner_recurrent.recurrent_cp_bytes_per_layer``.

Timing: CPU time of the main thread (``time.thread_time``), one thread; the runs alternate ``--repeats`` times.

    python benchmarks/bench_recurrent.py            # ~5 min on 2 shared cores
    python benchmarks/bench_recurrent.py --tiny     # seconds
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megazero.model.attention.self_attention import SelfAttention  # noqa: E402
from megazero.model.config import GPTConfig  # noqa: E402
from megazero.model.flops import layer_flops_per_token  # noqa: E402
from megazero.model.forward_context import ForwardContext  # noqa: E402
from megazero.model.recurrent.delta_rule import chunk_gated_delta_rule  # noqa: E402
from megazero.model.recurrent.gated_delta_net import GatedDeltaNet  # noqa: E402
from megazero.model.recurrent.mamba import MambaMixer  # noqa: E402
from megazero.model.recurrent.ssd import chunk_ssd_scan  # noqa: E402
from megazero.observe.planner_recurrent import recurrent_cp_bytes_per_layer  # noqa: E402

log = logging.getLogger("bench_recurrent")
KIB = 1024


def _cpu_time(step: Callable[[], None]) -> float:
    start = time.thread_time()
    step()
    return time.thread_time() - start


def _alternate(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Each step once to warm up, then all of them in turn ``repeats`` times: their CPU times."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_cpu_time(step))
    return times


def _ratio(slow: list[float], fast: list[float]) -> str:
    ratios = sorted(a / b for a, b in zip(slow, fast))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _backward(out: torch.Tensor) -> None:
    out.backward(torch.ones_like(out))


def kernel_table(seq: int, heads: int, dk: int, mamba: tuple[int, int, int, int], repeats: int) -> list[str]:
    """Gated delta rule (``heads`` heads of ``dk``) and SSD (heads, head dim, groups, state) against transformers'."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq, heads, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, seq, heads, dk, generator=g)
    decay, beta = -torch.rand(1, seq, heads, generator=g) * 0.1, torch.rand(1, seq, heads, generator=g)
    delta = (lambda: chunk_gated_delta_rule(*_leaves(q, k, v, decay, beta))[0],
             lambda: torch_chunk_gated_delta_rule(*_leaves(q, k, v, decay, beta), use_qk_l2norm_in_kernel=False)[0])
    H, P, G, N = mamba
    x, B, C = torch.randn(1, seq, H, P, generator=g), torch.randn(1, seq, G, N, generator=g), torch.randn(1, seq, G, N,
                                                                                                          generator=g)
    dt, A, D = torch.rand(1, seq, H, generator=g) * 0.1, -torch.rand(H, generator=g) - 0.5, torch.ones(H)
    ssd = (lambda: chunk_ssd_scan(*_leaves(x, dt, A, B, C), D=D, chunk_size=128)[0],
           lambda: mamba2_chunk_scan(*_leaves(x, dt, A, B, C), chunk_size=128, D=D))
    rows = ["| kernel | shape | megazero ms | transformers ms | transformers / megazero | max abs diff (fwd) |",
            "|---|---|---:|---:|---:|---:|"]
    for name, shape, (ours, theirs) in (("gated delta rule", f"{heads} heads, dk = dv = {dk}", delta),
                                        ("SSD", f"{H} heads of {P}, {G} groups, state {N}", ssd)):
        times = _alternate({"ours": lambda f=ours: _backward(f()), "theirs": lambda f=theirs: _backward(f())}, repeats)
        with torch.no_grad():
            diff = (ours() - theirs()).abs().max().item()
        rows.append(f"| {name} | {shape} | {1e3 * statistics.median(times['ours']):.0f} | "
                    f"{1e3 * statistics.median(times['theirs']):.0f} | {_ratio(times['theirs'], times['ours'])} | "
                    f"{diff:.1e} |")
    return rows


def layer_config(hidden: int, seq: int) -> GPTConfig:
    """Attention: hidden / 64 heads of 64; Gated DeltaNet: hidden / 128 key heads serving twice as many value heads
    of 64 (Qwen3-Next's ratio), so both project to ``hidden`` wide values."""
    heads = hidden // 64
    return GPTConfig(num_layers=2, hidden_size=hidden, num_attention_heads=heads, vocab_size=128, seq_length=seq,
                     max_position_embeddings=seq, position_embedding_type="none", normalization="rmsnorm",
                     add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa",
                     experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                     linear_num_key_heads=max(heads // 2, 1), linear_num_value_heads=heads, linear_key_head_dim=64,
                     linear_value_head_dim=64)


def layer_table(seqs: list[int], hidden: int, repeats: int) -> list[str]:
    rows = ["| tokens | attention ms | Gated DeltaNet ms | attention / GDN | fwd GFLOP/token: attention | GDN |",
            "|---:|---:|---:|---:|---:|---:|"]
    for seq in seqs:
        c = layer_config(hidden, seq)
        torch.manual_seed(0)
        attention, gdn = SelfAttention(c, tp_group=None, tp_size=1), GatedDeltaNet(c, tp_group=None, tp_size=1)
        x = torch.randn(seq, 1, hidden, generator=torch.Generator().manual_seed(1))
        steps = {name: (lambda m=m: _backward(m(x.clone().requires_grad_(), ForwardContext())))
                 for name, m in (("attention", attention), ("gdn", gdn))}
        times = _alternate(steps, repeats)
        rows.append(f"| {seq} | {1e3 * statistics.median(times['attention']):.0f} | "
                    f"{1e3 * statistics.median(times['gdn']):.0f} | {_ratio(times['attention'], times['gdn'])} | "
                    f"{_mixer_flops(c, 1, seq) / 1e9:.4f} | {_mixer_flops(c, 0, seq) / 1e9:.4f} |")
    return rows


def _mixer_flops(c: GPTConfig, number: int, seq: int) -> int:
    """Layer ``number``'s mixer's forward FLOPs per token (its layer's, less the dense MLP's)."""
    mlp = 2 * c.hidden_size * c.ffn_size * 2
    return layer_flops_per_token(c, number, seq) - mlp


# ---- the context-parallel exchange, on gloo ranks ------------------------------------------------------------


class _Groups:
    """What ``context_parallel_context`` reads of the parallel groups: the default group is the CP group."""

    def __init__(self, cp: int, rank: int) -> None:
        self.cp_size, self.cp_rank, self.cp_group = cp, rank, None


def exchange_config(kind: str, hidden: int, comm: str) -> GPTConfig:
    """Gated DeltaNet (hidden / 128 key heads, twice as many value heads, of 64) or Mamba-2 (hidden / 32 heads of 64,
    4 groups of state 64), in one-layer hybrid stacks."""
    return GPTConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, vocab_size=128, add_bias_linear=False,
                     normalization="rmsnorm", hybrid_layer_pattern="G" if kind == "gdn" else "M",
                     linear_num_key_heads=hidden // 128, linear_num_value_heads=hidden // 64, linear_key_head_dim=64,
                     linear_value_head_dim=64, mamba_num_heads=hidden // 32, mamba_head_dim=64, mamba_num_groups=4,
                     mamba_state_dim=64, linear_cp_comm_type=comm, hidden_dropout=0.0, attention_dropout=0.0)


def _exchange_rank(rank: int, world: int, cases: list[tuple[str, str, int, int]]) -> list[tuple[int, int]]:
    """Each case's (forward, backward) bytes this rank's collectives send: one mixer's forward + backward."""
    from megazero.model.attention.cp.input import context_parallel_context
    from megazero.mpu import cp_exchange

    sent = {"bytes": 0}
    gather, scatter, a2a = cp_exchange.all_gather_flat, cp_exchange.reduce_scatter_flat, dist.all_to_all_single

    def counting(fn: Callable, whole: Callable) -> Callable:
        def call(out, x, *args, **kwargs):
            sent["bytes"] += whole(out, x).numel() * x.element_size() * (world - 1) // world
            return fn(out, x, *args, **kwargs)
        return call

    cp_exchange.all_gather_flat = counting(gather, lambda out, x: out)
    cp_exchange.reduce_scatter_flat = counting(scatter, lambda out, x: x)
    dist.all_to_all_single = counting(a2a, lambda out, x: x)
    try:
        results = []
        for kind, comm, hidden, seq in cases:
            torch.manual_seed(0)
            c = exchange_config(kind, hidden, comm)
            mixer = (GatedDeltaNet if kind == "gdn" else MambaMixer)(c, tp_group=None, tp_size=1)
            context = ForwardContext(cp=context_parallel_context(seq, _Groups(world, rank), "p2p", torch.device("cpu")))
            x = torch.randn(seq // world, 1, hidden, requires_grad=True)
            sent["bytes"] = 0
            out = mixer(x, context)
            forward = sent["bytes"]
            _backward(out)
            results.append((forward, sent["bytes"] - forward))
        return results
    finally:
        cp_exchange.all_gather_flat, cp_exchange.reduce_scatter_flat, dist.all_to_all_single = gather, scatter, a2a


def exchange_table(cps: list[int], seqs: list[int], hidden: int) -> list[str]:
    from ranks import run_ranks

    cases = [(kind, comm, hidden, seq) for comm in ("state_passing", "a2a") for kind in ("gdn", "mamba")
             for seq in seqs]
    rows = ["| mixer | exchange | cp | tokens | fwd KiB sent | bwd KiB sent | planner KiB (fwd + bwd) | |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for cp in cps:
        got = run_ranks(cp, _exchange_rank, cases)
        for i, (kind, comm, _, seq) in enumerate(cases):
            fwd, bwd = (max(r[i][j] for r in got) for j in (0, 1))
            planned = recurrent_cp_bytes_per_layer(exchange_config(kind, hidden, comm), kind, tp=1, cp=cp,
                                                   seq_length=seq, micro_batch_size=1, precision="fp32", recompute=None)
            verdict = "agrees" if fwd + bwd == planned else "DIFFERS"
            rows.append(f"| {'Gated DeltaNet' if kind == 'gdn' else 'Mamba-2'} | {comm} | {cp} | {seq} | "
                        f"{fwd / KIB:.1f} | {bwd / KIB:.1f} | {planned / KIB:.1f} | {verdict} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["kernels", "layers", "exchange"],
                   choices=["kernels", "layers", "exchange"])
    p.add_argument("--kernel-seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8, help="the gated delta rule's heads (dk = dv = --dk)")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--mamba", type=int, nargs=4, default=[32, 64, 4, 128],
                   metavar=("HEADS", "HEAD_DIM", "GROUPS", "STATE"))
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768], help="the layers' sequence lengths")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--exchange-seqs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layer-repeats", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="seconds: short sequences, small heads")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(a)
    finally:
        torch.set_num_threads(threads)


def _run(a: argparse.Namespace) -> int:
    if a.tiny:
        a.kernel_seq, a.heads, a.dk, a.mamba, a.seqs, a.hidden = 256, 2, 16, [4, 16, 2, 16], [256, 512], 128
        a.exchange_seqs, a.cps, a.repeats, a.layer_repeats = [256, 512], [2], 1, 1
    if "kernels" in a.parts:
        log.info("chunked kernels, forward + backward, fp32, batch 1, %d tokens, one thread, %d rounds",
                 a.kernel_seq, a.repeats)
        log.info("\n".join(kernel_table(a.kernel_seq, a.heads, a.dk, tuple(a.mamba), a.repeats)))
    if "layers" in a.parts:
        log.info("one layer's mixer, forward + backward, fp32, batch 1, hidden %d, one thread, %d round(s)",
                 a.hidden, a.layer_repeats)
        log.info("\n".join(layer_table(a.seqs, a.hidden, a.layer_repeats)))
    if "exchange" in a.parts:
        log.info("context-parallel exchange of one mixer, fp32, batch 1, hidden %d, zigzag layout, gloo ranks; "
                 "bytes the busiest rank sends", 2 * a.hidden)
        log.info("\n".join(exchange_table(a.cps, a.exchange_seqs, 2 * a.hidden)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
