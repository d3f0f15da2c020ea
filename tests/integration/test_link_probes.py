"""Links between real peers in this process, over hivemind P2P on loopback: each peer measures the servers of the
block after its span and announces what it measured, the client's router reads it, and ``ping`` refuses a payload
over its bound while the peer serves on."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

from swarm.client.routing import Router, RouterOptions
from swarm.net.errors import ErrorKind, RemoteError
from swarm.net.network import join_dht
from swarm.net.protocol import MAX_PING_BYTES, InfoRequest, PingRequest
from swarm.net.records import read_servers
from swarm.net.security import Identity
from swarm.net.transport import Transport

ANNOUNCED_WITHIN = 60.0  # a balance round (1 s here), a measurement (milliseconds on loopback), an announcement (5 s)


def test_peers_announce_their_links_to_their_next_hops_and_the_router_reads_them(inprocess_swarm):
    local = inprocess_swarm(balance_interval=1.0, record_ttl=15.0)
    peers = local.start_peers({"a": "0:2", "b": "2:4", "c": "2:4"})
    a, b, c = (peers[name].peer_id for name in "abc")
    model = peers["a"].daemon.spec.name
    dht = join_dht(local.initial_peers, Identity.load_or_create(None), None, client_mode=True)
    transport = Transport.for_dht(dht)
    try:
        deadline, links = time.monotonic() + ANNOUNCED_WITHIN, {}
        while set(links) != {b, c}:
            assert time.monotonic() < deadline, f"a announced links to {set(links)} only, not to {b} and {c}"
            time.sleep(1.0)
            records = read_servers(dht, model, 4)
            links = next((r.links for r in records[0] if r.peer_id == a), {})
        for link in links.values():
            assert 0 < link.rtt < 1.0, link  # loopback
            assert link.bandwidth > 1e5, link
        last = [r for block in (2, 3) for r in records[block]]
        assert last and not any(r.links for r in last)  # the last span passes its output to the client only
        router = Router(dht, transport, model, 4, RouterOptions(bytes_per_token=4 * 64))
        router.refresh()
        into = router.links.into
        assert set(into) == {b, c} and set(into[b]) == set(into[c]) == {a}
        assert all(0 < seconds < 1.0 for seconds in (into[b][a], into[c][a]))
    finally:
        RemoteExpertWorker.run_coroutine(transport.shutdown())
        dht.shutdown()


def test_ping_refuses_an_oversized_payload_and_the_peer_serves_on(inprocess_swarm):
    local = inprocess_swarm()
    peer = local.add_peer("0:4", "pinged")
    dht = join_dht(local.initial_peers, Identity.load_or_create(None), None, client_mode=True)
    transport = Transport.for_dht(dht)
    try:
        assert transport.ask(peer.peer_id, PingRequest(), 10).received == 0
        oversized = PingRequest(payload=torch.zeros(MAX_PING_BYTES + 1, dtype=torch.uint8))
        with pytest.raises(RemoteError, match=f"at most {MAX_PING_BYTES} bytes") as refused:
            transport.ask(peer.peer_id, oversized, 30)
        assert refused.value.kind == ErrorKind.TOO_LARGE
        largest = PingRequest(payload=torch.zeros(MAX_PING_BYTES, dtype=torch.uint8))
        assert transport.ask(peer.peer_id, largest, 30).received == MAX_PING_BYTES
        assert peer.alive and transport.ask(peer.peer_id, InfoRequest(), 10).state == "online"
    finally:
        RemoteExpertWorker.run_coroutine(transport.shutdown())
        dht.shutdown()
