#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and real multi-process swarms on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The reachability tests build a NAT router in a network namespace: as root, get nftables if it is missing.
if [ "$(id -u)" = 0 ] && ! command -v nft >/dev/null && command -v apt-get >/dev/null; then
  { apt-get install -y -q nftables || { apt-get update -q && apt-get install -y -q nftables; }; } >/dev/null 2>&1 ||
    echo "could not install nftables: the NAT tests will skip" >&2
fi
# The monitor's browser test draws the page in headless chromium: as root, get it if it is missing.
if [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null &&
  command -v apt-get >/dev/null; then
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 ||
    echo "could not install chromium: the monitor's browser test will skip" >&2
fi
.venv/bin/ruff check .
# Two workers: most tests spend their time waiting on timeouts, heartbeats and other processes, so two at a time
# take ~0.6 of the time on two cores; the slow ones are handed out first (tests/conftest.py). --dist loadgroup hands
# tests out a few at a time in that order (plain `load` hands each worker a large first share of the queue).
# SWARM_TEST_WORKERS=0 runs everything in this one process.
exec .venv/bin/python -m pytest -q -rfEs --durations=50 --durations-min=5 -n "${SWARM_TEST_WORKERS:-2}" --dist loadgroup "$@"
