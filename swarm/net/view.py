"""A peer's view of the swarm: who announces what (DHT records) and who actually answers (``info`` pings).

Records of a dead peer live on until they expire; balancing and takeover decisions count only peers that
answered a ping in this round, so an orphaned block is noticed within one round, not one record lifetime.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.net.errors import PEER_ERRORS, RequestError
from swarm.net.protocol import InfoRequest, PeerInfo
from swarm.net.records import ServerRecord, ServerState, read_servers
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

PING_TIMEOUT = 3.0
RETRY_TIMEOUT = 15.0  # a one-shot look's second try at a peer that missed the first (see ``observe``)


@dataclass
class SwarmView:
    """One round's snapshot: records per block, and the info of every peer that answered."""

    records: dict[int, list[ServerRecord]]
    alive: dict[PeerID, PeerInfo]

    def _live(self, block: int, states: tuple[ServerState, ...], exclude: PeerID | None) -> list[ServerRecord]:
        return [
            r
            for r in self.records.get(block, [])
            if r.state in states and r.peer_id != exclude and r.peer_id in self.alive
        ]

    def online(self, block: int, exclude: PeerID | None = None) -> list[ServerRecord]:
        return self._live(block, (ServerState.ONLINE,), exclude)

    def coverage(self, exclude: PeerID, joining_before: PeerID | None = None) -> dict[int, int]:
        """Live servers per block other than ``exclude``; joining peers count too (they will serve soon). With
        ``joining_before``, only joiners with a smaller id count: two peers that chose the same span at once
        settle it by id (the larger one chooses again)."""
        counts = {}
        for block in self.records:
            online = len(self.online(block, exclude))
            joining = self._live(block, (ServerState.JOINING,), exclude)
            if joining_before is not None:
                joining = [r for r in joining if r.peer_id.to_bytes() < joining_before.to_bytes()]
            counts[block] = online + len(joining)
        return counts

    def throughput(self) -> dict[int, float]:
        return {block: sum(r.throughput for r in self.online(block)) for block in self.records}

    def holders(self, exclude: PeerID) -> dict[int, int]:
        """Per block, how many other live peers hold its adapter state (served or standby), for any adapter."""
        counts: dict[int, int] = {}
        for peer, info in self.alive.items():
            if peer == exclude:
                continue
            blocks = {b for a in info.adapters.values() for b in (*a.steps, *a.standby)} | set(info.standby_blocks)
            for block in blocks:
                counts[block] = counts.get(block, 0) + 1
        return counts

    def adapters(self) -> dict[str, dict]:
        """Every adapter some live peer holds, with its config and seed."""
        return {name: a.meta for info in self.alive.values() for name, a in info.adapters.items()}

    def newest(self, name: str, block: int, exclude: PeerID) -> tuple[int, PeerID] | None:
        """The newest state of (adapter, block) on another live peer, served or standby, and who holds it: a server
        of the block before a standby holder at the same step, because a copy pulled from a server is told of its
        next commits (``peers/pullers.py``), and one pulled from another copy is not. Among equals, each puller
        ranks them by a hash of the two ids (rendezvous hashing): the copies of a block spread over its replicas,
        which each upload their share of the step's updates, not one replica all of them."""
        found = [
            (step, block in info.adapters[name].steps, rendezvous(exclude, peer), peer)
            for peer, info in self.alive.items()
            if peer != exclude and name in info.adapters and (step := info.adapters[name].step_of(block)) is not None
        ]
        if not found:
            return None
        step, _, _, peer = max(found, key=lambda item: item[:3])
        return step, peer

    def trainer_step(self, name: str) -> int | None:
        """The adapter's newest committed step on any live server: what its trainer is at."""
        steps = [s for info in self.alive.values() if name in info.adapters for s in info.adapters[name].steps.values()]
        return max(steps) if steps else None

    def watchers(self, blocks: list[int]) -> list[PeerID]:
        """Live peers keeping standby copies of any of ``blocks``."""
        return [peer for peer, info in self.alive.items() if set(info.standby_blocks) & set(blocks)]


def rendezvous(puller: PeerID, source: PeerID) -> bytes:
    """A rank of ``source`` for ``puller``, the same wherever it is computed, different from one puller to another."""
    return hashlib.blake2b(puller.to_bytes() + source.to_bytes(), digest_size=8).digest()


def same_weights(records: dict[int, list[ServerRecord]], weights: dict[int, str]) -> dict[int, list[ServerRecord]]:
    """The records of peers whose every announcement agrees with ``weights`` (block -> digest): a peer serving a
    block from other weights under the same model name is another model, left out of the view whole."""
    others = {r.peer_id for block_records in records.values() for r in block_records if r.conflicts(weights)}
    return {block: [r for r in rs if r.peer_id not in others] for block, rs in records.items()}


async def observe(
    dht: DHT,
    transport: Transport,
    model: str,
    num_blocks: int,
    me: PeerID,
    weights: dict[int, str] | None = None,
    retry_timeout: float | None = None,
) -> SwarmView:
    """Read the records, then ping every peer they name (except ``me``) at once; with ``weights``, only the peers
    whose blocks have those digests (see ``same_weights``). With ``retry_timeout``, the peers that missed the first
    ping get a second, longer one: a first dial through a relay on a busy machine can take longer than PING_TIMEOUT,
    and a one-shot look that shows a live peer offline (its blocks UNCOVERED) misleads its reader; a look repeated
    every few seconds does without, rather than wait on a stopped peer each round."""
    records = await asyncio.to_thread(read_servers, dht, model, num_blocks)
    if weights is not None:
        records = same_weights(records, weights)
    transport.learn(r for block_records in records.values() for r in block_records)
    peers = {r.peer_id for block_records in records.values() for r in block_records if r.peer_id != me}

    alive = await ping_all(transport, list(peers), PING_TIMEOUT)
    if retry_timeout is not None:
        alive |= await ping_all(transport, [peer for peer in peers if peer not in alive], retry_timeout)
    return SwarmView(records=records, alive=alive)


async def ping_all(transport: Transport, peers: list[PeerID], timeout: float) -> dict[PeerID, PeerInfo]:
    """The ``info`` of each of ``peers`` that answers within ``timeout``, asked all at once."""

    async def ping(peer: PeerID) -> PeerInfo | None:
        try:
            return await transport.aask(peer, InfoRequest(), timeout=timeout)
        except (*PEER_ERRORS, RequestError) as e:  # gone, refused, or a reply that is not a PeerInfo
            logger.debug("peer %s did not answer: %s", peer, e)
            return None

    answers = await asyncio.gather(*(ping(peer) for peer in peers))
    return {peer: info for peer, info in zip(peers, answers, strict=True) if info is not None}
