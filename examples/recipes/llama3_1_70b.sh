#!/usr/bin/env bash
# Llama-3.1-70B: 80 layers, hidden 8192, 64 heads with 8 key/value groups (GQA), SwiGLU MLP 28672,
# RMSNorm, RoPE theta 500000 with Llama 3.1's frequency scaling (--use-rope-scaling: factor 8, low and
# high frequency factors 1 and 4, original context 8192, Megatron-core's values), no biases, untied
# embeddings, vocabulary 128256, sequence 8192. Layout on 8 nodes x 8 GPUs: tp 8 with sequence
# parallelism x pp 4 (interleaved, 5 layers per chunk) x dp 2, ZeRO-1, bf16, selective recompute.
# Continued pre-training from Meta's weights: tools/convert_from_hf.py, then --pretrained-checkpoint.
#
#   DATA_PATH=/data/llama3_text_document TOKENIZER_MODEL=/models/Llama-3.1-70B \
#   CHECKPOINT_DIR=/shared/ckpt/llama3_1_70b NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/llama3_1_70b.sh [extra pretrain_gpt.py flags; later flags win]
#
# DRY_RUN=1 plans memory per GPU instead of launching; PLAN=1 searches the layouts. Overrides (defaults in
# brackets): TP [8] PP [4] SEQ_LENGTH [8192] MICRO_BATCH [1] GLOBAL_BATCH [512] TRAIN_ITERS [100000];
# the other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=llama3_1_70b
VOCAB_SIZE=128256
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-8}"
SEQ_LENGTH="${SEQ_LENGTH:-8192}"

MODEL_ARGS=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672
    --num-attention-heads 64 --group-query-attention --num-query-groups 8
    --seq-length "$SEQ_LENGTH" --max-position-embeddings 131072
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-8}" --sequence-parallel
    --pipeline-model-parallel-size "${PP:-4}" --num-layers-per-virtual-pipeline-stage 5
    --use-distributed-optimizer --bf16 --recompute-granularity selective
)
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-512}"
    --train-iters "${TRAIN_ITERS:-100000}" --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
