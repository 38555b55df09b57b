#!/usr/bin/env bash
# Qwen3-Next-80B-A3B (Qwen, 80B parameters, 3B activated per token) at a 131072-token sequence with context
# parallelism over the hybrid stack: 48 layers, hidden 2048; every layer but each 4th is Gated DeltaNet (16 key
# heads and 32 value heads of 128, a short convolution of 4; --experimental-attention-variant gated_delta_net
# --linear-attention-freq 4), each 4th gated attention (16 query heads of 256 over 2 key/value groups, a sigmoid
# output gate, query/key RMSNorms, RoPE on a quarter of each head, theta 10^7); RMSNorm as x(1+w)
# (--apply-layernorm-1p); every layer's MLP 512 experts of 512, top-10, plus a gated shared expert of 512;
# untied embeddings, vocabulary 151936.
# Layout on 8 nodes x 8 H100s (tools/plan.py's, below): cp 8 x dp 8 without tensor parallelism, the experts over
# ep 8 inside each node (64 per rank), ZeRO-3 over dp x cp, grouped expert matmuls, bf16, full recompute. Under
# context parallelism the attention layers run the ring over zigzag chunks and the Gated DeltaNet layers pass
# their state: each rank scans its two chunks, the ranks all-gather each chunk's state summary (a 128 x 128 state
# and its 128 x 128 transition per value head), fold them in order and finish from the folded states; those
# bytes do not grow with the sequence.
#
#   DATA_PATH=/data/long_text_document TOKENIZER_MODEL=/models/Qwen3-Next-80B-A3B-Instruct \
#   CHECKPOINT_DIR=/shared/ckpt/qwen3_next NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/qwen3_next_80b_a3b.sh [extra pretrain_gpt.py flags; later flags win]
#
# Fine-tuning the released model: python tools/convert_from_hf.py --input /models/Qwen3-Next-80B-A3B-Instruct
# --output /shared/qwen3_next, then this script with --pretrained-checkpoint /shared/qwen3_next (its MTP head is
# not imported); tools/convert_to_hf.py exports back to Qwen3NextForCausalLM.
#
# Planned on a CPU for 64 x h100-80gb:
#   NNODES=8 DRY_RUN=1 bash examples/recipes/qwen3_next_80b_a3b.sh   # tools/estimate_memory.py on this layout: 79.67B
#     parameters, 70.2 GiB per GPU with NCCL (weights 2.3, gradients 4.6, optimizer 13.9, activations 32.3, gradients
#     in flight 9.2), 1,105 PFLOP a step; 158.8 GiB sent per GPU per step over context parallelism, of which the
#     Gated DeltaNet layers' state summaries and convolution halos are the same at any sequence length
#   NNODES=8 PLAN=1 bash examples/recipes/qwen3_next_80b_a3b.sh      # tools/plan.py (30208 layouts): this layout
#     26.0 s a step (31 % MFU); the fastest, pp 8 (6 chunks a rank) x cp 8 with every expert on each rank, 25.7 s;
#     the same model at tp 2 x ep 32 (experts across nodes) 58.0 s, most of it the expert all-to-all
#   NNODES=8 DRY_RUN=rehearse bash examples/recipes/qwen3_next_80b_a3b.sh --ranks 0 --micro-batches 1
#     tools/rehearse.py, rank 0 at 131072 tokens (about 90 s on two busy CPU cores): state 20.87 GiB (the plan's),
#     peak 39.9 GiB (41.6 with NCCL), 0.58 of the plan's peak (the plan counts ZeRO-3's buffers and gradients in
#     flight at their largest); the bytes sent per group are the plan's within 3 %
#
# TOKENIZER_MODEL is a Hugging Face tokenizer directory (HuggingFaceTokenizer). EP must divide the 512 experts
# and the tp x cp x dp ranks. Overrides (defaults in brackets): TP [1] CP [8] EP [8] SEQ_LENGTH [131072]
# GLOBAL_BATCH [64] TRAIN_ITERS [2000]; other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=qwen3_next_80b_a3b
VOCAB_SIZE=151936
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-8}"
SEQ_LENGTH="${SEQ_LENGTH:-131072}"

MODEL_ARGS=(
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 5120
    --num-attention-heads 16 --group-query-attention --num-query-groups 2 --kv-channels 256
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base 10000000 --rotary-percent 0.25
    --attention-output-gate --qk-layernorm
    --experimental-attention-variant gated_delta_net --linear-attention-freq 4
    --linear-num-key-heads 16 --linear-num-value-heads 32 --linear-key-head-dim 128 --linear-value-head-dim 128
    --linear-conv-kernel-dim 4
    --normalization RMSNorm --norm-epsilon 1e-6 --apply-layernorm-1p --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 512 --moe-ffn-hidden-size 512 --moe-router-topk 10
    --moe-shared-expert-intermediate-size 512 --moe-shared-expert-gate
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-1}"
    --context-parallel-size "${CP:-8}" --cp-comm-type p2p
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size "${EP:-8}" --expert-tensor-parallel-size 1
    --zero-stage 3 --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-64}"
    --train-iters "${TRAIN_ITERS:-2000}" --lr 3e-5 --min-lr 3e-6 --lr-decay-style cosine
    --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
