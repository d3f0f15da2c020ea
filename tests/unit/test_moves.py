"""Peers that decide to move at the same moment, on the same snapshot: the smallest id moves, the others give way."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peers.placement import Move, Placement, announced_again, busy_peers, decide_move, movers
from swarm.net.protocol import PeerInfo
from swarm.net.records import MAX_DISK_SPANS, MoveCost, ServerRecord, ServerState, runs
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


def _target(move: Move | None) -> range | None:
    return None if move is None else move.target


def _decision(me: PeerID) -> range | None:
    view = _view()
    later = frozenset(p for p in movers(view) if p.to_bytes() > me.to_bytes())  # as Mover.move asks
    return _target(decide_move(view, me, range(2, 4), 100.0, PLACEMENT, later))


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
        assert _target(decide_move(view, me, range(2, 4), 100.0, PLACEMENT, others)) == range(0, 2)


# --- what a move costs, as records carry it --------------------------------------------------------------------------

SPANS = {"a": range(0, 2), "b": range(0, 2), "c": range(2, 4), "d": range(2, 4), "e": range(4, 6), "s": range(6, 8)}
IDS = {name: PeerID(bytes([10 + i]) * 8) for i, name in enumerate(SPANS)}
SPEEDS = {name: 100.0 for name in SPANS} | {"s": 30.0}  # blocks 6:8 at 30 tokens/s: a fast peer should relieve them


def _relief_decisions(costs: dict[str, MoveCost | None]) -> dict[str, range | None]:
    """Each peer's decision on a view of records as read back from their wire values, each deciding with its own
    cost (as the daemon passes it)."""
    said = {
        name: ServerRecord(IDS[name], ServerState.ONLINE, span.start, span.stop, SPEEDS[name], cost=costs[name])
        for name, span in SPANS.items()
    }
    records = {name: ServerRecord.from_value(IDS[name], record.to_value()) for name, record in said.items()}
    view = SwarmView(
        {b: [records[n] for n, span in SPANS.items() if b in span] for b in range(8)},
        {peer: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for peer in IDS.values()},
    )
    placement = Placement(num_blocks=8, span_len=2, replication=1, max_blocks=None)
    return {n: _target(decide_move(view, IDS[n], SPANS[n], SPEEDS[n], placement, cost=costs[n])) for n in SPANS}


def test_the_peer_with_the_weights_on_disk_relieves_the_slow_blocks():
    far = MoveCost(load=5.0, fetch=1200.0, on_disk=((0, 4),))  # 6:8 would be downloaded: 40 minutes
    near = MoveCost(load=5.0, fetch=1200.0, on_disk=((2, 4), (6, 8)))
    costs = dict.fromkeys(SPANS, far) | {"c": near}
    assert {n: m for n, m in _relief_decisions(costs).items() if m is not None} == {"c": range(6, 8)}
    # Nobody says what a move costs: the smallest id among the fast peers moves.
    first = min("abcd", key=lambda n: IDS[n].to_base58())
    assert {n: m for n, m in _relief_decisions(dict.fromkeys(SPANS)).items() if m is not None} == {first: range(6, 8)}


def test_a_malformed_move_cost_drops_the_record():
    value = ServerRecord(IDS["a"], ServerState.ONLINE, 0, 2, 1.0, cost=MoveCost(1.0, 2.0, ((0, 2),))).to_value()
    assert ServerRecord.from_value(IDS["a"], value).cost == MoveCost(1.0, 2.0, ((0, 2),))
    assert "cost" not in ServerRecord(IDS["a"], ServerState.ONLINE, 0, 2, 1.0).to_value()
    for bad in ([1.0, 2.0], [-1.0, 2.0, []], [1.0, float("inf"), []], [1.0, 2.0, [[3, 2]]], [1.0, 2.0, [[0, 1.5]]]):
        assert ServerRecord.from_value(IDS["a"], {**value, "cost": bad}) is None, bad
    many = [[2 * i, 2 * i + 1] for i in range(MAX_DISK_SPANS + 1)]
    assert ServerRecord.from_value(IDS["a"], {**value, "cost": [1.0, 2.0, many]}) is None
    assert runs([5, 1, 2, 3, 7, 8]) == ((1, 4), (5, 6), (7, 9))


# --- one move at a time ------------------------------------------------------------------------------------------

THIRD = PeerID(bytes([9]) * 8)


def _swarm(*extra: tuple[ServerRecord, range]) -> SwarmView:
    """FIRST, SECOND and SETTLED_HIGH on 2:4, SETTLED_LOW alone on 0:2 (replication 2: 0:2 is short of a server),
    and ``extra``."""
    announced = [
        (_record(FIRST, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(SECOND, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(SETTLED_HIGH, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(SETTLED_LOW, ServerState.ONLINE, range(0, 2)), range(0, 2)),
        *extra,
    ]
    records = {b: [r for r, blocks in announced if b in blocks] for b in range(4)}
    alive = {p: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for p in (FIRST, SECOND, SETTLED_HIGH, SETTLED_LOW, THIRD)}
    return SwarmView(records, alive)


def test_a_move_for_replicas_waits_while_another_peer_joins_or_moves():
    assert _target(decide_move(_swarm(), FIRST, range(2, 4), 100.0, PLACEMENT)) == range(0, 2)
    joining = (_record(THIRD, ServerState.JOINING, range(2, 4)), range(2, 4))
    moving = ServerRecord(THIRD, ServerState.ONLINE, 2, 4, 100.0, moving_to=range(0, 2))
    for extra in ([joining], [(moving, range(2, 4))]):
        view = _swarm(*extra)
        assert busy_peers(view, FIRST) == {THIRD}
        assert decide_move(view, FIRST, range(2, 4), 100.0, PLACEMENT) is None
    # A peer draining what it handed over is where its records say: no reason to wait.
    draining = [
        (_record(THIRD, ServerState.ONLINE, range(2, 4)), range(2, 4)),
        (_record(THIRD, ServerState.LEAVING, range(0, 2)), range(0, 2)),
    ]
    assert busy_peers(_swarm(*draining), FIRST) == set()
    # Decided again after its own load (Mover.move), a move begun at rest stands.
    view = _swarm(joining)
    assert _target(decide_move(view, FIRST, range(2, 4), 100.0, PLACEMENT, one_at_a_time=False)) == range(0, 2)


def test_a_move_over_orphaned_blocks_never_waits():
    orphaned = SwarmView(
        {
            b: [_record(FIRST, ServerState.ONLINE, range(2, 4)), _record(SECOND, ServerState.ONLINE, range(2, 4))]
            + ([_record(THIRD, ServerState.JOINING, range(2, 4))] if b >= 2 else [])
            for b in range(4)
            if b >= 2
        },
        {p: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for p in (FIRST, SECOND, THIRD)},
    )
    move = decide_move(orphaned, FIRST, range(2, 4), 100.0, PLACEMENT)
    assert move is not None and move.target == range(0, 2) and move.covers == (0, 1)


def test_of_peers_alike_only_the_smallest_id_begins_the_move():
    """FIRST, SECOND and SETTLED_HIGH serve 2:4 and each sees that one of them should serve 0:2: only FIRST does."""

    def looked_by(me: PeerID) -> SwarmView:  # a look pings every peer but the looker
        view = _swarm()
        return SwarmView(view.records, {p: info for p, info in view.alive.items() if p != me})

    peers = (FIRST, SECOND, SETTLED_HIGH)
    decisions = {p: decide_move(looked_by(p), p, range(2, 4), 100.0, PLACEMENT) for p in peers}
    assert {p: _target(m) for p, m in decisions.items()} == {FIRST: range(0, 2), SECOND: None, SETTLED_HIGH: None}


def test_a_peer_that_announced_again_is_alive_whatever_its_pings_said():
    def records(at: dict[PeerID, float]) -> dict[int, list[ServerRecord]]:
        said = [ServerRecord(p, ServerState.ONLINE, 2, 4, 1.0, announced_at=t) for p, t in at.items()]
        return {2: said, 3: said}

    before = records({FIRST: 100.0, SECOND: 100.0})
    assert announced_again(before, records({FIRST: 100.0, SECOND: 100.0}), [2, 3], THIRD) == []  # a dead one's
    assert announced_again(before, records({FIRST: 100.0, SECOND: 110.0}), [2, 3], THIRD) == [SECOND]
    assert announced_again(before, records({FIRST: 100.0, SECOND: 110.0}), [0, 1], THIRD) == []  # other blocks
    assert announced_again(before, records({FIRST: 100.0, THIRD: 110.0}), [2, 3], THIRD) == []  # not itself
    assert announced_again({}, records({FIRST: 100.0}), [2], THIRD) == [FIRST]  # came since
    loading = [ServerRecord(SECOND, ServerState.JOINING, 2, 4, 0.0, announced_at=110.0)]
    assert announced_again(before, {2: loading}, [2], THIRD) == [SECOND]  # still loading them: alive too
    leaving = [ServerRecord(SECOND, ServerState.LEAVING, 2, 4, 1.0, announced_at=110.0)]
    assert announced_again(before, {2: leaving}, [2], THIRD) == []
