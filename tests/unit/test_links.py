"""Links between peers: what a record may say of them, what the client makes of them, and how a peer measures its
own (against a link simulated in the event loop: a round trip, and a payload at a bandwidth)."""

from __future__ import annotations

import asyncio
import math

import pytest
from hivemind.p2p import PeerID

from peers.links import LinkProber
from swarm.client.links import link_costs
from swarm.net.errors import ErrorKind, RemoteError
from swarm.net.protocol import PingReply, PingRequest
from swarm.net.records import MAX_LINKS, Link, ServerRecord, ServerState, announcement, valid_value


def _peer(i: int) -> PeerID:
    return PeerID(bytes([i]) * 34)


def _record(i: int, links: dict[PeerID, Link], announced_at: float = 0.0) -> ServerRecord:
    return ServerRecord(_peer(i), ServerState.ONLINE, 0, 2, 100.0, links=links, announced_at=announced_at)


def test_records_carry_links_and_drop_malformed_ones():
    links = {_peer(2): Link(0.004, 2.5e7), _peer(3): Link(0.12, 1e6)}
    value = _record(1, links).to_value()
    assert valid_value(announcement([(_record(1, links), range(0, 2))], 0.0))
    assert ServerRecord.from_value(_peer(1), value).links == links
    assert "links" not in _record(1, {}).to_value() and ServerRecord.from_value(_peer(1), _record(1, {}).to_value())
    key = _peer(2).to_base58()
    malformed = [
        [],  # not a map
        {key: [0.004]},  # a number short
        {key: [0.004, 1e6, 1.0]},
        {key: {"rtt": 0.004, "bandwidth": 1e6}},
        {key: [0.0, 1e6]},  # a round trip of no time
        {key: [0.004, -1.0]},
        {key: [math.nan, 1e6]},
        {key: [0.004, math.inf]},
        {key: [True, 1e6]},
        {key: ["0.004", 1e6]},
        {"0OIl": [0.004, 1e6]},  # not base58
        {"": [0.004, 1e6]},
        {"1" * 65: [0.004, 1e6]},
        {7: [0.004, 1e6]},
        {_peer(i).to_base58(): [0.004, 1e6] for i in range(MAX_LINKS + 1)},  # more than a record may name
    ]
    for links_value in malformed:
        bad = {**value, "links": links_value}
        assert ServerRecord.from_value(_peer(1), bad) is None, links_value
        assert not valid_value({"kind": "servers", "entries": [{**bad, "blocks": [0, 2]}]}), links_value
    most = {_peer(i).to_base58(): [0.004, 1e6] for i in range(MAX_LINKS)}
    assert len(ServerRecord.from_value(_peer(1), {**value, "links": most}).links) == MAX_LINKS


def test_a_link_costs_its_half_round_trip_and_the_payload_at_its_bandwidth():
    records = [
        _record(1, {_peer(3): Link(0.1, 1e6)}, announced_at=1.0),
        _record(1, {_peer(3): Link(9.0, 1.0)}, announced_at=0.5),  # an older announcement of the same peer
        _record(2, {_peer(3): Link(0.02, 1e7), _peer(4): Link(0.2, 1e5)}),
    ]
    costs = link_costs(records, activation_bytes=1e6, hop_seconds=0.01)
    assert costs.into[_peer(3)] == {_peer(1): pytest.approx(1.05), _peer(2): pytest.approx(0.11)}
    assert costs.into[_peer(4)] == {_peer(2): pytest.approx(10.1)}
    assert costs.default == pytest.approx(1.05)  # the median measured link
    assert link_costs([_record(1, {})], 1e6, 0.01).default == 0.01  # nothing measured: every hop costs the same


class _Links:
    """A transport whose pings take a round trip, plus their payload at a bandwidth, per peer; or fail."""

    def __init__(self, links: dict[PeerID, Link], failing: set[PeerID] = frozenset()):
        self.links, self.failing, self.asked = links, failing, []

    async def aask(self, peer: PeerID, request: PingRequest, timeout: float) -> PingReply:
        self.asked.append(peer)
        if peer in self.failing:
            raise RemoteError(ErrorKind.BAD_REQUEST, "unknown method 'ping'")
        size = 0 if request.payload is None else request.payload.numel()
        await asyncio.sleep(self.links[peer].rtt + size / self.links[peer].bandwidth)
        return PingReply(size)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(prober: LinkProber, next_hops: list[PeerID]) -> None:
    async def round_() -> None:
        prober.start(next_hops)
        if prober._task is not None:
            await prober._task

    asyncio.run(round_())


def test_a_peer_measures_the_round_trip_and_bandwidth_of_its_next_hops():
    near, far = Link(0.02, 4e6), Link(0.1, 1e6)
    transport = _Links({_peer(2): near, _peer(3): far})
    prober = LinkProber(transport, payload_bytes=200_000)
    _run(prober, [_peer(2), _peer(3)])
    measured = prober.announced()
    assert set(measured) == {_peer(2), _peer(3)}
    for peer, link in ((_peer(2), near), (_peer(3), far)):
        assert link.rtt <= measured[peer].rtt < link.rtt + 0.05
        assert link.bandwidth / 2 < measured[peer].bandwidth < link.bandwidth * 1.5
    assert len(transport.asked) == 2 * (3 + 2)  # 3 empty pings and 2 payloads each, one peer after the other


def test_a_peer_measures_new_next_hops_at_once_and_the_others_every_period():
    clock = _Clock()
    link = Link(0.001, 1e9)
    transport = _Links({_peer(i): link for i in range(2, 30)}, failing={_peer(29)})
    prober = LinkProber(transport, every=30.0, max_peers=8, pings=1, payload_bytes=1000, clock=clock)
    hops = [_peer(i) for i in range(2, 14)]  # 12 next hops: 8 measured now, the 4 others in the next round
    _run(prober, hops)
    assert len(prober.announced()) == 8
    _run(prober, hops)
    assert set(prober.announced()) == set(hops)
    transport.asked.clear()
    _run(prober, hops)  # all measured, the period not over: nothing to do
    assert transport.asked == []
    clock.now = 31.0  # the period is over: the 8 measured longest ago
    _run(prober, hops)
    assert len(set(transport.asked)) == 8 and set(prober.announced()) == set(hops)
    moved = [_peer(i) for i in range(20, 30)]  # this peer's span changed: other next hops, one of which fails
    transport.asked.clear()
    _run(prober, moved)
    assert set(transport.asked) <= set(moved) and len(set(transport.asked)) == 8
    _run(prober, moved)
    assert set(prober.announced()) == set(moved) - {_peer(29)}  # the old ones forgotten, the failing one unknown
    transport.asked.clear()
    _run(prober, moved)  # the failing one is tried again next period, not every round
    assert transport.asked == []
    _run(prober, [])  # the last span: no next hop, nothing announced
    assert prober.announced() == {}


def test_a_link_too_slow_to_time_says_at_most_what_it_carried(monkeypatch):
    monkeypatch.setattr("peers.links.PING_TIMEOUT", 0.2)

    class Slow(_Links):
        async def aask(self, peer, request, timeout):
            if request.payload is not None:
                await asyncio.sleep(timeout)
                raise asyncio.TimeoutError
            return await super().aask(peer, request, timeout)

    prober = LinkProber(Slow({_peer(2): Link(0.01, 1e9)}), payload_bytes=1000)
    _run(prober, [_peer(2)])
    assert prober.announced()[_peer(2)].bandwidth == pytest.approx(1000 / 0.2)
