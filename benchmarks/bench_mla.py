#!/usr/bin/env python
"""Multi-latent attention against standard attention of the same forward FLOPs per token, on the CPU.

Three parts, all forward + backward on one thread (``torch.set_num_threads(1)``), batch 1:

* **layer**: one pre-norm transformer layer (RMSNorm, SwiGLU, RoPE, no biases) with multi-latent attention
  (DeepSeek-V2-Lite's head widths by default: qk 128 + RoPE 64, v 128, kv latent 512, no query LoRA)
  against the same layer with standard attention whose heads, head dim and key/value groups are chosen
  so the layer's forward matmul FLOPs per token at that sequence length match (the closest of a small
  grid; the gap is printed). The FLOPs are counted here in closed form for both (2 per multiply-add,
  the full s x s square as ``megazero.model.flops`` counts it); the column ``flops.py`` is what
  ``megazero.model.flops.layer_forward_flops_per_token`` says for the same config. fp32 and bf16 at the
  short sequence, fp32 at the long one (where the core attention dominates).
* **core**: the core attention alone at the long sequence: MLA's q/k at qk+rope and v at v (one SDPA
  call, as ``core_attention`` makes it), the same with V zero-padded to q/k's width (what flash-attn and
  Transformer Engine take), and standard heads of the same core FLOPs.
* **ring**: context-parallel ring attention (zigzag) on 2 gloo ranks at MLA's widths: the bytes a rank
  sends (``RingStats``) against ``s_local * b * heads * (dqk + dv) * 4`` per hop, and what padding V
  to dqk sends (measured and by the formula), beside the matched standard heads.

Timing: CPU time of the main thread (``time.thread_time``: the figure that holds up on shared cores),
wall time beside it. A and B run alternately (A B, B A, ...) ``--repeats`` times; the table gives the
medians, the median of the per-pair ratios B/A and their range (the noise). Peak memory: one extra
step under ``LiveMemoryTracker`` (live tensor bytes the step allocated at its peak; inputs and weights
excluded). KV cache per token and layer: MLA's latent plus its shared RoPE key (kv_lora + rope values)
against standard attention's 2 * groups * head dim.

    python benchmarks/bench_mla.py                 # ~3 min on 2 shared cores
    python benchmarks/bench_mla.py --tiny          # seconds: tiny widths, short sequences
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megazero import mpu  # noqa: E402
from megazero.model.attention.core import core_attention  # noqa: E402
from megazero.model.attention.rope import rotary_embedding  # noqa: E402
from megazero.model.config import GPTConfig  # noqa: E402
from megazero.model.flops import layer_forward_flops_per_token  # noqa: E402
from megazero.model.transformer import TransformerLayer  # noqa: E402
from megazero.utils.memory_tracker import LiveMemoryTracker  # noqa: E402
from megazero.model.forward_context import ForwardContext  # noqa: E402

log = logging.getLogger("bench_mla")
MIB = 2 ** 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Widths:
    hidden: int
    heads: int
    qk: int
    rope: int
    v: int
    kv_lora: int
    q_lora: Optional[int]


def mla_config(w: Widths, seq: int, dtype: torch.dtype) -> GPTConfig:
    """One MLA layer's config (no dropout, SDPA, plain RoPE: YaRN changes the tables, not the cost)."""
    return GPTConfig(num_layers=1, hidden_size=w.hidden, num_attention_heads=w.heads, vocab_size=256,
                     seq_length=seq, max_position_embeddings=seq, position_embedding_type="rope",
                     normalization="rmsnorm", activation="swiglu", add_bias_linear=False, hidden_dropout=0.0,
                     attention_dropout=0.0, attention_backend="sdpa", params_dtype=dtype,
                     multi_latent_attention=True, q_lora_rank=w.q_lora, kv_lora_rank=w.kv_lora, qk_head_dim=w.qk,
                     qk_pos_emb_head_dim=w.rope, v_head_dim=w.v, rope_type="rope")


def standard_config(mla: GPTConfig, heads: int, head_dim: int, groups: int) -> GPTConfig:
    """The same layer with standard attention of ``heads`` x ``head_dim`` and ``groups`` key/value groups."""
    return mla.replace(multi_latent_attention=False, num_attention_heads=heads, kv_channels=head_dim,
                       num_query_groups=groups)


