#!/usr/bin/env bash
# Set up (if needed) and run the local swarm demo: a tiny model trained through peer daemons on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"
