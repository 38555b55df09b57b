#!/usr/bin/env bash
# Quickstart on CPU: installs what it needs, then runs the main demo on 4 processes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/torchrun" --standalone --nproc_per_node 4 examples/tp_mlp_demo.py --tp 2
