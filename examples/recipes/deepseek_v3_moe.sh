#!/usr/bin/env bash
# DeepSeek-V3 (671B, 37B activated per token): 61 layers, hidden 7168, the first 3 dense (SwiGLU
# 18432), the other 58 each 256 routed SwiGLU experts of 2048 plus one shared expert of 2048; top-8
# routing by sigmoid scores, limited to the 4 best of 8 expert groups, weights renormalised and scaled
# by 2.5; auxiliary-loss-free balancing (a per-expert bias moved by 1e-3 per step) with a small
# sequence-wise balance loss (1e-4); RMSNorm, no biases, untied embeddings, vocabulary 129280,
# sequence 4096.
# Multi-latent attention: 128 heads, queries through a 1536-wide latent, keys and values through a
# 512-wide one, each query/key head 128 dimensions without position and 64 rotated by RoPE (the key's
# shared by the heads), values 128 wide; YaRN RoPE (factor 40 over the original 4096 positions,
# mscale 1, mscale_all_dim 1, as DeepSeek-V3's config.json).
# Multi-token prediction: one depth (--mtp-num-layers 1) predicting the token after next, its loss
# weighted 0.1 (DeepSeek-V3 used 0.3 for the first 10T tokens, then 0.1: pass
# --mtp-loss-scaling-factor 0.3 for that phase). It lives on the last pipeline stage, beside a copy of
# the embedding.
# Layout (1024 GPUs, 128 nodes x 8): tp 2 with sequence parallelism x pp 16 (3 layers on the first
# stage, 2 on the last, 4 on each other) x dp 32; the experts over ep 64 with no tensor parallelism
# (--expert-tensor-parallel-size 1), 4 experts per rank; ZeRO-1, grouped expert matmuls, bf16,
# full recompute.
#
#   DATA_PATH=/data/dsv3_text_document TOKENIZER_MODEL=/models/DeepSeek-V3 \
#   CHECKPOINT_DIR=/shared/ckpt/dsv3 NNODES=128 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/deepseek_v3_moe.sh [extra pretrain_gpt.py flags; later flags win]
#
# TOKENIZER_MODEL is a Hugging Face tokenizer directory (HuggingFaceTokenizer). DRY_RUN=1 plans each
# pipeline stage with its own layers (the first stage's 3 dense, the last stage's 2 and the MTP depth) and
# names the largest.
# Overrides (defaults in brackets): TP [2] PP [16] EP [64] GLOBAL_BATCH [4096] TRAIN_ITERS [100000];
# other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=deepseek_v3_moe
VOCAB_SIZE=129280
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-128}"

MODEL_ARGS=(
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 4096
    --position-embedding-type rope --rotary-base 10000 --no-position-embedding
    --rope-type yarn --rotary-scaling-factor 40 --yarn-original-max-position-embeddings 4096
    --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.006
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 256 --moe-ffn-hidden-size 2048 --moe-layer-freq "([0]*3+[1]*58)"
    --moe-shared-expert-intermediate-size 2048
    --moe-router-topk 8 --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5
    --moe-router-num-groups 8 --moe-router-group-topk 4
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-2}" --sequence-parallel
    --pipeline-model-parallel-size "${PP:-16}"
    --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2
    --expert-model-parallel-size "${EP:-64}" --expert-tensor-parallel-size 1
    --use-distributed-optimizer --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-4096}"
    --train-iters "${TRAIN_ITERS:-100000}" --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
