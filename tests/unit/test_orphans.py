"""A move over blocks no other peer answered for (peers/orphans.py) is made only when they are orphans: not while a
told peer's partner may still be starting, not while a peer seen serving them answers that it still does."""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from peers.orphans import NEVER_SERVED_GRACE, OrphanCheck
from peers.placement import Move
from swarm.net.protocol import PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.transport import PeerGoneError
from swarm.net.view import SwarmView

ME, LOW = PeerID(b"\x01" * 8), PeerID(b"\x02" * 8)
GROW = Move(range(0, 4), "blocks 0:2 have no other live server", covers=(0, 1))
NOBODY = SwarmView({b: [] for b in range(4)}, {})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Answers:
    """The transport's ``aask`` as a peer would answer ``info``: with ``info``, or gone."""

    def __init__(self, info: PeerInfo | None) -> None:
        self.info, self.asked = info, []

    async def aask(self, peer: PeerID, request, timeout: float) -> PeerInfo:
        self.asked.append(peer)
        if self.info is None:
            raise PeerGoneError(f"peer {peer} is gone")
        return self.info


def _low_serving() -> SwarmView:
    record = ServerRecord(LOW, ServerState.ONLINE, 0, 2, 100.0, announced_at=5.0)
    return SwarmView({0: [record], 1: [record], 2: [], 3: []}, {LOW: PeerInfo("m", 0, 2, "online", 1.0, {}, [])})


def _confirm(check: OrphanCheck, looks: list[SwarmView]) -> Move | None:
    async def look(retry_timeout: float) -> SwarmView:
        looks.append(NOBODY)
        return NOBODY

    async def decide(view: SwarmView) -> Move | None:
        return GROW

    async def read_records() -> dict:
        return NOBODY.records

    return asyncio.run(check.confirmed(GROW, NOBODY, check.clock(), look, decide, read_records))


def test_a_told_peer_leaves_blocks_it_never_saw_served_to_their_peers_for_a_while():
    clock, looks = Clock(), []
    check = OrphanCheck(ME, Answers(None), record_ttl=300.0, told=True, clock=clock)
    check.serving()
    clock.now += NEVER_SERVED_GRACE - 1.0
    assert _confirm(check, looks) is None and looks == []  # not even looked: the other told peer may be loading
    clock.now += 2.0
    assert _confirm(check, looks) == GROW and len(looks) == 1  # still nobody after the grace: orphans


def test_a_peer_that_places_itself_has_no_such_grace():
    check = OrphanCheck(ME, Answers(None), record_ttl=300.0, told=False, clock=Clock())
    check.serving()
    assert _confirm(check, []) == GROW


def test_a_server_whose_records_lapsed_but_answers_is_not_dead():
    answers = Answers(PeerInfo("m", 0, 2, "online", 1.0, {}, []))
    check = OrphanCheck(ME, answers, record_ttl=300.0, told=True, clock=Clock())
    check.serving()
    check.saw(_low_serving())  # seen serving 0:2: the grace is over for those blocks
    assert _confirm(check, []) is None and answers.asked == [LOW]


def test_a_server_seen_before_that_is_gone_or_moved_away_leaves_orphans():
    moved = Answers(PeerInfo("m", 2, 4, "online", 1.0, {}, []))
    check = OrphanCheck(ME, moved, record_ttl=300.0, told=True, clock=Clock())
    check.serving()
    check.saw(_low_serving())
    assert _confirm(check, []) == GROW and moved.asked == [LOW]
    gone = Answers(None)
    check = OrphanCheck(ME, gone, record_ttl=300.0, told=True, clock=Clock())
    check.serving()
    check.saw(_low_serving())
    assert _confirm(check, []) == GROW and gone.asked == [LOW]
    assert check.servers_seen == {}  # forgotten: not asked again
