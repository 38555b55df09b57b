#!/usr/bin/env bash
# Nemotron-H-56B-style hybrid (NVIDIA, 2025): 118 layers, each one block with its own norm and residual, as
# Megatron-LM's pretrain_mamba.py lays them out from --hybrid-attention-ratio 0.085 --hybrid-mlp-ratio 0.458
# (megatron-core's allocate_layers: 54 Mamba-2, 10 attention and 54 MLP layers, the attention spread evenly;
# give --hybrid-layer-pattern to place them yourself). Hidden 8192; Mamba-2 with 256 heads of 64, a state of 256
# per channel and 8 groups; attention 64 heads of 128 over 8 key/value groups, no position embedding (the Mamba
# layers carry order); MLPs of 32768 with squared ReLU; RMSNorm, untied embeddings, vocabulary 131072.
# Layout on 16 nodes x 8 H100s (tools/plan.py's choice without offload): tp 2 with sequence parallelism x dp 64,
# ZeRO-3 over dp, full recompute, 3 sequences of 8192 per micro-batch, bf16. Mamba-2's groups (8) bound tp at 8:
# each rank holds whole groups.
#
#   DATA_PATH=/data/text_document TOKENIZER_MODEL=/models/Nemotron-H-56B-Base-8K \
#   CHECKPOINT_DIR=/shared/ckpt/nemotron_h_56b NNODES=16 NODE_RANK=0 MASTER_ADDR=node0 \
#   bash examples/recipes/nemotron_h_56b.sh [extra pretrain_gpt.py flags; later flags win]
#
# Planned on a CPU for 128 x h100-80gb:
#   NNODES=16 DRY_RUN=1 bash examples/recipes/nemotron_h_56b.sh   # tools/estimate_memory.py on this layout: 56.32B
#     parameters, 62.6 GiB per GPU with NCCL (weights 0.8, gradients 1.6, optimizer 4.9, activations 49.6),
#     2,864 PFLOP a step with the recompute
#   NNODES=16 PLAN=1 bash examples/recipes/nemotron_h_56b.sh      # tools/plan.py (4705 layouts): this layout,
#     45.5 s a step (37 % MFU) at 62.6 GiB; with the optimizer offloaded and 4 sequences a micro-batch 45.4 s
#   NNODES=16 DRY_RUN=rehearse bash examples/recipes/nemotron_h_56b.sh --ranks 0 --micro-batches 1
#     tools/rehearse.py, rank 0 (10 s on two busy CPU cores): state 7.39 GiB (the plan's), peak 53.8 GiB (54.9 with
#     NCCL), 0.87 of the plan's peak, reached in the SSD scan; the bytes sent per group equal the plan's
#
# Overrides (defaults in brackets): TP [2] PP [1] SEQ_LENGTH [8192] GLOBAL_BATCH [768] TRAIN_ITERS [10000];
# other settings: examples/recipes/common.sh.
set -euo pipefail
RECIPE=nemotron_h_56b
VOCAB_SIZE=131072
TOKENIZER_TYPE=HuggingFaceTokenizer
NNODES="${NNODES:-16}"
SEQ_LENGTH="${SEQ_LENGTH:-8192}"

MODEL_ARGS=(
    --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
    --num-layers 118 --hybrid-attention-ratio 0.085 --hybrid-mlp-ratio 0.458
    --hidden-size 8192 --ffn-hidden-size 32768 --num-attention-heads 64 --group-query-attention
    --num-query-groups 8 --kv-channels 128
    --mamba-num-heads 256 --mamba-head-dim 64 --mamba-state-dim 256 --mamba-num-groups 8
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" --position-embedding-type none
    --normalization RMSNorm --norm-epsilon 1e-5 --squared-relu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-2}" --sequence-parallel
    --pipeline-model-parallel-size "${PP:-1}" --zero-stage 3 --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
TRAINING_ARGS=(
    --micro-batch-size 3 --global-batch-size "${GLOBAL_BATCH:-768}"
    --train-iters "${TRAIN_ITERS:-10000}" --lr 4.5e-4 --min-lr 4.5e-6 --lr-decay-style cosine
    --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
