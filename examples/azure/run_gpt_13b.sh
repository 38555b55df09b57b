#!/usr/bin/env bash
# GPT-3 13B (40 layers, hidden 5120, 40 heads, seq 2048, GPT-2 BPE vocabulary) on
# NNODES x 8 GPUs: tensor parallel 4, ZeRO-3 over the data-parallel ranks, bf16,
# flash attention, full activation recompute. Hyper-parameters follow the GPT-3 13B
# recipe of Megatron-DeepSpeed (lr 1e-4 -> 1e-6 cosine, 3B warmup tokens, 300B
# tokens, global batch 1024, init std 0.008, Adam 0.9/0.95, wd 0.1, clip 1.0,
# split 949,50,1); launch and NCCL settings follow its Azure (VMSS) examples.
#
# Run the same command on every node, with its NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.4 DATA_PATH=/data/pile_text_document \
#   TOKENIZER=/data/gpt2 SAVE_DIR=/mnt/ckpt/gpt13b bash examples/azure/run_gpt_13b.sh
#
# Two layouts (LAYOUT):
#   tp4z3    [default] tensor parallel 4 x ZeRO-3 over all the other GPUs (no pipeline)
#   tp4pp8z1 Megatron-DeepSpeed's 13B layout: tensor parallel 4 x pipeline 8 (1F1B, 5 layers
#            per stage) x ZeRO-1 over the rest; needs a multiple of 32 GPUs (4 nodes)
#
# Plan it first, on any machine (no GPU, no data needed):
#   NNODES=4 bash examples/azure/run_gpt_13b.sh --dry-run      # or DRY_RUN=1
# prints the parameter count, per-GPU memory (weights/grads/optimizer/activations),
# FLOPs per iteration, then both layouts side by side (memory per GPU by kind, pipeline
# bubble, bytes sent per GPU per step), then rehearses representative ranks of both layouts
# (tools/rehearse.py: pretrain_gpt.py's own loop on meta tensors and fake process groups, one
# CPU process, about a minute per rank; REHEARSE=0 skips it): state, peak, bytes sent per group,
# beside the plan. Exits non-zero when LAYOUT does not fit GPU_MEMORY_GB.
#
# Environment (defaults in brackets):
#   NNODES [1] NODE_RANK [0] MASTER_ADDR [localhost] MASTER_PORT [6000] GPUS_PER_NODE [8]
#   DATA_PATH   Megatron prefix(es) of .bin/.idx, e.g. "/data/pile_text_document" or "0.7 A 0.3 B"
#   TOKENIZER   directory holding gpt2-vocab.json + gpt2-merges.txt (or vocab.json + merges.txt),
#               or "VOCAB_FILE,MERGE_FILE"
#   SAVE_DIR [checkpoints/gpt_13b]  checkpoints, ds_config, metrics.jsonl, tensorboard/
#   MICRO_BATCH [2] GLOBAL_BATCH [1024] TRAIN_ITERS [143051 = 300B tokens] LR_WARMUP_ITERS [1430 = 3B tokens]
#   LAYOUT [tp4z3] TP [4] PP [per LAYOUT] ZERO_STAGE [per LAYOUT] SEQUENCE_PARALLEL [0] GPU_MEMORY_GB [80]
#   READ_GBPS_PER_RANK [1] FS_GBPS [40]  filesystem read bandwidth for the dry run's start-up estimate
#   OFFLOAD_DEVICE [none]  cpu or nvme: ZeRO-Offload of the optimizer state (as run-175b.sh's OFFLOAD_DEVICE);
#               NVME_PATH  the NVMe directory for nvme. The dry run then reports host memory per rank too.
#   OFFLOAD_PARAM_DEVICE [none]  cpu or nvme: ZeRO-Infinity's parameter offload (ZeRO-3 layouts only)
#   REHEARSE [1]  in a dry run, rehearse the ranks of both layouts (0: the plan only)
#   REHEARSE_MICRO_BATCHES [16] REHEARSE_RANKS [first/last stage x first/last DP rank]
# Extra arguments are passed on to pretrain_gpt.py (later flags win).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

