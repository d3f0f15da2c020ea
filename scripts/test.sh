#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and real multi-process swarms on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
