"""Issue 56: a peer told its span (``--blocks``) holds still. It grows over its span only to serve blocks no other
live peer serves, goes back once they have a server, and never moves for replicas or throughput; self-placing peers
count it where it is and never plan its move. Every move carries the rule that made it, in words."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peers.placement import Placement, decide_move, home_move, settled_spans
from swarm.net.protocol import PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView

A, B, C, D = (PeerID(bytes([i + 1]) * 8) for i in range(4))


def _view(spans: dict[PeerID, range], homes: dict[PeerID, range], num_blocks: int, dead: frozenset = frozenset()):
    records = {
        b: [
            ServerRecord(p, ServerState.ONLINE, span.start, span.stop, 100.0, home=homes.get(p))
            for p, span in spans.items()
            if b in span
        ]
        for b in range(num_blocks)
    }
    alive = {p: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for p in spans if p not in dead}
    return SwarmView(records, alive)


def test_two_told_spans_that_cover_the_model_never_move():
    view = _view({A: range(0, 15), B: range(15, 30)}, {A: range(0, 15), B: range(15, 30)}, 30)
    for me, span in ((A, range(0, 15)), (B, range(15, 30))):
        placement = Placement(30, 15, 2, max_blocks=30, home=span)
        assert decide_move(view, me, span, 100.0, placement) is None  # the deficit of 30 is the operator's choice


def test_a_told_peer_grows_over_an_orphan_and_goes_back_once_it_is_served():
    home = range(0, 15)
    placement = Placement(30, 15, 2, max_blocks=30, home=home)
    gone = _view({A: home, B: range(15, 30)}, {A: home, B: range(15, 30)}, 30, dead=frozenset({B}))
    move = decide_move(gone, A, home, 100.0, placement)
    assert move is not None and move.target == range(0, 30) and move.covers == tuple(range(15, 30))
    assert "no other live server" in move.reason
    back = _view({A: range(0, 30), B: range(15, 30)}, {A: home, B: range(15, 30)}, 30)
    move = decide_move(back, A, range(0, 30), 100.0, placement)
    assert move is not None and move.target == home and move.covers == ()
    assert "back to its --blocks 0:15" in move.reason
    assert decide_move(back, A, home, 100.0, placement) is None  # and stays there: one move back, once


def test_a_told_peer_covers_orphans_with_as_few_blocks_as_it_can():
    others = [1] * 10 + [0] * 4 + [1] * 16  # blocks 10:14 orphaned; every other block has another server
    assert home_move(others, 30, range(0, 10), range(0, 10), max_blocks=20) == range(4, 14)  # 0:4 keep a server
    assert home_move(others, 30, range(14, 20), range(14, 20), max_blocks=10) == range(10, 16)
    alone = [0] * 10 + [0] * 4 + [1] * 16  # its own blocks have no other server: it grows, if it has room
    assert home_move(alone, 30, range(0, 10), range(0, 10), max_blocks=20) == range(0, 14)
    assert home_move(alone, 30, range(0, 10), range(0, 10), max_blocks=10) is None


def test_a_told_peer_goes_back_as_far_as_the_swarm_lets_it():
    others = [1] * 15 + [0] * 5 + [1] * 10  # blocks 15:20 still have no other server
    assert home_move(others, 30, range(0, 15), range(0, 30), max_blocks=30) == range(5, 20)
    assert home_move(others, 30, range(0, 15), range(5, 20), max_blocks=30) is None
    assert home_move([1] * 30, 30, range(0, 15), range(5, 20), max_blocks=30) == range(0, 15)  # covered: home


def test_self_placing_peers_count_a_told_peer_as_pinned():
    view = _view({A: range(0, 4), B: range(0, 4), C: range(4, 8)}, {A: range(0, 4)}, 8)
    settled = settled_spans(view, 8)
    assert A.to_base58() not in settled.spans and B.to_base58() in settled.spans
    assert all(settled.pinned.get(b) == 1 for b in range(4))


def test_every_move_says_why():
    # C serves 4:8 alone; one of the three self-placing peers on 0:4 (the smallest id) moves to give it a second
    view = _view({A: range(0, 4), B: range(0, 4), D: range(0, 4), C: range(4, 8)}, {}, 8)
    first = min((A, B, D), key=lambda p: p.to_bytes())
    move = decide_move(view, first, range(0, 4), 100.0, Placement(8, 4, 2, max_blocks=4))
    assert move is not None and move.target == range(4, 8)
    assert move.reason.startswith("replication: blocks short of 2 servers 4 -> 0")


def test_a_home_survives_the_record_round_trip():
    record = ServerRecord(A, ServerState.ONLINE, 0, 15, 1.0, home=range(0, 15))
    assert ServerRecord.from_value(A, record.to_value()).home == range(0, 15)
    assert ServerRecord.from_value(A, ServerRecord(A, ServerState.ONLINE, 0, 15, 1.0).to_value()).home is None
