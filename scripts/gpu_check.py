"""The acceptance check for a CUDA machine (``bash scripts/gpu_check.sh``): what CPU tests cannot
show, each check an assertion, one ``PASS`` / ``FAIL`` / ``SKIP`` line per check, a summary, and
exit status 1 when any check failed.

``GPU_CHECK_DEVICE=cpu`` is a dry run of the script on the CPU: every check that can run there
does (on CPU tensors), the others are skipped with their reason.

Checks (one GPU suffices; about 10 minutes on an H100/H200, most of it the 1.3B run):

1. ``two_ranks_offload``: two processes on ``cuda:0`` over gloo (NCCL refuses two ranks on one
   GPU) run ZeRO-3 with ``overlap_comm`` and both offloads pinned for a few steps; every loss is
   within :data:`LOSS_RTOL` (relative, fp32) of the same run on the CPU.
2. ``two_ranks_native``: the same two-process run with ``MEGAZERO_ZERO_COLLECTIVES=native`` (the
   collectives an NCCL run issues) equals the emulated one bit for bit.
3. ``slow_collectives``: one process, whose ZeRO all-gathers and reduce-scatters complete late: on
   CUDA their copy runs on a side stream after ``torch.cuda._sleep`` and ``wait()`` orders the
   current stream after it; on the CPU the copy runs only at ``wait()``. Any read before ``wait()``
   or any free before completion changes the bits: the run must equal the ordinary one bitwise.
4. ``offload_bitwise``: offload of parameters and optimizer (pinned) on and off are bitwise equal
   (fp32, one process), and on CUDA the pinned bytes torch's caching host allocator holds do not
   grow with the offloaded state, whose host figures (``model_state_bytes()``) are its pinned
   arenas' exact sizes.
5. ``ring_kernels``: the ring's block kernels (torch's flash op in bf16, its efficient op in fp32 on
   CUDA; the CPU flash op in the dry run) computing a GQA causal attention block by block, as a
   context-parallel rank does: forward blocks merged by their log-sum-exp, each block's backward given
   the merged output and LSE; output and gradients within :data:`RING_RTOL` of fp64 math attention.
   ``ring_kernels_dropout``: the CUDA kernels with their own dropout (Philox state kept for backward)
   equal torch's SDPA with dropout from the same generator state, output and gradients.
   ``moe_layer``: the mixture-of-experts layer (router, token dropping, a gated shared expert, the
   load-balancing loss's gradient, the padded dispatch) on the device against the CPU's per-expert
   loop in fp32, within :data:`MOE_RTOL`; the experts as grouped matmuls against the device's loop in
   bf16 (torch's grouped kernel, on Hopper/Blackwell), within :data:`MOE_BF16_RTOL`.
6. ``attention_backends``: sdpa and flash-attn (when importable) agree with math attention in
   bf16 within :data:`ATTENTION_ATOL`; ``apex_adam``: apex's FusedAdam is the optimizer kernel on
   CUDA when apex's optimizers import.
7. ``throughput_1p3b``: ``pretrain_gpt.py`` with the gpt-1.3b preset, bf16, ZeRO-1 on every visible
   GPU (NCCL), mock data, a few iterations: tokens/s and MFU against the GPU's dense bf16 peak
   (megazero.training.meters.PEAK_TFLOPS, or ``$GPU_CHECK_PEAK_TFLOPS``) are printed; asserted: it ran and MFU > 0.
8. ``nccl_watchdog``: NCCL's groups run under ``--distributed-timeout-minutes`` plus
   ``NCCL_GRACE_S`` with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` and the flight recorder's dump on a
   timeout; on 2+ GPUs, a rank stopped with SIGSTOP ends ``pretrain_gpt.py`` within 110 s at a
   one-minute timeout, the verdict naming it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's megazero, installed or not

LOSS_RTOL = 1e-4  # CUDA vs CPU, fp32 (TF32 off): per-step loss, relative
ATTENTION_ATOL = 2e-2  # bf16 backends vs fp32 math attention, max |diff| over unit-variance inputs
STEPS = 3
MOE_RTOL = 1e-4  # the MoE layer on the device vs the CPU, fp32 without TF32 (routing must agree exactly)
MOE_BF16_RTOL = 3e-2  # grouped against per-expert matmuls in bf16 (the same routing, other summation orders)
RING_RTOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # max |diff| / max |ref|; fp32 without TF32
THROUGHPUT_ITERS = 8


def device() -> torch.device:
    """The device under check: ``$GPU_CHECK_DEVICE`` (default ``cuda``)."""
    return torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))


class Skip(Exception):
    """A check that cannot run here; its message is the reason."""


# ---- a tiny GPT under the ZeRO engine ----------------------------------------------------------

def _tiny_config():
    from megazero.model import GPTConfig

    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                     max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)


def _ds_config(*, offload: bool, overlap: bool = True) -> dict:
    zc = {"stage": 3, "overlap_comm": overlap, "stage3_param_persistence_threshold": 0,
          "stage3_prefetch_bucket_size": 1, "reduce_bucket_size": 1}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zc["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zc,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}


def train(dev: torch.device, *, offload: bool, steps: int = STEPS, rank: int = 0):
    """``steps`` of ZeRO-3 on a tiny GPT (fp32, seeded, this rank's own batches): the losses and the
    engine (its full weights by ``consolidated_state_dict``)."""
    from megazero import mpu, zero
    from megazero.model import GPTModel

    torch.manual_seed(0)
    engine = zero.initialize(GPTModel(_tiny_config(), device="meta"), _ds_config(offload=offload), device=dev,
                             mpu=mpu if mpu.model_parallel_is_initialized() else None)
    data = torch.randint(0, 256, (steps, 2, 33), generator=torch.Generator().manual_seed(100 + rank))
    losses = []
    for s in range(steps):
        x = data[s].to(dev)
        loss = engine(x[:, :-1], labels=x[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


# ---- 1, 2: two ranks over gloo on one device ---------------------------------------------------

def _two_rank_worker(rank: int, port: int, dev_name: str, out_dir: str) -> None:
    import torch.distributed as dist

    from megazero import mpu
    from megazero.zero.comm import COLLECTIVES_ENV

    dev = torch.device(dev_name)
    if dev.type == "cuda":
        torch.cuda.set_device(0)  # both ranks on cuda:0: gloo allows it, NCCL does not
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mpu.initialize_model_parallel(1)
        runs = {}
        for name, run_dev, collectives in (("cpu", "cpu", "emulated"), ("emulated", dev_name, "emulated"),
                                           ("native", dev_name, "native")):
            os.environ[COLLECTIVES_ENV] = collectives  # read as the engine is built
            losses, engine = train(torch.device(run_dev), offload=True, rank=rank)
            runs[name] = {"losses": losses, "weights": _weights(engine), "host": engine.model_state_bytes()}
            del engine
        torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


_TWO_RANKS: dict = {}


def _two_ranks() -> dict:
    """Both ranks' runs (spawned once, shared by checks 1 and 2): rank -> run name -> results."""
    if not _TWO_RANKS:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_two_rank_worker, args=(port, str(device()), d), nprocs=2, join=True)
            _TWO_RANKS.update({r: torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)})
    return _TWO_RANKS


