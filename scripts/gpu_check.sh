#!/usr/bin/env bash
# The acceptance check for a CUDA machine: what CPU tests cannot show, each check an assertion.
# It uses the machine's own python3 (or $PYTHON) and CUDA build of torch, from this checkout, and
# installs nothing. One GPU suffices; about 10 minutes on an H100/H200. The checks and their
# tolerances are described in scripts/gpu_check.py:
#   two ranks on cuda:0 over gloo (ZeRO-3, overlap_comm, both offloads pinned) vs the CPU, and the
#   native collectives vs the emulated; late-completing collectives bitwise equal; offload on/off
#   bitwise equal with the pinned host bytes checked; the ring's block kernels; the MoE layer; attention backends, the recurrent layers' scans and apex; a 1.3B bf16
#   throughput and MFU figure; a 1.3B torch_dist save in the background against a synchronous one; NCCL's watchdog settings, and on 2+ GPUs a SIGSTOP'd rank ending the run named.
# One PASS/FAIL/SKIP line per check and a summary; exit status 1 when any check failed.
# GPU_CHECK_DEVICE=cpu is a dry run of the script on the CPU (the checks that can run there).
# Usage: bash scripts/gpu_check.sh [CHECK ...]   (default: all; names as printed)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
