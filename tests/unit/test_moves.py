"""Peers that decide to move at the same moment, on the same snapshot: the smallest id moves, the others give way."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peers.placement import Placement, decide_move, movers
from swarm.net.protocol import PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView

FIRST, SECOND, SETTLED_HIGH, SETTLED_LOW = (PeerID(bytes([i + 1]) * 8) for i in range(4))
PLACEMENT = Placement(num_blocks=4, span_len=2, replication=2, max_blocks=None)


def _record(peer: PeerID, state: ServerState, span: range) -> ServerRecord:
    return ServerRecord(peer, state, span.start, span.stop, 100.0)


def _view() -> SwarmView:
    """Three peers on 2:4 and one on 0:2 (replication 2): two of those on 2:4 saw it at once and both announced a
    move to 0:2 (online on 2:4, joining 0:2), as in a churn test where both then moved back."""
    announced = [
        (_record(FIRST, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(FIRST, ServerState.JOINING, range(0, 2)), range(0, 2)),
        (_record(SECOND, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(SECOND, ServerState.JOINING, range(0, 2)), range(0, 2)),
        (_record(SETTLED_HIGH, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(SETTLED_LOW, ServerState.ONLINE, range(0, 2)), range(0, 2)),
    ]
    records = {b: [r for r, blocks in announced if b in blocks] for b in range(4)}
    alive = {p: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for p in (FIRST, SECOND, SETTLED_HIGH, SETTLED_LOW)}
    return SwarmView(records, alive)


def _decision(me: PeerID) -> range | None:
    view = _view()
    later = frozenset(p for p in movers(view) if p.to_bytes() > me.to_bytes())  # as PeerDaemon._move asks
    return decide_move(view, me, range(2, 4), 100.0, PLACEMENT, later)


def test_both_movers_are_found():
    assert movers(_view()) == {FIRST, SECOND}


def test_of_two_peers_moving_at_once_the_smaller_id_moves_and_the_other_gives_way():
    assert _decision(FIRST) == range(0, 2)
    assert _decision(SECOND) is None  # 0:2 gets its second server from FIRST


def test_deciding_as_each_did_at_first_both_would_move():
    # What each saw when it decided (neither move announced yet): the reason for the check after the wait.
    view = _view()
    for me in (FIRST, SECOND):
        others = frozenset(movers(view) - {me})
        assert decide_move(view, me, range(2, 4), 100.0, PLACEMENT, others) == range(0, 2)
