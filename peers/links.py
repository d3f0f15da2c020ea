"""A peer's links to the peers that may be its next hop, measured in the background: the router weighs a hop by
the link that carries its activations (swarm/client/links.py), so each peer announces what it measured.

A chain's hop from this peer goes to a server of the block right after its span. Every ``every`` seconds, and at
once when such a server appears that was never measured (a span changed, here or there), up to ``max_peers`` of them
are timed, one after the other (at the same time they would share this peer's uplink): the round trip is the best
of ``pings`` empty pings, the bandwidth ``payload`` bytes over the best ping that carries them, less that round trip.
Only the direction the forward pass takes is measured (a backward crosses the same links the other way).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable

import torch
from hivemind.p2p import PeerID

from swarm.net.errors import PEER_ERRORS, ReplyError
from swarm.net.protocol import PingRequest
from swarm.net.records import MAX_LINKS, Link
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

PING_TIMEOUT = 10.0  # a payload that takes longer says the link has at most payload / PING_TIMEOUT bytes/s
MIN_SECONDS = 1e-4  # a payload's transfer time, at least: a ping barely slower than the empty one is noise
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e3, 1e11  # bytes/s announced, clamped


class LinkProber:
    """Measures and keeps this peer's links to its next-hop peers; ``announced()`` is what its records carry."""

    def __init__(
        self,
        transport: Transport,
        every: float = 30.0,
        max_peers: int = 8,
        pings: int = 3,
        payload_bytes: int = 256 << 10,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.transport, self.every, self.max_peers, self.pings = transport, every, max_peers, pings
        self.payload = torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8)
        self.rng, self.clock = rng or random.Random(), clock
        self.links: dict[PeerID, Link] = {}
        self.measured_at: dict[PeerID, float] = {}  # when each was last timed, answered or not
        self.next_round = 0.0
        self._task: asyncio.Task | None = None

    def due(self, next_hops: list[PeerID]) -> bool:
        """Whether to measure now: none running, and the period passed or a next hop was never measured."""
        if self._task is not None and not self._task.done():
            return False
        fresh = any(p not in self.measured_at for p in next_hops)
        return bool(next_hops) and (self.clock() >= self.next_round or fresh)

    def start(self, next_hops: list[PeerID]) -> None:
        """Forget the links to peers that are no next hop any more; measure in the background if ``due``."""
        for peer in [p for p in self.measured_at if p not in next_hops]:
            self.links.pop(peer, None)
            del self.measured_at[peer]
        if self.due(next_hops):
            self._task = asyncio.ensure_future(self.measure(self.choose(next_hops)))
            self._task.add_done_callback(_log_failure)

    def choose(self, next_hops: list[PeerID]) -> list[PeerID]:
        """The next hops to measure now: never measured first (in random order), then the longest ago."""
        ranked = sorted(next_hops, key=lambda p: (self.measured_at.get(p, -math.inf), self.rng.random()))
        return ranked[: self.max_peers]

    async def measure(self, peers: list[PeerID]) -> None:
        """Time the link to each of ``peers`` in turn; a peer that does not answer keeps no link."""
        self.next_round = self.clock() + self.every
        for peer in peers:
            self.measured_at[peer] = self.clock()
            try:
                link = await self.measure_one(peer)
            except PEER_ERRORS as e:  # gone, or a node that does not know ping: tried again next period
                logger.debug("could not measure the link to %s: %s", peer, e)
                self.links.pop(peer, None)
                continue
            self.links[peer] = link
            logger.debug("link to %s: rtt %.1f ms, %.1f MB/s", peer, link.rtt * 1e3, link.bandwidth / 1e6)

    async def measure_one(self, peer: PeerID) -> Link:
        rtt = min([await self._time(peer, PingRequest()) for _ in range(self.pings)])
        size = self.payload.numel()
        try:
            carried = min([await self._time(peer, PingRequest(payload=self.payload)) for _ in range(2)])
            bandwidth = size / max(carried - rtt, MIN_SECONDS)
        except (asyncio.TimeoutError, TimeoutError):
            bandwidth = size / PING_TIMEOUT  # at most that
        return Link(rtt, min(max(bandwidth, MIN_BANDWIDTH), MAX_BANDWIDTH))

    async def _time(self, peer: PeerID, request: PingRequest) -> float:
        started = time.perf_counter()
        reply = await self.transport.aask(peer, request, timeout=PING_TIMEOUT)
        seconds = time.perf_counter() - started
        sent = 0 if request.payload is None else request.payload.numel()
        if reply.received != sent:
            raise ReplyError(f"{peer} says {reply.received} bytes of a {sent}-byte ping arrived")
        return seconds

    def announced(self) -> dict[PeerID, Link]:
        """The freshest links, as many as a record may carry."""
        newest = sorted(self.links, key=lambda p: self.measured_at[p], reverse=True)[:MAX_LINKS]
        return {peer: self.links[peer] for peer in newest}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _log_failure(task: asyncio.Task) -> None:
    """The boundary of a background task: a bug in measuring is logged, and the peer serves on."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("measuring links failed", exc_info=task.exception())
