#!/usr/bin/env bash
# The prepared GPU check, for a session that is lent a CUDA machine (the device tool).
# It uses that machine's own python3 and CUDA build of torch and installs nothing:
#   1. CUDA numerics: SDPA vs math attention in bf16, flash-attn when importable, and one
#      training step of the tiny GPT on the GPU against the CPU;
#   2. pretrain_gpt.py on NCCL with ZeRO-3 and bf16 on every visible GPU, mock data,
#      printing tokens/s and TFLOP/s per GPU (compare with the H200's ~990 dense bf16 peak).
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

assert torch.cuda.is_available(), "no CUDA device: run this on the lent GPU machine"
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
ngpu="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
flash=()
python3 -c 'import flash_attn' 2>/dev/null && flash=(--use-flash-attn)
python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" pretrain_gpt.py \
  --model-preset "$preset" --mock-data --bf16 --zero-stage 3 --tp 1 \
  --micro-batch-size 8 --global-batch-size $((8 * ngpu)) --seq-length 2048 \
  --train-iters "$iters" --lr 1e-4 --lr-warmup-iters 2 --log-interval 10 --eval-interval 0 "${flash[@]}"
