"""Whether blocks that no other peer answered for are orphans: a move over them (the one reason a peer told its span
leaves it) is made only once a second, patient look agrees. A peer that is only slow (its CPU busy, a ping lost), one
whose records lapsed (its DHT calls timed out under load) and one still starting are not dead ones: taking any of them
for dead moved told peers to 0:30 and back (issue 56; CI, stop 63: a move on a look that named no server of 0:15)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import PeerID

from peers.placement import Move, announced_again
from swarm.blocks import spans_text
from swarm.net.records import ServerRecord, ServerState
from swarm.net.transport import Transport
from swarm.net.view import SwarmView, ping_all

logger = logging.getLogger(__name__)

# A move over blocks that no other peer answered for waits for a second look, in which the silent peers get this long
# to answer: a peer busy with queued work or a lost ping is not a dead one (issue 56: spans flapped every 20-40 s).
CONFIRM_TIMEOUT = 12.0  # a silent peer's second chance to answer: past its re-announcement (RECORD_TTL / 3)
ANNOUNCE_SLACK = 3.0  # seconds past a peer's re-announcement period before its records are read for a sign of life
MAX_ANNOUNCE_WAIT = 15.0  # ... if that is at most this (--record-ttl 300 re-announces every 100 s: pings alone)
# A told peer covers blocks it never saw served only once it has served this long: the peers told them may still be
# starting (two told peers started together under load: one served 30 s before the other, and the first grew over
# the second's blocks, then went back).
NEVER_SERVED_GRACE = 60.0

Look = Callable[[float], Awaitable[SwarmView]]  # the view, pinging the silent peers again for up to that long
Decide = Callable[[SwarmView], Awaitable[Move | None]]  # the move this peer would make on a view
ReadRecords = Callable[[], Awaitable[dict[int, list[ServerRecord]]]]  # every live announcement, per block


class OrphanCheck:
    """What a peer remembers of the swarm to tell an orphaned block from one whose server is only silent: the spans
    other peers were seen serving, and since when this peer serves."""

    def __init__(
        self,
        me: PeerID,
        transport: Transport,
        record_ttl: float,
        told: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me, self.transport, self.record_ttl, self.told, self.clock = me, transport, record_ttl, told, clock
        self.servers_seen: dict[PeerID, range] = {}  # the last span each other peer announced online or joining
        self.serving_since: float | None = None
        self.told_waiting: list[int] = []  # the never-served blocks a told peer last waited for (logged once)

    def serving(self) -> None:
        """This peer serves from now on: the grace for blocks it never saw served counts from here."""
        self.serving_since = self.clock()

    def saw(self, view: SwarmView) -> None:
        """Remember the spans other peers announce in ``view`` (online, or joining: loading them)."""
        for records in view.records.values():
            for r in records:
                if r.peer_id != self.me and r.state in (ServerState.ONLINE, ServerState.JOINING):
                    self.servers_seen[r.peer_id] = range(r.start, r.end)

    async def confirmed(
        self, move: Move, first: SwarmView, looked: float, look: Look, decide: Decide, read_records: ReadRecords
    ) -> Move | None:
        """``move`` if it still stands after a second, patient look (``first`` is the round's look, begun at
        ``looked``): the peers that missed the round's ping get ``CONFIRM_TIMEOUT`` to answer; a peer seen serving the
        blocks before whose records are gone is asked what it serves; once a live peer has had time to announce again
        since the round's look, the records are read again, and a peer that announced the blocks again is alive
        whether or not it answered (a ping to a peer its transport took for gone fails at once). A told peer leaves
        blocks it never saw served to their own peers for ``NEVER_SERVED_GRACE``."""
        waiting = self._never_served(move.covers)
        if waiting:
            if waiting != self.told_waiting:  # once, not every round of the grace
                logger.info(
                    "not moving to %d:%d yet: blocks %s have had no server since this peer started; the peers told "
                    "them may still be loading (covering them in %.0f s if still unserved)",
                    move.target.start,
                    move.target.stop,
                    spans_text(waiting),
                    NEVER_SERVED_GRACE - (self.clock() - self.serving_since),
                )
            self.told_waiting = waiting
            return None
        view = await look(CONFIRM_TIMEOUT)
        self.saw(view)
        answering = await self._still_serving(move.covers, view)
        wait = self.record_ttl / 3 + ANNOUNCE_SLACK  # no wait where no re-announcement could come in time
        await asyncio.sleep(max(0.0, looked + wait - self.clock()) if wait <= MAX_ANNOUNCE_WAIT else 0.0)
        records = await read_records()
        again = await decide(view)
        alive = sorted({*answering, *announced_again(first.records, records, move.covers, self.me)}, key=str)
        if again is None or again.target != move.target or alive:
            why = f" ({', '.join(p.to_base58() for p in alive)} answered for them)" if alive else ""
            logger.info(
                "not moving to %d:%d: blocks %s have a live server after all%s",
                move.target.start,
                move.target.stop,
                spans_text(list(move.covers)),
                why,
            )
            return None
        return again

    def _never_served(self, blocks: tuple[int, ...]) -> list[int]:
        """Of ``blocks``, those no other peer was seen serving, while a told peer's grace for them lasts."""
        if not self.told or self.serving_since is None or self.clock() - self.serving_since >= NEVER_SERVED_GRACE:
            return []
        return [b for b in blocks if not any(b in span for span in self.servers_seen.values())]

    async def _still_serving(self, blocks: tuple[int, ...], view: SwarmView) -> list[PeerID]:
        """Peers once seen serving one of ``blocks``, absent from ``view``'s records, that answer ``info`` now
        serving (or loading) one of them: their records lapsed, they did not. One that does not answer is forgotten."""
        named = {r.peer_id for records in view.records.values() for r in records}
        asked = [p for p, span in self.servers_seen.items() if p not in named and any(b in span for b in blocks)]

        answers = await ping_all(self.transport, asked, CONFIRM_TIMEOUT)
        serving = []
        for peer in asked:
            answer = answers.get(peer)
            if answer is None:
                del self.servers_seen[peer]
            elif answer.state != ServerState.LEAVING and any(answer.start <= b < answer.end for b in blocks):
                serving.append(peer)
        return serving
