"""The client's ``unserved`` notices (swarm/client/unserved.py): every live peer is told, at most every few seconds
for the same blocks, and a peer that fails to take one holds nothing up."""

from __future__ import annotations

import threading

from hivemind.p2p import PeerID

from swarm.client.unserved import UnservedNotice
from swarm.net.protocol import Ack, UnservedRequest


class _Transport:
    """Records the notices; one peer's connection is gone."""

    def __init__(self, gone: PeerID):
        self.gone, self.asked, self.lock = gone, [], threading.Lock()
        self.answered = threading.Semaphore(0)

    async def aask(self, peer: PeerID, request: UnservedRequest, timeout: float) -> Ack:
        try:
            with self.lock:
                self.asked.append((peer, request.model, request.blocks))
            if peer == self.gone:
                raise ConnectionError("gone")
            return Ack()
        finally:
            self.answered.release()


class _Router:
    def __init__(self, peers: list[PeerID]):
        self.peers = peers

    def live_servers(self, eligible_only: bool = True) -> dict[PeerID, range]:
        return {p: range(0, 2) for p in self.peers}


def _wait_answers(transport: _Transport, count: int) -> None:
    for _ in range(count):
        assert transport.answered.acquire(timeout=30)


def test_every_live_peer_is_told_once_per_interval_for_the_same_blocks():
    alive, gone = PeerID(b"a" * 8), PeerID(b"g" * 8)
    transport = _Transport(gone)
    notice = UnservedNotice(transport, _Router([alive, gone]), "tiny-llama", every=3600.0)
    notice.send([3, 2, 2])
    notice.send([2, 3])  # the same blocks again: not sent
    notice.send([])  # nothing unserved: nothing sent
    notice.send([5])  # other blocks: sent
    _wait_answers(transport, 4)
    assert sorted(transport.asked, key=repr) == sorted(
        [(p, "tiny-llama", blocks) for p in (alive, gone) for blocks in ([2, 3], [5])], key=repr
    )
    assert notice.notices == 2


def test_the_same_blocks_are_told_again_once_the_interval_passed():
    alive = PeerID(b"a" * 8)
    transport = _Transport(PeerID(b"g" * 8))
    notice = UnservedNotice(transport, _Router([alive]), "tiny-llama", every=0.0)
    notice.send([1])
    notice.send([1])
    _wait_answers(transport, 2)
    assert transport.asked == [(alive, "tiny-llama", [1])] * 2