def check_two_ranks_offload() -> str:
    out = []
    for rank, runs in _two_ranks().items():
        ref, got = runs["cpu"]["losses"], runs["emulated"]["losses"]
        for step, (a, b) in enumerate(zip(ref, got)):
            assert abs(a - b) <= LOSS_RTOL * abs(a), (
                f"rank {rank} step {step + 1}: loss on {device()} {b!r} vs CPU {a!r}, relative difference "
                f"{abs(a - b) / abs(a):.2e} > {LOSS_RTOL:g}")
        out.append(f"rank {rank} losses {', '.join(f'{x:.6f}' for x in got)}")
    return "; ".join(out) + f" (within {LOSS_RTOL:g} of the CPU run)"


def check_two_ranks_native() -> str:
    for rank, runs in _two_ranks().items():
        assert runs["native"]["losses"] == runs["emulated"]["losses"], (
            f"rank {rank}: native collectives' losses {runs['native']['losses']} differ from the emulated "
            f"{runs['emulated']['losses']}")
        differ = _bitwise(runs["native"]["weights"], runs["emulated"]["weights"])
        assert not differ, f"rank {rank}: native vs emulated collectives: weights differ in {differ[:5]}"
    return "weights and losses bit-identical on both ranks"


# ---- 3: collectives that complete late ---------------------------------------------------------

