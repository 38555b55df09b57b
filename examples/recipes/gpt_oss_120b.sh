#!/usr/bin/env bash
# gpt-oss-120b (OpenAI, 116.8B parameters, 5.1B activated per token) at a 131072-token sequence with context
# parallelism: 36 layers, hidden 2880, 64 query heads of 64 over 8 key/value groups (--kv-channels 64:
# 4096-wide attention on a 2880-wide model), biases on every linear, learned attention sinks (one logit per
# head, --softmax-type learnable); layers 1, 3, 5, ... (0-based 0, 2, 4, ...) slide over 128 keys (the query
# and the 127 before it, --window-size 127,0), the others see the whole sequence (--window-attn-skip-freq 2:
# Megatron's 1-based every second layer global, as HF's layer_types begin with sliding_attention); YaRN
# (factor 32 over the original 4096 positions, theta 150000, its correction range fractional: HF's truncate
# false); RMSNorm, untied embeddings, vocabulary 201088 (o200k_harmony). Every layer's MLP is 128 experts of
# 2880, top-4 (the softmax over the 4 chosen logits), each (up + 1) * quick_gelu(gate) after clamping at 7
# (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7).
# Layout on 8 nodes x 8 H100s: tp 2 with sequence parallelism x cp 4 (ring) x dp 8, the experts over ep 8
# without tensor parallelism (16 per rank) and sharded with every other weight by ZeRO-3 over the expert-data-
# parallel ranks, grouped expert matmuls, bf16, full recompute; each rank holds 32768 tokens of a sequence.
#
#   DATA_PATH=/data/long_text_document TOKENIZER_MODEL=/models/gpt-oss-120b \
#   CHECKPOINT_DIR=/shared/ckpt/gpt_oss_120b NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/gpt_oss_120b.sh [extra pretrain_gpt.py flags; later flags win]
#
# Fine-tuning the released model: python tools/convert_from_hf.py --input /models/gpt-oss-120b --output
# /shared/gpt_oss_120b (its MXFP4 experts dequantised to bf16), then this script with --pretrained-checkpoint
# /shared/gpt_oss_120b. The router's learned bias (megatron-core's router has one whenever biases are on,
# Megatron-LM's default; megazero has no flag for it) comes with a converted checkpoint: a run from scratch
# has none.
# tools/convert_to_hf.py exports to GptOssForCausalLM (plain bf16 experts, not MXFP4).
#
# Planned on a CPU for 64 x h100-80gb:
#   NNODES=8 DRY_RUN=1 bash examples/recipes/gpt_oss_120b.sh   # tools/estimate_memory.py on this layout: 71.3 GiB
#     per GPU with NCCL (weights 3.4, gradients 6.8, optimizer 20.4, activations 25.5, ZeRO-3 gather buffers
#     6.0, gradients in flight 7.0), 1,634 PFLOP a step
#   NNODES=8 PLAN=1 bash examples/recipes/gpt_oss_120b.sh      # tools/plan.py (40487 layouts): this layout takes
#     37.3 s a step (31.6 % MFU), 2 % behind the fastest without optimizer offload (tp 2 x cp 16 x dp 2, ep 64,
#     ZeRO-1, no recompute: 36.6 s at 74.7 GiB); the fastest of all offloads the optimizer to the host at
#     tp 4 x pp 2 x cp 8, ep 8, no recompute: 32.5 s at 75.8 GiB (--optimizer-cpu-offload).
#   NNODES=8 DRY_RUN=rehearse bash examples/recipes/gpt_oss_120b.sh --ranks 0 --micro-batches 1
#     tools/rehearse.py, rank 0 at 131072 tokens (10.5 min on two busy CPU cores): state 30.6 GiB, peak 52.8 GiB
#     (55.0 with NCCL), 0.76 of the plan's peak; the state is the plan's, the bytes sent per group within 7 % of
#     the plan's
#
# TOKENIZER_MODEL is a Hugging Face tokenizer directory (HuggingFaceTokenizer). EP must divide the 128 experts and
# the tp x cp x dp ranks. Overrides (defaults in brackets): TP [2] CP [4] EP [8] ZERO_STAGE [3] SEQ_LENGTH [131072]
# GLOBAL_BATCH [64] TRAIN_ITERS [2000]; other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=gpt_oss_120b
VOCAB_SIZE=201088
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-8}"
SEQ_LENGTH="${SEQ_LENGTH:-131072}"

MODEL_ARGS=(
    --num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32
    --yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1
    --no-yarn-correction-range-round-to-int
    --window-size 127,0 --window-attn-skip-freq 2 --softmax-type learnable
    --normalization RMSNorm --norm-epsilon 1e-5
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 128 --moe-ffn-hidden-size 2880 --moe-router-topk 4
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-2}" --sequence-parallel
    --context-parallel-size "${CP:-4}" --cp-comm-type p2p
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size "${EP:-8}" --expert-tensor-parallel-size 1
    --zero-stage "${ZERO_STAGE:-3}" --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH:-64}"
    --train-iters "${TRAIN_ITERS:-2000}" --lr 3e-5 --min-lr 3e-6 --lr-decay-style cosine
    --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
