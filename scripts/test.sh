#!/usr/bin/env bash
# Install (idempotently) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
# One pytest process: most tests start 2-8 ranks, so two pytest workers on 2 cores oversubscribe them
# (measured: a two-worker run took longer than one).
exec "$root/.venv/bin/python" -m pytest "$@"
