# Sourced by the recipes in this folder (not run on its own): the cluster, data, tokenizer and
# checkpoint settings from the environment, then the launch of pretrain_gpt.py with torchrun.
# The recipe has set RECIPE (its name), VOCAB_SIZE (the model's vocabulary without data),
# TOKENIZER_TYPE, NNODES's default and the arrays MODEL_ARGS, PARALLEL_ARGS and TRAINING_ARGS
# (and MOE_ARGS for a mixture of experts); its own arguments ("$@") go last, so they win.
#
# Environment (defaults in brackets):
#   NNODES [the recipe's] NODE_RANK [0] GPUS_PER_NODE [8] MASTER_ADDR [localhost] MASTER_PORT [6000]
#                 run the same command on every node, each with its NODE_RANK
#   DATA_PATH     prefix(es) of .bin/.idx from tools/preprocess_data.py ("0.7 A 0.3 B" blends);
#                 unset: synthetic tokens (--mock-data) at the recipe's vocabulary, to try the launch
#   TOKENIZER_MODEL  the tokenizer the data was preprocessed with (with DATA_PATH)
#   CHECKPOINT_DIR [checkpoints/RECIPE]  checkpoints and metrics.jsonl; resumes from it when it holds one
#   TENSORBOARD_DIR [CHECKPOINT_DIR/tensorboard]
#   TORCHRUN [torchrun on PATH, else .venv/bin/torchrun]   the launcher
#   DRY_RUN [0]   1: plan memory and traffic per GPU for this world size (tools/estimate_memory.py), no launch;
#                 rehearse: run ranks of this launch through pretrain_gpt.py's loop on one CPU, on meta tensors
#                 (tools/rehearse.py; its --ranks and --micro-batches go after the script's name), no launch
#   PLAN [0]      1: the fastest layout that fits this world size (tools/plan.py), the recipe's own layout and
#                 micro-batch left out; GPU [h100-80gb] is the preset it plans for; no launch

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
for arg in "$@"; do
    if [[ "$arg" == -h || "$arg" == --help ]]; then  # the recipe's header, then the settings here
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        sed -n '/^# Environment/,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
    fi
done
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$ROOT/checkpoints/$RECIPE}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_DIR/tensorboard}"

if [[ -n "${DATA_PATH:-}" ]]; then
    # shellcheck disable=SC2206  # DATA_PATH may hold several words: "0.7 A 0.3 B"
    DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0
               --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    echo "$RECIPE: DATA_PATH is not set: training on synthetic tokens (--mock-data)" >&2
    DATA_ARGS=(--mock-data --vocab-size "$VOCAB_SIZE")
fi
OUTPUT_ARGS=(
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
)
ARGS=("${MODEL_ARGS[@]}" ${MOE_ARGS[@]+"${MOE_ARGS[@]}"} "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
      "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")

cd "$ROOT"
if [[ "${PLAN:-0}" == 1 ]]; then
    PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
    PLAN_ARGS=()
    skip=0
    for arg in "${TRAINING_ARGS[@]}"; do  # the micro-batch is the plan's to choose
        if (( skip )); then skip=0; elif [[ "$arg" == --micro-batch-size ]]; then skip=1; else PLAN_ARGS+=("$arg"); fi
    done
    exec "$PYTHON" tools/plan.py --world-size $((NNODES * GPUS_PER_NODE)) --gpus-per-node "$GPUS_PER_NODE" \
        --gpu "${GPU:-h100-80gb}" "${MODEL_ARGS[@]}" ${MOE_ARGS[@]+"${MOE_ARGS[@]}"} --bf16 "${PLAN_ARGS[@]}" \
        "${DATA_ARGS[@]}" "$@"
fi
if [[ "${DRY_RUN:-0}" == rehearse ]]; then
    PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
    exec "$PYTHON" tools/rehearse.py --world-size $((NNODES * GPUS_PER_NODE)) "${ARGS[@]}"
fi
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
    exec "$PYTHON" tools/estimate_memory.py --world-size $((NNODES * GPUS_PER_NODE)) "${ARGS[@]}"
fi
TORCHRUN="${TORCHRUN:-$(command -v torchrun || echo "$ROOT/.venv/bin/torchrun")}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
exec "$TORCHRUN" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    pretrain_gpt.py "${ARGS[@]}"
