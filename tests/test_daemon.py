"""The two commands a user runs: `swarm dht` prints its addresses; `swarm peer` announces, serves and leaves."""

from __future__ import annotations

import signal
import time

from swarm.localswarm import LocalSwarm
from swarm.network import join_dht
from swarm.records import ServerState, read_servers
from swarm.security import Identity
from swarm.spec import load_spec


def test_dht_prints_multiaddrs_and_peer_announces_then_leaves_cleanly(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    name = load_spec(model_dir).name
    with LocalSwarm(tmp_path) as local:
        dht_process = local.start_dht()
        lines = [ln for ln in dht_process.log.read_text().splitlines() if ln.startswith("/")]
        assert lines and all(ln.startswith(("/ip4/", "/ip6/")) and "/p2p/" in ln for ln in lines)
        peer = local.start_peer(model_dir, "1:3")
        observer = join_dht(local.initial_peers, Identity.load_or_create(None), None, client_mode=True)
        try:
            servers = read_servers(observer, name, 4)
            assert [len(servers[b]) for b in range(4)] == [0, 1, 1, 0]
            assert servers[1][0].state == ServerState.ONLINE and servers[1][0].throughput > 0
            peer.signal(signal.SIGTERM)
            states = set()
            deadline = time.monotonic() + 30
            while peer.popen.poll() is None and time.monotonic() < deadline:
                states.update(r.state for r in read_servers(observer, name, 4)[1])
                time.sleep(0.2)
            assert peer.popen.wait(30) == 0
            assert ServerState.LEAVING in states, "the peer did not announce that it was leaving"
            assert "left the swarm" in peer.log.read_text()
        finally:
            observer.shutdown()