class _LateWork:
    """A collective's handle whose result is written late: ``wait()`` makes it visible."""

    def __init__(self, out: torch.Tensor, src: torch.Tensor) -> None:
        self.out, self.src, self.side = out, src, None
        if out.device.type == "cuda":
            # No record_stream: an early free must be able to hand the block to someone else.
            self.side = torch.cuda.Stream(device=out.device)
            self.side.wait_stream(torch.cuda.current_stream(out.device))
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(50_000_000)  # ~25-50 ms: the engine's reads run ahead of it
                out.copy_(src)

    def wait(self) -> bool:
        if self.side is not None:
            torch.cuda.current_stream(self.out.device).wait_stream(self.side)
        elif self.src is not None:
            self.out.copy_(self.src)  # on the CPU the result appears only now
        self.src = None
        return True


def _late(method: Callable, op: str) -> Callable:
    def late(self, out, src, name, *args, **kwargs):
        if self.size(name) != 1 or not kwargs.get("async_op", args[0] if args else False):
            return method(self, out, src, name, *args, **kwargs)
        self._count(op, name, src if op == "reduce_scatter" else out)
        return _LateWork(out, src)
    return late


def check_slow_collectives() -> str:
    from megazero.zero.comm import CommCounter

    dev = device()
    ref_losses, engine = train(dev, offload=False)
    ref = _weights(engine)
    del engine
    patched = {"all_gather": CommCounter.all_gather, "reduce_scatter": CommCounter.reduce_scatter}
    calls = {"n": 0}

    def counted(fn):
        def wrapper(*a, **k):
            calls["n"] += 1
            return fn(*a, **k)
        return wrapper

    try:
        for op, method in patched.items():
            setattr(CommCounter, op, counted(_late(method, op)))
        losses, engine = train(dev, offload=False)
        got = _weights(engine)
        del engine
    finally:
        for op, method in patched.items():
            setattr(CommCounter, op, method)
    assert calls["n"] > 0, "the engine issued no all-gather or reduce-scatter through CommCounter"
    assert losses == ref_losses, f"late collectives changed the losses: {losses} vs {ref_losses}"
    differ = _bitwise(got, ref)
    assert not differ, f"late collectives changed the weights of {differ[:5]}: a read before wait() or an early free"
    how = "a side stream after torch.cuda._sleep" if dev.type == "cuda" else "wait() (CPU)"
    return f"{calls['n']} collectives completed late on {how}; bit-identical"


# ---- 4: offload on and off ---------------------------------------------------------------------

def check_offload_bitwise() -> str:
    dev = device()
    stats = getattr(torch.cuda.memory, "host_memory_stats", None) if dev.type == "cuda" else None
    before = stats()["allocated_bytes.current"] if stats else None
    on_losses, on = train(dev, offload=True)
    after = stats()["allocated_bytes.current"] if stats else None
    counted = on.model_state_bytes()
    host = sum(counted.get(k, 0) for k in ("host_optimizer", "host_ring", "host_params", "host_param_ring"))
    placement = on.placement
    arenas = [o.arena for o in (placement.offload, placement.param_offload) if o is not None]
    on_weights = _weights(on)
    del on
    off_losses, off = train(dev, offload=False)
    assert on_losses == off_losses, f"offload on {on_losses} vs off {off_losses}: losses differ"
    differ = _bitwise(on_weights, _weights(off))
    assert not differ, f"offload on vs off: weights differ in {differ[:5]}"
    assert host > 0 and host == sum(a.nbytes for a in arenas), (
        f"the engine reports {host} host bytes, its offload arenas hold {sum(a.nbytes for a in arenas)}")
    note = f"bit-identical; host {host} bytes in {len(arenas)} exact-size arenas"
    if dev.type != "cuda":
        return note + " (pinned memory: skipped on the CPU, nothing can be pinned)"
    assert all(a.pinned for a in arenas), "pin_memory was asked for but an offload arena is not pinned"
    if stats is None:
        return note + " (torch.cuda.memory.host_memory_stats is not in this torch: the allocator not checked)"
    grown = after - before
    # The arenas are registered with cudaHostRegister, outside torch's caching host allocator; had
    # they gone through it, it would hold at least their bytes, rounded up to powers of two.
    assert grown < host, (f"torch's caching host allocator grew by {grown} bytes while {host} bytes were "
                          "offloaded: some offload buffer is pinned with pin_memory=True (rounded, cached)")
    return note + f", pinned; caching host allocator grew by {grown} bytes"


# ---- 6: flash-attn, apex -----------------------------------------------------------------------

