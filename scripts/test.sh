#!/usr/bin/env bash
# Install what the tests need (idempotently: bash scripts/setup_env.sh test) and run the test suite.
# Other arguments go to pytest.
#   bash scripts/test.sh            every test (what CI runs)
#   bash scripts/test.sh --quick    leaves out the tests marked slow (whole-program launches; tests/conftest.py)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
bash "$root/scripts/setup_env.sh" test
venv="${MEGAZERO_VENV:-$root/.venv}"
cd "$root"
# One pytest process: most tests start 2-8 ranks, so two pytest workers on 2 cores oversubscribe them.
exec "$venv/bin/python" -m pytest ${args[@]+"${args[@]}"}
