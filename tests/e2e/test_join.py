"""A peer started before its bootstrap node (a machine rebooted, the swarm's first node still loading) keeps trying
the initial peers, says so once, and serves once the bootstrap answers; it does not exit."""

from __future__ import annotations

import socket
from pathlib import Path

from swarm.net.security import Identity
from swarm.testing.localswarm import LocalSwarm


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_peer_started_before_its_bootstrap_node_joins_once_the_node_is_up(tiny_models, tmp_path: Path):
    key = tmp_path / "bootstrap.key"
    bootstrap = Identity.load_or_create(key).peer_id.to_base58()
    port = free_port()
    with LocalSwarm(tmp_path / "logs") as local:
        local.initial_peers = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{bootstrap}"]
        peer = local.start_peer(tiny_models["llama"], "0:4", "early", ["--join-timeout", "120"], wait=False)
        peer.wait_for_line("none of the initial peers answered yet; trying again", 120)
        local.start_dht(["--port", str(port), "--identity", str(key)])
        peer.wait_for_line("serving blocks", 180)
        assert peer.log.read_text().count("trying again") == 1, "the retries were said more than once"