def check_attention_backends() -> str:
    from megazero.model.attention.core import core_attention, flash_attn_available

    dev = device()
    if dev.type != "cuda":
        raise Skip("bf16 attention kernels (sdpa's flash/efficient, flash-attn) need CUDA")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1024, 2, 16, 128, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
    ref = core_attention(q.float(), k.float(), v.float(), backend="math")
    out = []
    for backend in ["sdpa", "math"] + (["flash"] if flash_attn_available() else []):
        diff = (core_attention(q, k, v, backend=backend).float() - ref).abs().max().item()
        assert diff <= ATTENTION_ATOL, f"attention {backend} bf16 vs fp32 math: max |diff| {diff:.3e} > {ATTENTION_ATOL}"
        out.append(f"{backend} {diff:.1e}")
    flash = "" if flash_attn_available() else " (flash-attn not importable: not checked)"
    return "max |diff| vs fp32 math: " + ", ".join(out) + flash


def check_recurrent_kernels() -> str:
    """Gated DeltaNet's and Mamba-2's chunked scans on the GPU (fp32; flash-linear-attention's and mamba-ssm's
    kernels where importable) against the step-by-step recurrences in fp64 on the CPU."""
    from megazero.model.recurrent import kernels
    from megazero.model.recurrent.delta_rule import recurrent_gated_delta_rule
    from megazero.model.recurrent.ssd import recurrent_ssd_scan

    dev = device()
    if dev.type != "cuda":
        raise Skip("the recurrent kernels on the GPU need CUDA")
    g = torch.Generator().manual_seed(0)
    b, t, h, d = 2, 300, 4, 64
    q, k = (torch.nn.functional.normalize(torch.randn(b, t, h, d, generator=g), dim=-1) for _ in range(2))
    v, gate, beta = torch.randn(b, t, h, d, generator=g), -torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g)
    want, _ = recurrent_gated_delta_rule(*(x.double() for x in (q, k, v, gate, beta)))
    got, _ = kernels.gated_delta_rule(*(x.to(dev) for x in (q, k, v, gate, beta)))
    gdn = (got.double().cpu() - want).abs().max().item()
    x, dt = torch.randn(b, t, h, d, generator=g), torch.rand(b, t, h, generator=g) * 0.1
    A, B, C = -torch.rand(h, generator=g) - 0.5, torch.randn(b, t, 1, 32, generator=g), torch.randn(b, t, 1, 32, generator=g)
    want, _ = recurrent_ssd_scan(*(y.double() for y in (x, dt, A, B, C)))
    got, _ = kernels.ssd_scan(*(y.to(dev) for y in (x, dt, A, B, C)))
    ssd = (got.double().cpu() - want).abs().max().item()
    assert gdn < 1e-4 and ssd < 1e-4, f"recurrent kernels on the GPU vs fp64: gated delta rule {gdn:.1e}, SSD {ssd:.1e}"
    fused = [name for name, found in (("flash-linear-attention", kernels.fla_gated_delta_rule()),
                                      ("mamba-ssm", kernels.mamba_chunk_scan())) if found is not None]
    return f"max |diff| vs fp64: gated delta rule {gdn:.1e}, SSD {ssd:.1e} ({', '.join(fused) or 'PyTorch forms'})"


def check_apex_adam() -> str:
    dev = device()
    if dev.type != "cuda":
        raise Skip("apex FusedAdam runs on CUDA masters only")
    try:
        from apex.optimizers import FusedAdam  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means apex is not usable here
        raise Skip(f"apex's optimizers do not import ({type(e).__name__}: {e})")
    _, engine = train(dev, offload=False, steps=1)
    kernel = type(engine.optimizer)
    assert kernel.__module__.startswith("apex"), (
        f"apex is importable but the optimizer is {kernel.__module__}.{kernel.__name__}: see the engine's "
        "'apex FusedAdam is unusable' warning")
    return f"optimizer {kernel.__module__}.{kernel.__name__}"


# ---- 5: the ring's block kernels ---------------------------------------------------------------

def _blockwise_attention(q, k, v, kernel, chunks: int):
    """Causal attention of [b, h, s, d] q over [b, g, s, d] k/v from ``chunks`` query and key chunks per
    side, the way the ring computes it: diagonal blocks causal, blocks below it full, merged in fp32."""
    b, h, s, d = q.shape
    c, scale = s // chunks, d ** -0.5
    out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    blocks = [(i, j) for i in range(chunks) for j in range(i + 1)]
    for i, j in blocks:
        rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
        o, l_, _ = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], i == j, scale)
        new = torch.logaddexp(lse[:, :, rows], l_.float())
        out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1)
                           + o.float() * torch.exp(l_.float() - new).unsqueeze(-1))
        lse[:, :, rows] = new
    out = out.to(q.dtype)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
    dout = torch.ones_like(out)
    for i, j in blocks:
        rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
        g = kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                            lse[:, :, rows], i == j, scale)
        grads[0][:, :, rows] += g[0].float()
        grads[1][:, :, cols] += g[1].float()
        grads[2][:, :, cols] += g[2].float()
    return out, grads


