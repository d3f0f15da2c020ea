"""Fixtures of the integration tier: swarms of real peers inside the test's own process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from swarm.testing.inprocess import InProcessSwarm


@pytest.fixture
def inprocess_swarm(tiny_models, tmp_path) -> Iterator[Callable[..., InProcessSwarm]]:
    """Start an in-process swarm of the tiny llama (keywords: ``PeerConfig`` fields of every peer); each one
    started is closed at teardown, whatever the test did."""
    started: list[InProcessSwarm] = []

    def start(**defaults) -> InProcessSwarm:
        swarm = InProcessSwarm(tiny_models["llama"], tmp_path / f"swarm{len(started)}", **defaults)
        started.append(swarm)
        return swarm.__enter__()

    try:
        yield start
    finally:
        for swarm in reversed(started):
            swarm.close()
