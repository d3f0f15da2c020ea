"""Fixtures of the integration tier: swarms of real peers inside the test's own process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swarm.testing.inprocess import InProcessSwarm


@pytest.fixture
def inprocess_swarm(tiny_models, tmp_path) -> Iterator[Callable[..., InProcessSwarm]]:
    """Start an in-process swarm of a tiny model (``family``, the llama by default, or the folder ``model``;
    keywords: ``PeerConfig`` fields of every peer); each one started is closed at teardown, whatever the test did."""
    started: list[InProcessSwarm] = []

    def start(family: str = "llama", model: Path | None = None, **defaults) -> InProcessSwarm:
        swarm = InProcessSwarm(model or tiny_models[family], tmp_path / f"swarm{len(started)}", **defaults)
        started.append(swarm)
        return swarm.__enter__()

    try:
        yield start
    finally:
        for swarm in reversed(started):
            swarm.close()


@pytest.fixture(scope="module")
def llama_pair(tiny_models, tmp_path_factory) -> Iterator[InProcessSwarm]:
    """One in-process swarm for a module's tests: two peers splitting the tiny llama's blocks 0:2 and 2:4."""
    with InProcessSwarm(tiny_models["llama"], tmp_path_factory.mktemp("llama-pair")) as swarm:
        swarm.start_peers({"a": "0:2", "b": "2:4"})
        yield swarm