def check_ring_kernels() -> str:
    from megazero.model.attention.block_kernels import block_kernel

    dev = device()
    cases = [("cuda_flash", torch.bfloat16), ("cuda_efficient", torch.float32)] if dev.type == "cuda" \
        else [("cpu_flash", torch.bfloat16), ("cpu_flash", torch.float32)]
    g = torch.Generator(device=dev).manual_seed(0)
    base = [torch.randn(1024, 2, heads, 128, device=dev, generator=g) for heads in (16, 4, 4)]
    ref_in = [t.double().permute(1, 2, 0, 3).requires_grad_() for t in base]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, ref_in, torch.ones_like(ref))
    out = []
    for name, dtype in cases:
        q, k, v = (t.to(dtype).permute(1, 2, 0, 3) for t in base)  # strided views, as the ring passes them
        got, grads = _blockwise_attention(q, k, v, block_kernel(name, q), chunks=4)
        worst = 0.0
        for what, a, b in [("output", got, ref)] + list(zip(("dq", "dk", "dv"), grads, ref_grads)):
            err = ((a.double() - b).abs().max() / b.abs().max()).item()
            assert err <= RING_RTOL[dtype], f"{name} {dtype}: {what} off by {err:.2e} (relative) > {RING_RTOL[dtype]}"
            worst = max(worst, err)
        out.append(f"{name} {str(dtype).split('.')[-1]} {worst:.1e}")
    return "block-merged GQA causal attention vs fp64, worst relative error: " + ", ".join(out)


def check_ring_kernels_dropout() -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.model.attention.block_kernels import block_kernel

    dev = device()
    if dev.type != "cuda":
        raise Skip("the CUDA ops' own dropout (the CPU's math kernel draws its masks: tests/model)")
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, dtype, backend in [("cuda_flash", torch.bfloat16, SDPBackend.FLASH_ATTENTION),
                                 ("cuda_efficient", torch.float32, SDPBackend.EFFICIENT_ATTENTION)]:
        q, k, v, dout = (torch.randn(2, 8, 512, 128, device=dev, generator=g, dtype=dtype) for _ in range(4))
        kernel = block_kernel(name, q, dropout=True)
        torch.cuda.manual_seed(7)
        o, lse, rng = kernel.forward(q, k, v, True, 128 ** -0.5, 0.1)
        grads = kernel.backward(dout, q, k, v, o, lse, True, 128 ** -0.5, 0.1, rng)
        ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.cuda.manual_seed(7)  # torch's SDPA, the same op from the same generator state: the same masks
        with sdpa_kernel(backend):
            ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, dropout_p=0.1, is_causal=True)
        ref_grads = torch.autograd.grad(ref, ref_in, dout)
        worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                    for a, b in [(o, ref)] + list(zip(grads, ref_grads)))
        assert worst <= RING_RTOL[dtype], \
            f"{name} with dropout vs torch's SDPA: off by {worst:.2e} > {RING_RTOL[dtype]}"
        undropped = kernel.forward(q, k, v, True, 128 ** -0.5)[0]
        assert not torch.allclose(o, undropped), f"{name}: dropout 0.1 left the output unchanged"
        out.append(f"{name} {worst:.1e}")
    return "one causal block with the kernel's own dropout vs torch's SDPA from the same generator state: " + \
        ", ".join(out)


# ---- 5b: the mixture-of-experts layer -------------------------------------------------------------

