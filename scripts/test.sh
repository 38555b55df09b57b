#!/usr/bin/env bash
# Install (idempotently) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
# Two pytest workers (pytest-xdist), a test file per worker at a time so module fixtures are built once;
# MEGAZERO_TEST_WORKERS=0 runs everything in this process.
exec "$root/.venv/bin/python" -m pytest -n "${MEGAZERO_TEST_WORKERS:-2}" --dist loadfile "$@"
