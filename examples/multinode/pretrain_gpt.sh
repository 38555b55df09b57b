#!/usr/bin/env bash
# Multi-node pretrain_gpt.py with plain torchrun: run this same script on every node.
#
#   # on each of the NNODES nodes (any order; node 0's address is the rendezvous endpoint):
#   NNODES=2 MASTER_ADDR=node0.example.org DATA_PATH=/data/corpus_text_document \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt SAVE_DIR=/shared/ckpt/run1 \
#   bash examples/multinode/pretrain_gpt.sh [extra pretrain_gpt.py flags; later flags win]
#
# torchrun's c10d rendezvous runs on MASTER_ADDR:MASTER_PORT (the first node to arrive hosts it):
# every node must reach that port, and all nodes must agree on NNODES, GPUS_PER_NODE and RDZV_ID.
# Node ranks are assigned by the rendezvous; no NODE_RANK is needed. For a static rendezvous instead,
# replace the --rdzv_* flags below by --node_rank N --master_addr ADDR --master_port PORT.
#
# Adapt to your cluster:
#   - SAVE_DIR must be on a filesystem every node sees (checkpoints are written by every rank);
#   - DATA_PATH likewise (or a copy at the same path on every node);
#   - network: NCCL picks the interface and transport itself; if a node has several interfaces, set
#     NCCL_SOCKET_IFNAME (and the transport settings your cluster documents) before running;
#   - GPUS_PER_NODE, the model, the layout and the batch below.
# Environment (defaults in brackets):
#   NNODES [1] GPUS_PER_NODE [8] MASTER_ADDR [localhost] MASTER_PORT [29500] RDZV_ID [megazero]
#   MODEL_PRESET [gpt-1.3b] SEQ_LENGTH [2048] TP [2] PP [1] ZERO_STAGE [3]
#   MICRO_BATCH [2] GLOBAL_BATCH [256] TRAIN_ITERS [10000] LR [2e-4]
#   DATA_PATH   prefix(es) of .bin/.idx from tools/preprocess_data.py ("0.7 A 0.3 B" blends);
#               unset: synthetic tokens (--mock-data), to try the launch itself
#   VOCAB_FILE, MERGE_FILE  GPT-2 BPE files (with DATA_PATH)
#   SAVE_DIR [checkpoints/multinode]   checkpoints and metrics.jsonl; resumes from it when it holds one
#   DRY_RUN [0]   1: only check the arguments for this world size (tools/estimate_memory.py), no launch
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-megazero}"
SAVE_DIR="${SAVE_DIR:-$ROOT/checkpoints/multinode}"

ARGS=(
    --model-preset "${MODEL_PRESET:-gpt-1.3b}" --seq-length "${SEQ_LENGTH:-2048}"
    --max-position-embeddings "${SEQ_LENGTH:-2048}"
    --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-1}"
    --zero-stage "${ZERO_STAGE:-3}" --bf16
    --micro-batch-size "${MICRO_BATCH:-2}" --global-batch-size "${GLOBAL_BATCH:-256}"
    --train-iters "${TRAIN_ITERS:-10000}" --lr "${LR:-2e-4}" --min-lr 2e-5 --lr-decay-style cosine
    --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
    --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
)
if [[ -n "${DATA_PATH:-}" ]]; then
    # shellcheck disable=SC2206  # DATA_PATH may hold several words: "0.7 A 0.3 B"
    ARGS+=(--data-path $DATA_PATH --split 969,30,1
           --tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}"
           --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
    echo "DATA_PATH is not set: training on synthetic tokens (--mock-data)" >&2
    ARGS+=(--mock-data)
fi
ARGS+=("$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
    exec "$PYTHON" tools/estimate_memory.py --world-size $((NNODES * GPUS_PER_NODE)) "${ARGS[@]}"
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
exec "${TORCHRUN:-torchrun}" \
    --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
    pretrain_gpt.py "${ARGS[@]}"
