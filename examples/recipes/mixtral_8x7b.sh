#!/usr/bin/env bash
# Mixtral-8x7B-style mixture of experts: 32 layers, hidden 4096, 32 heads with 8 key/value groups,
# every layer's MLP 8 SwiGLU experts of 14336, top-2 dropless routing (softmax over the top two) with
# a load-balancing loss of 0.01, RMSNorm, RoPE (theta 1000000), no biases, untied embeddings,
# vocabulary 32000, sequence 4096. Layout (Megatron-LM's examples/mixtral on 8 nodes x 8 GPUs):
# pipeline 4 x expert parallel 8 (tokens reach their experts by all-to-all) x dp 16, ZeRO-1,
# grouped expert matmuls, bf16.
#
#   DATA_PATH=/data/mixtral_text_document TOKENIZER_MODEL=/models/Mixtral-8x7B/tokenizer.model \
#   CHECKPOINT_DIR=/shared/ckpt/mixtral NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/mixtral_8x7b.sh [extra pretrain_gpt.py flags; later flags win]
#
# TOKENIZER_MODEL is Mixtral's SentencePiece model (Llama2Tokenizer). EP must divide the 8 experts
# and the ranks of a pipeline stage. DRY_RUN=1 plans memory per GPU instead of launching.
# Overrides (defaults in brackets): TP [1] PP [4] EP [8] GLOBAL_BATCH [256] TRAIN_ITERS [500000]; other
# settings: examples/recipes/common.sh. tools/convert_to_hf.py exports to MixtralForCausalLM.
set -euo pipefail
RECIPE=mixtral_8x7b
VOCAB_SIZE=32000
TOKENIZER_TYPE=Llama2Tokenizer
NNODES="${NNODES:-8}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 32768
    --position-embedding-type rope --rotary-base 1000000 --no-position-embedding
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-4}"
    --expert-model-parallel-size "${EP:-8}" --use-distributed-optimizer --bf16
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-256}"
    --train-iters "${TRAIN_ITERS:-500000}" --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
    --lr-decay-iters 320000 --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