def check_moe_layer() -> str:
    from megazero.model.config import GPTConfig
    from megazero.model.moe.layer import AuxLossScale, MoELayer
    from megazero.model.init import init_methods
    from megazero.model.mlp import MLP

    dev = device()
    c = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=512, max_position_embeddings=512,
                  vocab_size=128, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512, add_bias_linear=False,
                  activation="swiglu", moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=256,
                  moe_shared_expert_gate=True, moe_expert_capacity_factor=1.25).validate()

    def build(where, grouped, padded=False):
        torch.manual_seed(0)
        cg = c.replace(moe_grouped_gemm=grouped, moe_pad_expert_input_to_capacity=padded)
        return MoELayer(cg, lambda: MLP(cg, tp_group=None, tp_size=1, expert=True), tp_group=None, tp_size=1,
                        ep_group=None, ep_size=1, ep_rank=0, aux_scale=AuxLossScale(value=1.0),
                        init_method=init_methods(cg)[0], shared=lambda: MLP(cg, tp_group=None, tp_size=1,
                                                                             expert=True, ffn_size=256)).to(where)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 2, 256, generator=g)
    grad = torch.randn(512, 2, 256, generator=g)

    def run(where, grouped, padded=False, dtype=torch.float32):
        layer = build(where, grouped, padded).to(dtype)
        xi = x.detach().to(where, dtype).requires_grad_()
        y = layer(xi)
        y.backward(grad.to(where, dtype))
        used = layer.experts.grouped(xi.detach().reshape(-1, 256))
        return (y.detach().float().cpu(), xi.grad.float().cpu(),
                {n: p.grad.float().cpu() for n, p in layer.named_parameters()}), used

    def worst(runs):
        (y0, dx0, g0) = runs[0]
        return max(((a - b).abs().max() / b.abs().max()).item() for y1, dx1, g1 in runs[1:]
                   for a, b in [(y1, y0), (dx1, dx0)] + [(g1[n], g0[n]) for n in g0 if g0[n].abs().max() > 0])

    # fp32: the device's per-expert loop and padded dispatch (fixed sizes, its slot arithmetic) vs the CPU
    fp32 = worst([run("cpu", False)[0], run(dev, False)[0], run(dev, False, padded=True)[0]])
    assert fp32 <= MOE_RTOL, f"MoE layer on {dev} vs CPU (fp32): relative difference {fp32:.2e} > {MOE_RTOL}"
    # bf16: the grouped matmuls (CUDA's kernel on Hopper/Blackwell) vs the device's per-expert loop
    loop, _ = run(dev, False, dtype=torch.bfloat16)
    grouped, used = run(dev, True, dtype=torch.bfloat16)
    bf16 = worst([loop, grouped])
    assert bf16 <= MOE_BF16_RTOL, f"grouped vs loop on {dev} (bf16): relative difference {bf16:.2e} > {MOE_BF16_RTOL}"
    what = "grouped matmuls" if used else "grouped matmuls NOT run on this device (bf16 needs compute capability 9/10)"
    return (f"router, dropping, shared expert, aux loss and the padded dispatch on {dev} vs the CPU's per-expert "
            f"loop (fp32): worst relative difference {fp32:.1e}; {what} vs the loop (bf16): {bf16:.1e}")


# ---- 7: 1.3B throughput ------------------------------------------------------------------------

def throughput_command(ngpu: int, iters: int = THROUGHPUT_ITERS) -> list[str]:
    """``pretrain_gpt.py`` on ``ngpu`` GPUs: gpt-1.3b, bf16, ZeRO-1, mock data, no evaluation."""
    flash = ["--use-flash-attn"] if _importable("flash_attn") else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ngpu),
            os.path.join(ROOT, "pretrain_gpt.py"), "--model-preset", "gpt-1.3b", "--mock-data", "--bf16",
            "--zero-stage", "1", "--micro-batch-size", "8", "--global-batch-size", str(8 * ngpu),
            "--seq-length", "2048", "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "2",
            "--log-interval", "1", "--log-throughput", "--eval-iters", "0", "--eval-interval", "0", *flash]


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def peak_tflops(name: str) -> Optional[float]:
    """The dense bf16 peak of GPU ``name``: ``$GPU_CHECK_PEAK_TFLOPS``, else training's table
    (megazero.training.meters.PEAK_TFLOPS, the one the log line's MFU uses)."""
    if os.environ.get("GPU_CHECK_PEAK_TFLOPS"):
        return float(os.environ["GPU_CHECK_PEAK_TFLOPS"])
    from megazero.training.meters import peak_tflops as training_peak

    return training_peak(name)


def parse_throughput(log: str) -> tuple[float, float]:
    """(tokens/s, TFLOP/s per rank) of the last training log line in ``log``."""
    found = re.findall(r"tokens/s: (\d+).*?TFLOP/s per rank: ([\d.]+)", log)
    if not found:
        raise AssertionError("no 'tokens/s: ... TFLOP/s per rank: ...' log line in pretrain_gpt.py's output:\n"
                             + log[-3000:])
    tokens, tflops = found[-1]
    return float(tokens), float(tflops)