DRY_RUN="${DRY_RUN:-0}"
EXTRA_ARGS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,35p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) EXTRA_ARGS+=("$arg") ;;
    esac
done

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

LAYOUT="${LAYOUT:-tp4z3}"
case "$LAYOUT" in
    tp4z3) TP="${TP:-4}"; PP="${PP:-1}"; ZERO_STAGE="${ZERO_STAGE:-3}" ;;
    tp4pp8z1) TP="${TP:-4}"; PP="${PP:-8}"; ZERO_STAGE="${ZERO_STAGE:-1}" ;;
    *) echo "error: LAYOUT must be tp4z3 or tp4pp8z1, got '$LAYOUT'" >&2; exit 2 ;;
esac
SEQUENCE_PARALLEL="${SEQUENCE_PARALLEL:-0}"
MICRO_BATCH="${MICRO_BATCH:-2}"
GLOBAL_BATCH="${GLOBAL_BATCH:-1024}"
# 300B tokens / (1024 x 2048 tokens per iteration); warmup 3B tokens, as the 13B recipe.
TRAIN_ITERS="${TRAIN_ITERS:-143051}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-1430}"
GPU_MEMORY_GB="${GPU_MEMORY_GB:-80}"
SAVE_DIR="${SAVE_DIR:-$ROOT/checkpoints/gpt_13b}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$SAVE_DIR/tensorboard}"

if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi

die() { echo "error: $*" >&2; exit 2; }

# --- data and tokenizer (placeholders are fine for a dry run: files are not opened) ---
if [[ "$DRY_RUN" == 0 ]]; then
    [[ -n "${DATA_PATH:-}" ]] || die "set DATA_PATH to the dataset prefix (PREFIX.bin/PREFIX.idx from tools/preprocess_data.py)"
    [[ -n "${TOKENIZER:-}" ]] || die "set TOKENIZER to the GPT-2 BPE directory (vocab + merges) or 'VOCAB_FILE,MERGE_FILE'"
fi
DATA_PATH="${DATA_PATH:-/data/pile_text_document}"
TOKENIZER="${TOKENIZER:-/data/gpt2}"
if [[ "$TOKENIZER" == *,* ]]; then
    VOCAB_FILE="${TOKENIZER%%,*}"; MERGE_FILE="${TOKENIZER#*,}"
elif [[ -f "$TOKENIZER/vocab.json" && ! -f "$TOKENIZER/gpt2-vocab.json" ]]; then
    VOCAB_FILE="$TOKENIZER/vocab.json"; MERGE_FILE="$TOKENIZER/merges.txt"
else
    VOCAB_FILE="$TOKENIZER/gpt2-vocab.json"; MERGE_FILE="$TOKENIZER/gpt2-merges.txt"
fi

# --- DeepSpeed-schema config: ZeRO-3 knobs (as the Azure examples); the batch/precision/clip
# values repeat the flags below and pretrain_gpt.py refuses any disagreement. ---
if [[ "$DRY_RUN" != 0 ]]; then
    CONFIG_DIR="$(mktemp -d)"; trap 'rm -rf "$CONFIG_DIR"' EXIT
else
    CONFIG_DIR="$SAVE_DIR"; mkdir -p "$CONFIG_DIR"
