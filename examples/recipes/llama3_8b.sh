#!/usr/bin/env bash
# Llama-3-8B-style dense model: 32 layers, hidden 4096, 32 heads with 8 key/value groups (GQA),
# SwiGLU MLP 14336, RMSNorm, RoPE (theta 500000), no biases, untied input and output embeddings,
# vocabulary 128256, sequence 8192. Layout: ZeRO-3 over the data-parallel ranks, no tensor or
# pipeline parallelism (torchtitan's FSDP layout for this size), bf16, selective recompute.
# Defaults: 1 node x 8 GPUs; more nodes add data parallelism.
#
#   DATA_PATH=/data/llama3_text_document TOKENIZER_MODEL=/models/Meta-Llama-3-8B \
#   CHECKPOINT_DIR=/shared/ckpt/llama3_8b NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/llama3_8b.sh [extra pretrain_gpt.py flags; later flags win]
#
# TOKENIZER_MODEL is a Hugging Face tokenizer directory (HuggingFaceTokenizer); preprocess the data
# with the same one (docs/data.md). DRY_RUN=1 plans memory per GPU instead of launching.
# Overrides (defaults in brackets): TP [1] PP [1] ZERO_STAGE [3] SEQ_LENGTH [8192] MICRO_BATCH [1]
#   GLOBAL_BATCH [512] TRAIN_ITERS [250000]; the other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=llama3_8b
VOCAB_SIZE=128256
TOKENIZER_TYPE=HuggingFaceTokenizer
SEQ_LENGTH="${SEQ_LENGTH:-8192}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base 500000 --no-position-embedding
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}"
    --zero-stage "${ZERO_STAGE:-3}" --bf16 --recompute-granularity selective
)
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-512}"
    --train-iters "${TRAIN_ITERS:-250000}" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