def check_throughput_1p3b() -> str:
    if device().type != "cuda":
        raise Skip("the 1.3B bf16 run needs GPUs (command: " + " ".join(throughput_command(1)[3:9]) + " ...)")
    ngpu = torch.cuda.device_count()
    t0 = time.time()
    proc = subprocess.run(throughput_command(ngpu), cwd=ROOT, capture_output=True, text=True, timeout=420,
                          env={**os.environ, "PYTHONPATH": ROOT})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pretrain_gpt.py exited {proc.returncode}:\n{log[-3000:]}"
    tokens, tflops = parse_throughput(log)
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name)
    assert tokens > 0 and tflops > 0, f"tokens/s {tokens}, TFLOP/s per rank {tflops}"
    mfu = "" if peak is None else f", MFU {tflops / peak:.1%} of {peak:g} TFLOP/s"
    if peak is None:
        mfu = f" (no dense bf16 peak known for {name!r}: set GPU_CHECK_PEAK_TFLOPS)"
    return f"{ngpu} x {name}: {tokens:.0f} tokens/s, {tflops:.1f} TFLOP/s per GPU{mfu} ({time.time() - t0:.0f} s)"


# ---- 7b: a checkpoint saved in the background ---------------------------------------------------

def _iteration_gaps(metrics: str, interval: int) -> tuple[float, float]:
    """(median ms between a saving iteration and the next, median ms between the others) of a metrics file."""
    import json
    import statistics

    stamps = {}
    for line in open(metrics):
        rec = json.loads(line) if line.strip() else {}
        if "timestamp" in rec and "lm_loss" in rec:
            stamps[rec["iteration"]] = rec["timestamp"]
    gaps = {it: (stamps[it + 1] - stamps[it]) * 1e3 for it in stamps if it + 1 in stamps and it > 2}
    return (statistics.median([g for it, g in gaps.items() if it % interval == 0] or [float("nan")]),
            statistics.median([g for it, g in gaps.items() if it % interval]))


def check_async_save() -> str:
    """gpt-1.3b bf16 on the GPUs saving every 5 iterations in torch_dist: synchronous, then --async-save. The
    background save's iteration must cost less than the synchronous one's; the figures are reported."""
    if device().type != "cuda":
        raise Skip("the background-save timing needs GPUs (pinned device-to-host copies)")
    import tempfile

    ngpu, interval, out = torch.cuda.device_count(), 5, []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in (("sync", []), ("async", ["--async-save"])):
            metrics = os.path.join(tmp, f"{mode}.jsonl")
            cmd = throughput_command(ngpu, iters=16) + ["--save", os.path.join(tmp, mode), "--save-interval",
                                                        str(interval), "--ckpt-format", "torch_dist",
                                                        "--metrics-file", metrics, *extra]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420,
                                  env={**os.environ, "PYTHONPATH": ROOT})
            assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}"
            out.append(_iteration_gaps(metrics, interval))
    (sync_save, sync_other), (async_save, async_other) = out
    assert async_save < sync_save, (f"the background save's iteration took {async_save:.0f} ms, the synchronous "
                                    f"{sync_save:.0f} ms")
    return (f"{ngpu} GPU(s), gpt-1.3b torch_dist every {interval}: saving iteration {sync_save:.0f} ms sync, "
            f"{async_save:.0f} ms async; other iterations {sync_other:.0f} / {async_other:.0f} ms")


def check_muon_step() -> str:
    """Muon's optimizer step against AdamW's on the GPUs (benchmarks/bench_muon.py, ZeRO-1 over every GPU, a
    dense GPT of 4 layers at hidden 2048, 4 micro-batches of 2048 tokens): both steps run; the figures are
    reported."""
    if device().type != "cuda":
        raise Skip("the Muon step's timing is for GPUs (CPU figures: docs/benchmarks.md)")
    ngpu = torch.cuda.device_count()
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_muon.py"), "--device", "cuda", "--world",
           str(ngpu), "--hidden", "2048", "--layers", "4", "--seq", "2048", "--micro", "4", "--repeats", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}"
    ratio = next(line for line in proc.stdout.splitlines() if line.startswith("muon / adamw"))
    return f"{ngpu} GPU(s), hidden 2048 x 4 layers: {ratio}"


# ---- 8: a hang inside NCCL ---------------------------------------------------------------------

