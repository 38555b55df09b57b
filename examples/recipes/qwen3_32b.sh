#!/usr/bin/env bash
# Qwen3-32B: 64 layers, hidden 5120, 64 query heads of 128 (--kv-channels 128: 8192 wide, not hidden / heads)
# with 8 key/value groups, an RMSNorm over each query and key head before RoPE (--qk-layernorm), SwiGLU MLP
# 25600, RMSNorm (eps 1e-6), RoPE theta 1000000, no biases, untied embeddings, vocabulary 151936, sequence
# 32768. Layout on 4 nodes x 8 GPUs: tp 8 with sequence parallelism x pp 2 x dp 2, ZeRO-1, bf16, selective
# recompute. Continued pre-training from Qwen's weights: tools/convert_from_hf.py, then
# --pretrained-checkpoint.
#
#   DATA_PATH=/data/qwen_text_document TOKENIZER_MODEL=/models/Qwen3-32B \
#   CHECKPOINT_DIR=/shared/ckpt/qwen3_32b NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/qwen3_32b.sh [extra pretrain_gpt.py flags; later flags win]
#
# DRY_RUN=1 plans memory per GPU instead of launching. Overrides (defaults in brackets): TP [8] PP [2]
#   SEQ_LENGTH [32768] MICRO_BATCH [1] GLOBAL_BATCH [256] TRAIN_ITERS [50000]; other settings: common.sh.
set -euo pipefail
RECIPE=qwen3_32b
VOCAB_SIZE=151936
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-4}"
SEQ_LENGTH="${SEQ_LENGTH:-32768}"

MODEL_ARGS=(
    --num-layers 64 --hidden-size 5120 --ffn-hidden-size 25600
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm
    --seq-length "$SEQ_LENGTH" --max-position-embeddings 40960
    --position-embedding-type rope --rotary-base 1000000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-8}" --sequence-parallel
    --pipeline-model-parallel-size "${PP:-2}"
    --use-distributed-optimizer --bf16 --recompute-granularity selective
)
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-256}"
    --train-iters "${TRAIN_ITERS:-50000}" --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
    --lr-warmup-iters 1000 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
