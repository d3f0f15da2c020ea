"""Peers that pulled a copy of this peer's blocks lately, to be told of each commit of those blocks at once.

A server tells the standby holders its view of the swarm names (``SwarmView.watchers``) after each commit, but that
view is as old as its last balance round (5 s on average), and standby choices change after every departure: a
holder that picked a block since pulled it once and then fell behind a step per commit until the server's next
round. A churn run lost both servers of a block in that window, and the newest copy left was two steps behind. A
holder that pulls names itself (``ExportRequest.watcher``), so the server tells it from the next commit on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from hivemind.p2p import PeerID

WATCH_SECONDS = 30.0  # a pull keeps its puller told this long; each notice it acts on pulls again and renews it
MAX_PULLERS = 64  # a bound on what strangers can make a peer remember; the oldest is forgotten first


class RecentPullers:
    """Who pulled which blocks of this peer, and when (each pull replaces the puller's blocks)."""

    def __init__(
        self,
        ttl: float = WATCH_SECONDS,
        limit: int = MAX_PULLERS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ttl, self.limit, self.clock = ttl, limit, clock
        self._pulls: dict[PeerID, tuple[frozenset[int], float]] = {}

    def note(self, peer: PeerID, blocks: Iterable[int]) -> None:
        self._pulls.pop(peer, None)  # re-inserted last: the dict stays in the order of the latest pulls
        self._pulls[peer] = (frozenset(blocks), self.clock())
        while len(self._pulls) > self.limit:
            del self._pulls[next(iter(self._pulls))]

    def of(self, blocks: Iterable[int]) -> list[PeerID]:
        """The peers that pulled any of ``blocks`` within the last ``ttl`` seconds."""
        now, wanted = self.clock(), set(blocks)
        for peer in [p for p, (_, at) in self._pulls.items() if now - at > self.ttl]:
            del self._pulls[peer]
        return [peer for peer, (pulled, _) in self._pulls.items() if pulled & wanted]