def attention_flops(c: GPTConfig, s: int) -> int:
    """Forward matmul FLOPs per token of the attention block (projections and the full s x s core)."""
    h, n = c.hidden_size, c.num_attention_heads
    if not c.multi_latent_attention:
        d, g = c.head_dim, c.query_groups
        return 2 * h * (n + 2 * g) * d + 4 * s * n * d + 2 * n * d * h
    qk, rope, v, kv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.kv_lora_rank
    q_out = n * (qk + rope)
    q = 2 * h * q_out if c.q_lora_rank is None else 2 * h * c.q_lora_rank + 2 * c.q_lora_rank * q_out
    kv_proj = 2 * h * (kv + rope) + 2 * kv * n * (qk + v)
    return q + kv_proj + 2 * s * n * (qk + rope) + 2 * s * n * v + 2 * n * v * h


def layer_flops(c: GPTConfig, s: int) -> int:
    """Forward matmul FLOPs per token of the whole layer: attention plus the (gated) MLP."""
    gate = 2 if c.activation == "swiglu" else 1
    return attention_flops(c, s) + 2 * c.hidden_size * gate * c.ffn_size + 2 * c.ffn_size * c.hidden_size


def match_standard(mla: GPTConfig, s: int, tolerance: float = 0.03) -> GPTConfig:
    """The standard attention (heads, head dim a multiple of 16, groups dividing heads) of layer FLOPs at
    sequence ``s`` within ``tolerance`` of MLA's: multi-head before GQA, then the head dim nearest MLA's
    value width, then the smallest gap (the closest of all when none is within the tolerance)."""
    target = layer_flops(mla, s)
    best, best_key = None, None
    for heads in range(1, 4 * mla.num_attention_heads + 1):
        for d in range(16, 513, 16):
            for g in (g for g in range(1, heads + 1) if heads % g == 0):
                c = standard_config(mla, heads, d, g)
                gap = abs(layer_flops(c, s) - target) / target
                key = (gap > tolerance, g != heads, abs(d - mla.v_head_dim), gap)
                if best_key is None or key < best_key:
                    best, best_key = c, key
    assert best is not None
    return best


def kv_cache_values(c: GPTConfig) -> int:
    """Values per token and layer an inference cache holds."""
    if c.multi_latent_attention:
        return c.kv_lora_rank + c.qk_pos_emb_head_dim
    return 2 * c.query_groups * c.head_dim


def describe(c: GPTConfig) -> str:
    if c.multi_latent_attention:
        q = "no q LoRA" if c.q_lora_rank is None else f"q LoRA {c.q_lora_rank}"
        return (f"MLA {c.num_attention_heads} heads, qk {c.qk_head_dim}+{c.qk_pos_emb_head_dim}, v {c.v_head_dim}, "
                f"kv latent {c.kv_lora_rank}, {q}")
    kind = "MHA" if c.query_groups == c.num_attention_heads else f"GQA {c.query_groups} groups"
    return f"{kind} {c.num_attention_heads} heads x {c.head_dim}"


# ------------------------------------------------------------------------------------------ measuring

Step = Callable[[], None]


def layer_step(c: GPTConfig, seq: int) -> Step:
    """Forward + backward of one layer on a fixed random input; gradients dropped after each step."""
    torch.manual_seed(0)
    layer = TransformerLayer(c, tp_group=mpu.NO_GROUP, tp_size=1)
    x = torch.randn(seq, 1, c.hidden_size, generator=torch.Generator().manual_seed(1)).to(c.params_dtype)
    x.requires_grad_()
    rotary = rotary_embedding(c)(torch.arange(seq).unsqueeze(0))

    def step() -> None:
        layer(x, ForwardContext(rotary)).float().sum().backward()
        for p in (x, *layer.parameters()):
            p.grad = None
    return step


def core_step(seq: int, heads: int, dqk: int, dv: int, pad_v: bool = False) -> Step:
    """Forward + backward of the causal core attention alone (``core_attention``, SDPA), fp32."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(seq, 1, heads, dqk, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(seq, 1, heads, dv, generator=g).requires_grad_()

    def step() -> None:
        vv = F.pad(v, (0, dqk - dv)) if pad_v else v
        out = core_attention(q, k, vv, backend="sdpa")
        if pad_v:
            out = out.view(seq, 1, heads, dqk)[..., :dv]
        out.sum().backward()
        for t in (q, k, v):
            t.grad = None
    return step


def timed(step: Step) -> tuple[float, float]:
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    step()
    return time.thread_time() - cpu0, time.perf_counter() - wall0


def peak_bytes(step: Step) -> int:
    with LiveMemoryTracker("cpu", scan_existing=False) as tracker:
        step()
    return tracker.peak_bytes


@dataclass
class Paired:
    """Paired runs of A and B: per-run CPU and wall seconds, and each one's peak."""
    cpu_a: list[float]
    cpu_b: list[float]
    wall_a: list[float]
    wall_b: list[float]
    peak_a: int
    peak_b: int

    def ratios(self) -> list[float]:
        return [b / a for a, b in zip(self.cpu_a, self.cpu_b)]


