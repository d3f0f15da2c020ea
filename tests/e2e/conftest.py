"""Fixtures of the end-to-end tier: local swarms of real processes on 127.0.0.1, and the network lab (namespaces the
test builds and removes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from swarm.testing.localswarm import LocalSwarm
from swarm.testing.netlab import NetLab, unavailable


@pytest.fixture(scope="session")
def llama_swarm(tiny_models, tmp_path_factory) -> Iterator[LocalSwarm]:
    """A bootstrap node and two peers splitting the tiny llama's blocks 0:2 and 2:4."""
    with LocalSwarm(tmp_path_factory.mktemp("llama-swarm")) as swarm:
        swarm.start_dht()
        swarm.start_peer(tiny_models["llama"], "0:2", name="peer-a")
        swarm.start_peer(tiny_models["llama"], "2:4", name="peer-b")
        yield swarm


@pytest.fixture
def lab() -> Iterator[NetLab]:
    """A network lab of this test's own, removed after it (also on failure); skipped where namespaces cannot be
    made (not root, no ``ip``)."""
    why_not = unavailable()  # here, not at import: collecting the fast loop must not make namespaces
    if why_not:
        pytest.skip(f"cannot build the network lab here: {why_not}")
    with NetLab() as lab:
        yield lab
