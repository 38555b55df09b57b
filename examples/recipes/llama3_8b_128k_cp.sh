#!/usr/bin/env bash
# Llama-3-8B-style model (as llama3_8b.sh) at a 131072-token sequence with context parallelism:
# each sequence is split over --context-parallel-size 8 ranks in 16 balanced chunks, attention
# passes K/V blocks around a ring (--cp-comm-type p2p, overlapped with the blocks' attention).
# Layout on 8 nodes x 8 GPUs: tp 4 with sequence parallelism x cp 8 x dp 2, ZeRO-1 over dp x cp,
# bf16, full recompute; each rank holds 16384 tokens of a sequence, a quarter of them outside
# attention. RoPE theta 8000000 for the long context (raise or keep as your schedule needs).
# Dropout stays 0, as in Llama.
#
#   DATA_PATH=/data/long_text_document TOKENIZER_MODEL=/models/Meta-Llama-3-8B \
#   CHECKPOINT_DIR=/shared/ckpt/llama3_8b_128k NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/llama3_8b_128k_cp.sh [extra pretrain_gpt.py flags; later flags win]
#
# SEQ_LENGTH, TP, CP (world = tp x cp x dp) change the layout; --cp-comm-type a2a (Ulysses) or
# a2a+p2p with --hierarchical-context-parallel-sizes are the other exchanges (docs/parallelism.md).
# DRY_RUN=1 plans memory per GPU instead of launching. Overrides (defaults in brackets): TP [4] CP [8]
#   SEQ_LENGTH [131072] GLOBAL_BATCH [32] TRAIN_ITERS [2000]; other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=llama3_8b_128k_cp
VOCAB_SIZE=128256
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-8}"
SEQ_LENGTH="${SEQ_LENGTH:-131072}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base 8000000 --no-position-embedding
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-4}" --sequence-parallel
    --context-parallel-size "${CP:-8}" --cp-comm-type p2p
    --pipeline-model-parallel-size 1 --use-distributed-optimizer --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-32}"
    --train-iters "${TRAIN_ITERS:-2000}" --lr 3e-5 --min-lr 3e-6 --lr-decay-style cosine
    --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
