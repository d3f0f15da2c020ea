"""`swarm status` is a one-shot look a user acts on: a live peer slow to answer its first ping (a first dial through
a relay on a busy machine) shows online, not its blocks UNCOVERED; a peer that is gone still shows gone."""

from __future__ import annotations

from swarm.net.protocol import Method
from swarm.ops.status import status
from swarm.testing.faults import Action, Fault


def test_a_peer_slow_to_answer_its_first_ping_shows_online(inprocess_swarm):
    swarm = inprocess_swarm()
    peer = swarm.start_peers({"a": "0:4"})["a"]  # alone: nobody else pings it, the first ping is status's
    slow = peer.faults.arm(Fault(Action.FREEZE, Method.INFO, nth=1, freeze_for=5.0))
    table = status(swarm.initial_peers, None, None, replication=1, peers=True)
    assert slow.fired.is_set()
    assert "UNCOVERED" not in table, table
    assert f"{peer.peer_id.to_base58()[:6]}" in table and " online " in table, table


def test_a_killed_peer_shows_its_blocks_uncovered(inprocess_swarm):
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "2:4"})
    peers["b"].kill()
    table = status(swarm.initial_peers, None, None, replication=1)
    assert "UNCOVERED blocks 2-3" in table, table