fi
write_ds_config() {  # ZERO_STAGE FILE: the JSON of a layout at that ZeRO stage (parameter offload: ZeRO-3 only)
    local param_device="${OFFLOAD_PARAM_DEVICE:-none}" nvme=""
    [[ "$1" == 3 ]] || param_device=none
    # (built here: a here-document drops the quotes inside ${VAR:+...})
    if [[ -n "${NVME_PATH:-}" ]]; then nvme=", \"nvme_path\": \"$NVME_PATH\""; fi
    cat > "$2" <<EOF
{
  "train_batch_size": $GLOBAL_BATCH,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH,
  "steps_per_print": 10,
  "zero_optimization": {
    "stage": $1,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": 90000000,
    "allgather_bucket_size": 500000000,
    "stage3_prefetch_bucket_size": 50000000,
    "stage3_param_persistence_threshold": 100000,
    "stage3_max_live_parameters": 3000000000,
    "offload_optimizer": {"device": "${OFFLOAD_DEVICE:-none}", "pin_memory": true$nvme},
    "offload_param": {"device": "$param_device", "pin_memory": true$nvme}
  },
  "bf16": {"enabled": true},
  "gradient_clipping": 1.0,
  "wall_clock_breakdown": false
}
EOF
}
DS_CONFIG="$CONFIG_DIR/ds_config_13b.json"
write_ds_config "$ZERO_STAGE" "$DS_CONFIG"

# The layout's flags (parallel sizes, ZeRO stage and its JSON), then the rest of the run's.
LAYOUT_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
             --zero-stage "$ZERO_STAGE" --deepspeed --deepspeed_config "$DS_CONFIG")
if [[ "$PP" == 1 ]]; then LAYOUT_ARGS+=(--no-pipeline-parallel); fi
COMMON_ARGS=(
    # model: GPT-3 13B
    --num-layers 40 --hidden-size 5120 --num-attention-heads 40
    --seq-length 2048 --max-position-embeddings 2048
    --init-method-std 0.008 --hidden-dropout 0.1 --attention-dropout 0.1
    # memory
    --bf16 --use-flash-attn
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    # batch, schedule, optimizer
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS" --lr-decay-iters "$TRAIN_ITERS" --lr-warmup-iters "$LR_WARMUP_ITERS"
    --lr 1.0e-4 --min-lr 1.0e-6 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
    --seed 1234
    # data
    --data-path $DATA_PATH --split 949,50,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    # checkpoints and logging
    --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 40
    --tensorboard-dir "$TENSORBOARD_DIR"
)
if [[ "$SEQUENCE_PARALLEL" == 1 ]]; then COMMON_ARGS+=(--sequence-parallel); fi
COMMON_ARGS+=("${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}")
ARGS=("${LAYOUT_ARGS[@]}" "${COMMON_ARGS[@]}")

if [[ "$DRY_RUN" == 1 ]]; then
    echo "dry run: $NNODES node(s) x $GPUS_PER_NODE GPUs = $WORLD_SIZE GPUs, layout $LAYOUT: tp $TP x pp $PP, ZeRO-$ZERO_STAGE, GPU memory ${GPU_MEMORY_GB} GiB"
    # Same arguments as the real launch, validated as pretrain_gpt.py would (minus file checks).
    # (not exec: the EXIT trap removes the temporary ds_config)
    rc=0
    "$PYTHON" "$ROOT/tools/estimate_memory.py" --world-size "$WORLD_SIZE" --device-memory-gb "$GPU_MEMORY_GB" \
        "${ARGS[@]}" || rc=$?
    # Time to first step: per-rank bytes read at resume and values drawn at a fresh start.
    "$PYTHON" "$ROOT/tools/estimate_startup.py" --world-size "$WORLD_SIZE" \
        --read-gbps-per-rank "${READ_GBPS_PER_RANK:-1}" --fs-gbps "${FS_GBPS:-40}" \
        "${ARGS[@]}" >&2 || true
    # The two layouts side by side, on this many GPUs (or 32, the least tp 4 x pp 8 needs): the same
    # arguments, each layout with its own parallel flags and JSON (later flags win).
    CMP_WORLD=$(( WORLD_SIZE % 32 == 0 ? WORLD_SIZE : 32 ))
    echo "layouts compared on $CMP_WORLD GPUs (global batch $GLOBAL_BATCH, micro batch $MICRO_BATCH):"
    write_ds_config 3 "$CONFIG_DIR/ds_config_tp4z3.json"
    write_ds_config 1 "$CONFIG_DIR/ds_config_tp4pp8z1.json"
    "$PYTHON" "$ROOT/tools/estimate_memory.py" --world-size "$CMP_WORLD" --device-memory-gb "$GPU_MEMORY_GB" \
        "${COMMON_ARGS[@]}" --compare \
        "tp4z3:--tp 4 --pp 1 --no-pipeline-parallel --zero-stage 3 --deepspeed_config $CONFIG_DIR/ds_config_tp4z3.json" \
        "tp4pp8z1:--tp 4 --pp 8 --zero-stage 1 --deepspeed_config $CONFIG_DIR/ds_config_tp4pp8z1.json" || true
    if [[ "${REHEARSE:-1}" == 1 ]]; then
        for layout in tp4z3 tp4pp8z1; do
            echo "rehearsal of $layout on $CMP_WORLD GPUs, beside the plan:"
            LAYOUT="$layout" NNODES=$(( CMP_WORLD / GPUS_PER_NODE )) DRY_RUN=rehearse \
                bash "${BASH_SOURCE[0]}" "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}" || true
        done
    fi
    exit "$rc"