def paired(a: Step, b: Step, repeats: int) -> Paired:
    """One warm-up each, then ``repeats`` pairs alternating the order (A B, B A, ...), then the peaks."""
    a(), b()
    out = Paired([], [], [], [], 0, 0)
    for i in range(repeats):
        for which in ("ab" if i % 2 == 0 else "ba"):
            cpu, wall = timed(a if which == "a" else b)
            (out.cpu_a if which == "a" else out.cpu_b).append(cpu)
            (out.wall_a if which == "a" else out.wall_b).append(wall)
    out.peak_a, out.peak_b = peak_bytes(a), peak_bytes(b)
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def print_pair(label: str, tokens: int, names: tuple[str, str], p: Paired) -> None:
    """Rows for A and B: median CPU s, tokens/s, wall s, peak MiB; then B/A medians with the ratios' range."""
    for name, cpu, wall, peak in ((names[0], p.cpu_a, p.wall_a, p.peak_a), (names[1], p.cpu_b, p.wall_b, p.peak_b)):
        c = _median(cpu)
        print(f"  {label:<14}{name:<44}{c:9.3f}{tokens / c:10.0f}{_median(wall):9.3f}{peak / MIB:10.1f}")
    r = p.ratios()
    print(f"  {label:<14}{names[1] + ' / ' + names[0]:<44} CPU time x{_median(r):.3f} (pairs {min(r):.3f}-"
          f"{max(r):.3f}, n={len(r)}); tokens/s x{1 / _median(r):.3f}; peak x{p.peak_b / p.peak_a:.3f}")


# ------------------------------------------------------------------------------------------ the parts

def layer_part(w: Widths, seq: int, dtype: str, repeats: int) -> None:
    mla = mla_config(w, seq, DTYPES[dtype])
    std = match_standard(mla, seq)
    fm, fs = layer_flops(mla, seq), layer_flops(std, seq)
    print(f"\nlayer, {dtype}, S {seq}: A = {describe(std)}; B = {describe(mla)}")
    print(f"  forward FLOPs/token (here): A {fs / 1e6:.3f} M, B {fm / 1e6:.3f} M (B/A {fm / fs:.3f}); attention "
          f"core A {4 * seq * std.num_attention_heads * std.head_dim / 1e6:.3f} M, B "
          f"{2 * seq * w.heads * (w.qk + w.rope + w.v) / 1e6:.3f} M")
    ours = {"A": fs, "B": fm}
    theirs = {"A": layer_forward_flops_per_token(std, seq), "B": layer_forward_flops_per_token(mla, seq)}
    print("  megazero.model.flops.layer_forward_flops_per_token: "
          + ", ".join(f"{k} {theirs[k] / 1e6:.3f} M ({'agrees' if theirs[k] == ours[k] else 'differs'})"
                      for k in ours))
    print(f"  {'':<14}{'configuration':<44}{'CPU s':>9}{'tokens/s':>10}{'wall s':>9}{'peak MiB':>10}")
    print_pair("layer " + dtype, seq, ("A " + describe(std), "B MLA"), paired(layer_step(std, seq),
                                                                           layer_step(mla, seq), repeats))
    kv_m, kv_s = kv_cache_values(mla), kv_cache_values(std)
    elem = torch.finfo(DTYPES["bf16"]).bits // 8
    print(f"  KV cache per token and layer: B (latent {w.kv_lora} + rope {w.rope}) {kv_m} values, A (2 x "
          f"{std.query_groups} x {std.head_dim}) {kv_s} values; B/A {kv_m / kv_s:.3f}; in bf16 {kv_m * elem} "
          f"against {kv_s * elem} bytes")


