#!/usr/bin/env bash
# One command for a CUDA machine: parity, nf4 + bf16 training of SmolLM2 through a 4-peer local swarm, and the
# 70B-shaped block benchmark, printed as one table (scripts/bench_gpu.py); `--cpu` runs it on the CPU with tiny shapes.
# It uses .venv as scripts/bootstrap.sh made it (nothing is installed when it exists), or SWARM_PYTHON: an interpreter
# that has swarm's dependencies and a CUDA build of torch (bootstrap.sh installs the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${SWARM_PYTHON:-}" ]; then
  bash scripts/bootstrap.sh
  SWARM_PYTHON=.venv/bin/python
fi
exec "$SWARM_PYTHON" scripts/bench_gpu.py "$@"