fi
if [[ "$DRY_RUN" == rehearse ]]; then
    # Representative ranks (first/last pipeline stage x first/last DP rank) of this launch, run by the
    # real loop for two iterations on meta tensors; nothing is allocated, no data is read.
    # (not exec: the EXIT trap removes the temporary ds_config)
    rc=0
    # 16 micro-batches per iteration: twice what a stage of tp4pp8z1 holds in flight (the same peak
    # as the global batch's, in a minute per rank; bytes sent are for those 16).
    "$PYTHON" "$ROOT/tools/rehearse.py" --world-size "$WORLD_SIZE" --device-memory-gb "$GPU_MEMORY_GB" \
        --micro-batches "${REHEARSE_MICRO_BATCHES:-16}" ${REHEARSE_RANKS:+--ranks "$REHEARSE_RANKS"} \
        -- "${ARGS[@]}" || rc=$?
    exit "$rc"
fi

# --- Azure ND A100 v4 / ND H100 v5 networking (InfiniBand, GPUDirect RDMA) ---
# NCCL talks to the IB HCAs directly (verbs); eth0 is only for bootstrap sockets.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-eth0}"
# Relaxed PCIe ordering is what the Azure HPC images are tuned for; it roughly
# doubles IB bandwidth on NDv4 (needs NCCL >= 2.12).
export NCCL_IB_PCI_RELAXED_ORDERING="${NCCL_IB_PCI_RELAXED_ORDERING:-1}"
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # GPU ids match the topology file's PCI order
# The Azure HPC images ship the VM's PCIe/NUMA topology; without it NCCL guesses wrong
# and can lose half the bandwidth. (/etc/nccl.conf may already set this.)
for topo in /opt/microsoft/ndv5-topo.xml /opt/microsoft/ndv4-topo.xml; do
    if [[ -z "${NCCL_TOPO_FILE:-}" && -f "$topo" ]]; then export NCCL_TOPO_FILE="$topo"; fi
done
# UCX is only used if an MPI launcher is involved: keep it on TCP over eth0 with relaxed
# ordering, as Azure's NCCL-test recipes do; torchrun itself does not need UCX.
export UCX_IB_PCI_RELAXED_ORDERING=on UCX_TLS=tcp UCX_NET_DEVICES="${UCX_NET_DEVICES:-eth0}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"  # INFO shows the chosen transports (NET/IB) when debugging
# One hardware queue keeps TP communication kernels ordered before the compute that needs them.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

mkdir -p "$SAVE_DIR" "$TENSORBOARD_DIR"
cd "$ROOT"
if [[ -x "$ROOT/.venv/bin/torchrun" ]]; then TORCHRUN="$ROOT/.venv/bin/torchrun"; else TORCHRUN=torchrun; fi
exec "$TORCHRUN" \
    --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
    pretrain_gpt.py "${ARGS[@]}"
