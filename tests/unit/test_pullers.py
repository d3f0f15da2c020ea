"""Who pulled copies of a peer's blocks lately: the peers it tells of its commits besides those its view names."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peers.pullers import RecentPullers

A, B, C = (PeerID(bytes([0x12, 0x20, i]) + bytes(31)) for i in range(3))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pull_is_remembered_for_the_blocks_pulled_until_it_is_older_than_the_ttl():
    clock = Clock()
    pullers = RecentPullers(ttl=30.0, clock=clock)
    pullers.note(A, range(2, 4))
    pullers.note(B, [5])
    assert pullers.of([3]) == [A] and pullers.of([5, 6]) == [B] and pullers.of([0, 1]) == []
    clock.now += 20.0
    pullers.note(A, range(2, 4))  # it pulled again: renewed
    clock.now += 15.0
    assert pullers.of(range(8)) == [A]  # B's pull is 35 s old


def test_a_new_pull_replaces_the_blocks_of_the_last_one():
    pullers = RecentPullers(clock=Clock())
    pullers.note(A, [1, 2])
    pullers.note(A, [6])
    assert pullers.of([1, 2]) == [] and pullers.of([6]) == [A]


def test_beyond_the_limit_the_peer_that_pulled_longest_ago_is_forgotten():
    clock = Clock()
    pullers = RecentPullers(limit=2, clock=clock)
    pullers.note(A, [0])
    clock.now += 1
    pullers.note(B, [0])
    clock.now += 1
    pullers.note(A, [0])  # A is the latest now
    clock.now += 1
    pullers.note(C, [0])
    assert pullers.of([0]) == [A, C]
