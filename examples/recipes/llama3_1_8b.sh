#!/usr/bin/env bash
# Llama-3.1-8B: as llama3_8b.sh (32 layers, hidden 4096, 32 heads with 8 key/value groups, SwiGLU 14336,
# RMSNorm, no biases, untied, vocabulary 128256) with Llama 3.1's RoPE frequency scaling (--use-rope-scaling:
# theta 500000, factor 8, low and high frequency factors 1 and 4, original context 8192) and its context of
# 131072 positions; trained at sequence 8192. Layout: ZeRO-3 over the data-parallel ranks of 1 node x 8
# GPUs, bf16, selective recompute (torchtitan's FSDP layout); more nodes add data parallelism.
# Continued pre-training from Meta's weights: tools/convert_from_hf.py, then --pretrained-checkpoint.
#
#   DATA_PATH=/data/llama3_text_document TOKENIZER_MODEL=/models/Llama-3.1-8B \
#   CHECKPOINT_DIR=/shared/ckpt/llama3_1_8b bash examples/recipes/llama3_1_8b.sh [extra flags; later win]
#
# DRY_RUN=1 plans memory per GPU instead of launching. Overrides (defaults in brackets): TP [1] PP [1]
#   ZERO_STAGE [3] SEQ_LENGTH [8192] MICRO_BATCH [1] GLOBAL_BATCH [512] TRAIN_ITERS [100000];
#   the other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=llama3_1_8b
VOCAB_SIZE=128256
TOKENIZER_TYPE=HuggingFaceTokenizer
SEQ_LENGTH="${SEQ_LENGTH:-8192}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length "$SEQ_LENGTH" --max-position-embeddings 131072
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8
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
    --train-iters "${TRAIN_ITERS:-100000}" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