def core_part(w: Widths, seq: int, repeats: int) -> None:
    dqk, dv, n = w.qk + w.rope, w.v, w.heads
    width = n * (dqk + dv) // 2  # standard heads of the same core FLOPs: 4 s n' d' = 2 s n (dqk + dv)
    d_std = min((d for d in range(8, width + 1, 8) if width % d == 0), key=lambda d: abs(d - dv))
    n_std = width // d_std
    print(f"\ncore attention alone, fp32, S {seq}: {n} heads at qk {dqk} / v {dv} (SDPA), the same with V "
          f"padded to {dqk}, and {n_std} heads x {d_std} (the same core FLOPs)")
    print(f"  {'':<14}{'configuration':<44}{'CPU s':>9}{'tokens/s':>10}{'wall s':>9}{'peak MiB':>10}")
    mla = core_step(seq, n, dqk, dv)
    print_pair("core", seq, (f"A standard {n_std} x {d_std}", f"B MLA {dqk}/{dv}"),
               paired(core_step(seq, n_std, d_std, d_std), mla, repeats))
    print_pair("core", seq, (f"A MLA, V padded to {dqk}", f"B MLA {dqk}/{dv}"),
               paired(core_step(seq, n, dqk, dv, pad_v=True), mla, repeats))


def _ring_rank(rank: int, cp: int, seq: int, shapes: list) -> list[dict]:
    import bench_context_parallel as cpb

    return [cpb._measure("ring zigzag", seq, shape, rank, cp) for shape in shapes]


def ring_part(w: Widths, seq: int) -> None:
    """Zigzag ring attention on 2 gloo ranks (``bench_context_parallel``'s step and counters), fp32."""
    import bench_context_parallel as cpb
    from ranks import run_ranks

    cp, dqk, n = 2, w.qk + w.rope, w.heads
    std = match_standard(mla_config(w, seq, torch.float32), seq)
    shapes = {f"MLA qk {dqk} / v {w.v}": cpb.Shape(n, n, dqk, w.v),
              f"MLA, V padded to {dqk}": cpb.Shape(n, n, dqk, dqk),
              describe(std): cpb.Shape(std.num_attention_heads, std.query_groups, std.head_dim, std.head_dim)}
    got = run_ranks(cp, _ring_rank, seq, list(shapes.values()))
    print(f"\ncontext-parallel ring (zigzag), fp32, S {seq}, cp {cp} gloo ranks, batch 1; formula per hop: "
          f"s_local * b * groups * (dqk + dv) * 4 (MLA: groups = heads = {n})")
    print(f"  {'exchange':<40}{'fwd KiB sent':>13}{'formula':>10}{'bwd KiB':>10}{'peak MiB':>9}{'CPU s max':>10}")
    s_local = seq // cp
    for i, (name, shape) in enumerate(shapes.items()):
        ranks = [got[r][i] for r in range(cp)]
        formula = s_local * shape.groups * (shape.head_dim + shape.v_head_dim) * (cp - 1) * 4
        fwd = max(r["fwd_bytes"] for r in ranks)
        print(f"  {name:<40}{fwd / 1024:13.1f}{formula / 1024:10.1f}{max(r['bwd_bytes'] for r in ranks) / 1024:10.1f}"
              f"{max(r['peak'] for r in ranks) / MIB:9.1f}{max(r['cpu'] for r in ranks):10.2f}"
              f"{'' if fwd == formula else '  MISMATCH'}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny widths and sequences (a smoke run of seconds)")
    p.add_argument("--seq", type=int, default=None, help="the layer's sequence (default 1024)")
    p.add_argument("--long-seq", type=int, default=None, help="the long sequence (default 4096)")
    p.add_argument("--repeats", type=int, default=None, help="pairs per comparison (default 6; 3 at bf16)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--parts", nargs="+", default=["layer", "long", "core", "ring"],
                   choices=["layer", "long", "core", "ring"])
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    w = (Widths(64, 2, 16, 8, 16, 32, None) if a.tiny else Widths(512, 4, 128, 64, 128, 512, None))
    seq, long_seq = a.seq or (64 if a.tiny else 1024), a.long_seq or (128 if a.tiny else 4096)
    repeats = a.repeats or (2 if a.tiny else 6)
    print(f"torch {torch.__version__}, 1 thread; hidden {w.hidden}, RMSNorm, SwiGLU, RoPE, batch 1, forward + "
          f"backward; CPU s = median main-thread CPU time; ratios B/A per pair (alternating order)")
    if "layer" in a.parts:
        for dtype in a.dtypes:
            layer_part(w, seq, dtype, repeats if dtype == "fp32" else max(2, repeats // 2))
    if "long" in a.parts:
        layer_part(w, long_seq, "fp32", max(2, repeats // 2))
    if "core" in a.parts:
        core_part(w, long_seq, max(2, repeats // 2))
    if "ring" in a.parts:
        ring_part(w, long_seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
