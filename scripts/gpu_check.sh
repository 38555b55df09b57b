#!/usr/bin/env bash
# The acceptance check for a CUDA machine: what CPU tests cannot show, run on the GPUs.
# It uses the machine's own python3 and CUDA build of torch, from this checkout, and installs nothing:
#   1. CUDA numerics: SDPA vs math attention in bf16, flash-attn when importable, and three
#      training steps of a tiny GPT on the GPU against the CPU;
#   2. the CUDA paths: the optimizer kernel chosen (apex FusedAdam or its torch fallback, with the
#      reason) and an exact save/resume of its step count on the GPU; apex's fused norms or torch's;
#      the loader's pinned batch and non_blocking copy (to_device); the RNG tracker forking the CUDA
#      and the CPU generator in one process; the local rank resolved;
#   3. pretrain_gpt.py on NCCL with ZeRO-3 and bf16 on every visible GPU, mock data,
#      printing tokens/s and TFLOP/s per GPU (compare with the GPU's dense bf16 peak).
# GPU_CHECK_DEVICE=cpu runs step 2 on the CPU (a dry run of the script itself).
# Usage: bash scripts/gpu_check.sh [PRESET] [ITERS]   (defaults: gpt-350m, 30)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
preset="${1:-gpt-350m}"
iters="${2:-30}"
python3 - <<'PY'
import torch
from megazero.model import GPTConfig, GPTModel
from megazero.model.attention import core_attention, flash_attn_available

assert torch.cuda.is_available(), "no CUDA device: this check needs a machine with a CUDA GPU"
print("torch", torch.__version__, "|", torch.cuda.get_device_name(), "| flash-attn:", flash_attn_available())
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1024, 2, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
ref = core_attention(q.float(), k.float(), v.float(), backend="math")
for backend in ["sdpa", "math"] + (["flash"] if flash_attn_available() else []):
    out = core_attention(q, k, v, backend=backend).float()
    print(f"attention {backend:5s} bf16 vs fp32 math: max |diff| {(out - ref).abs().max().item():.3e}")

cfg = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=128,
                max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
tokens = torch.randint(0, 1000, (4, 129), generator=torch.Generator().manual_seed(1))
losses = {}
for device in ("cpu", "cuda"):
    torch.manual_seed(0)
    model = GPTModel(cfg, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = tokens.to(device)
        loss = model(x[:, :-1], labels=x[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    losses[device] = loss.item()
print(f"tiny GPT, 3 AdamW steps: loss cpu {losses['cpu']:.6f} cuda {losses['cuda']:.6f} "
      f"(|diff| {abs(losses['cpu'] - losses['cuda']):.2e})")
PY
python3 - <<'PY'
import os
import tempfile

import torch
import torch.nn.functional as F
from megazero import mpu, zero
from megazero.data import build_pretraining_data_loader, to_device
from megazero.model import GPTConfig, GPTModel, norms
from megazero.mpu.distributed import resolve_local_rank
from megazero.zero.checkpoint import load_zero_state, save_zero_state
from megazero.zero.optim import optimizer_step

dev = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))
print("local rank:", resolve_local_rank(os.environ, torch.cuda.device_count()), "of",
      torch.cuda.device_count(), "visible GPUs")

# Optimizer kernel and its step count: 3 steps, save, resume in a fresh engine, 2 steps == 5 straight steps.
cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
data = torch.randint(0, 256, (5, 4, 33), generator=torch.Generator().manual_seed(0))


def engine(seed):
    torch.manual_seed(seed)
    return zero.initialize(GPTModel(cfg, device="meta"), ds, device=dev)


def train(e, steps):
    for s in steps:
        x = to_device(data[s], dev)
        e.backward(e(x[:, :-1], labels=x[:, 1:]).mean())
        e.step()
    return e.consolidated_state_dict()


with tempfile.TemporaryDirectory() as d:
    a = engine(0)
    train(a, range(3))
    save_zero_state(a, d)
    want = train(a, range(3, 5))
    b = engine(1)
    load_zero_state(b, d)
    resumed_at = optimizer_step(b.optimizer)
    got = train(b, range(3, 5))
diff = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
kernel = type(b.optimizer)
print(f"optimizer {kernel.__module__}.{kernel.__name__}: resumed at step {resumed_at} (want 3), "
      f"max |resumed - uninterrupted| {diff:.2e}")
assert resumed_at == 3 and diff < 1e-4, "optimizer step count not restored"

ln = norms.LayerNorm(1024, sequence_parallel=False, tp_group=None, params_dtype=torch.bfloat16, device=dev)
ln.reset_parameters()
x = torch.randn(8, 1024, device=dev, dtype=torch.bfloat16)
ref = F.layer_norm(x.float(), (1024,), ln.weight.float(), ln.bias.float(), ln.eps)
print("norms:", "apex fused" if ln._fused is not None else "torch",
      f"| LayerNorm bf16 vs fp32: max |diff| {(ln(x).float() - ref).abs().max().item():.3e}")

loader = build_pretraining_data_loader([{"text": list(range(33))}] * 8, 0, 4, 0, 1, device=dev)
batch = next(iter(loader))["text"]
moved = to_device(batch, dev)
if dev.type == "cuda":
    torch.cuda.synchronize()
print(f"loader batch pinned: {batch.is_pinned()} | to_device -> {moved.device}, equal: {torch.equal(moved.cpu(), batch)}")
assert batch.is_pinned() == (dev.type == "cuda") and torch.equal(moved.cpu(), batch)


def masks():
    mpu.model_parallel_manual_seed(5, tp_rank=0)
    out = []
    for device in (dev, torch.device("cpu")):
        with mpu.get_rng_tracker().fork(device=device):
            out.append(F.dropout(torch.ones(4096, device=device), 0.5))
    return out


first, again = masks(), masks()
assert all(torch.equal(p, q) for p, q in zip(first, again))
print(f"rng tracker: seeded for {mpu.get_rng_tracker().device_type}; {dev.type} and cpu forks reproducible")
PY
ngpu="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
flash=()
python3 -c 'import flash_attn' 2>/dev/null && flash=(--use-flash-attn)
python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" pretrain_gpt.py \
  --model-preset "$preset" --mock-data --bf16 --zero-stage 3 --tp 1 \
  --micro-batch-size 8 --global-batch-size $((8 * ngpu)) --seq-length 2048 \
  --train-iters "$iters" --lr 1e-4 --lr-warmup-iters 2 --log-interval 10 --eval-interval 0 "${flash[@]}"