_NCCL_SETTINGS = """
import os, sys
from megazero import mpu
from megazero.mpu.parallel_state import collective_timeout
with mpu.distributed_run("nccl", 90.0):
    mpu.initialize_model_parallel(1)
    g = mpu.get_parallel_groups()
    print([collective_timeout(x).total_seconds() for x in (None, g.dp_group)],
          os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT"))
"""


def check_nccl_watchdog() -> str:
    """NCCL's groups run under the timeout (plus the grace that lets megazero's verdict come first) with
    torch's watchdog set to abort; on 2+ GPUs a rank stopped with SIGSTOP ends the run naming it."""
    if device().type != "cuda":
        raise Skip("NCCL needs CUDA")
    from megazero.mpu.distributed import NCCL_GRACE_S

    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", _NCCL_SETTINGS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    want = f"{[90.0 + NCCL_GRACE_S] * 2} 3 1"
    assert out.stdout.strip().splitlines()[-1] == want, f"{out.stdout.strip()} != {want}"
    detail = f"NCCL groups' timeout 90 s + {NCCL_GRACE_S:g} s, TORCH_NCCL_ASYNC_ERROR_HANDLING=3, dump on timeout"
    if torch.cuda.device_count() < 2:
        return detail + "; the SIGSTOP drill needs 2 GPUs (skipped)"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "pretrain_gpt.py"), "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
           "--micro-batch-size", "2", "--lr", "1e-4", "--mock-data", "--vocab-size", "512", "--train-iters",
           "100000", "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    lines, stopped_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if stopped_at is None and " iteration       20/" in line:
                pid = _child_with_rank(proc.pid, 1)
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.time()
        proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = "".join(lines)
    assert stopped_at is not None, "the run never reached iteration 20:\n" + log[-3000:]
    took = time.time() - stopped_at
    assert proc.returncode != 0 and took <= 110, f"exit {proc.returncode} after {took:.0f} s:\n{log[-3000:]}"
    assert "rank 1 (host" in log and "did not arrive" in log, log[-3000:]
    return detail + f"; a SIGSTOP'd rank on NCCL ended the run in {took:.0f} s, named"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_with_rank(parent: int, rank: int) -> int:
    """The pid of global rank ``rank`` among ``parent``'s process tree (by its RANK variable)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == str(parent):
            continue
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env) and int(stat[1]) == parent:
            return int(entry)
    raise AssertionError(f"no worker of rank {rank}")


# ---- the runner --------------------------------------------------------------------------------

CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("two_ranks_offload", check_two_ranks_offload),
    ("two_ranks_native", check_two_ranks_native),
    ("slow_collectives", check_slow_collectives),
    ("offload_bitwise", check_offload_bitwise),
    ("ring_kernels", check_ring_kernels),
    ("ring_kernels_dropout", check_ring_kernels_dropout),
    ("moe_layer", check_moe_layer),
    ("attention_backends", check_attention_backends),
    ("recurrent_kernels", check_recurrent_kernels),
    ("apex_adam", check_apex_adam),
    ("throughput_1p3b", check_throughput_1p3b),
    ("async_save", check_async_save),
    ("muon_step", check_muon_step),
    ("nccl_watchdog", check_nccl_watchdog),
]


def main(names: Optional[list[str]] = None) -> int:
    """Run the checks (all, or those ``names``); print one line each and a summary; 1 if any failed."""
    dev = device()
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device: run on a machine with a CUDA GPU and CUDA torch (or GPU_CHECK_DEVICE=cpu for "
              "a dry run)")
        return 1
    unknown = set(names or ()) - {n for n, _ in CHECKS}
    if unknown:
        print(f"FAIL unknown checks {sorted(unknown)}; known: {', '.join(n for n, _ in CHECKS)}")
        return 1
    print(f"gpu_check on {dev}: torch {torch.__version__}"
          + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if dev.type == "cuda" else ""))
    results = {}
    for name, check in CHECKS:
        if names and name not in names:
            continue
        t0 = time.time()
        try:
            detail, status = check(), "PASS"
        except Skip as e:
            detail, status = str(e), "SKIP"
        except Exception as e:  # noqa: BLE001 - an assertion or a crash: this check failed, the next runs
            detail, status = f"{type(e).__name__}: {e}", "FAIL"
            traceback.print_exc()
        results[name] = status
        print(f"{status} {name} ({time.time() - t0:.1f} s): {detail}", flush=True)
    counts = {s: sum(1 for v in results.values() if v == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or None))
