"""Acknowledged means durable: before a step is acknowledged, every block's new state is held by ``min_copies``
peers, whenever the swarm has that many that can hold it.

A block's live replicas count; for blocks with fewer, the trainer asks other live peers to hold a standby copy of the
new state (``replicate``: the holder pulls it peer to peer from a replica, and keeps it whatever its own standby
choice). Holders are sticky, so the same peers keep refreshing the same blocks: a holder whose copy is one step
behind pulls only the step's summed gradient and applies the same AdamW update itself (a third of the bytes of the
state). Holders are asked in parallel, so the cost is one round trip plus that transfer per step, whatever their
number. Like synchronous
replication in a database: an acknowledged step survives the loss of any single peer, from the first step on.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from hivemind.p2p import PeerID

from swarm.client.calls import PeerCalls, PeerFailure
from swarm.client.commit import ReplicaSet
from swarm.net.errors import RemoteError
from swarm.net.protocol import ReplicateRequest

logger = logging.getLogger(__name__)

MAX_ROUNDS = 3  # per step: a holder that fails is replaced; one whose source failed tries the next source


class CopyKeeper:
    """Chooses standby holders for under-replicated blocks and has them copy each committed state."""

    def __init__(
        self, calls: PeerCalls, replicas: ReplicaSet, min_copies: int, lora: dict, seed: int, workers: int = 8
    ):
        if min_copies < 1:
            raise ValueError(f"min_copies must be at least 1, got {min_copies}")
        self.calls, self.replicas, self.min_copies = calls, replicas, min_copies
        self.lora, self.seed = lora, seed  # the adapter's identity, sent so a new holder can create it
        self.holders: dict[int, list[PeerID]] = {}  # block -> standby holders, kept from step to step
        self.copies: dict[int, int] = {}  # block -> peers holding the last acknowledged state
        self.unconfirmed: set[int] = set()  # blocks holders were asked to copy at the last step, and none did
        self._short: dict[int, int] | None = None  # the shortfall last warned about
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swarm-copies")

    def ensure(self, step: int, replicas: dict[PeerID, range]) -> dict[int, int]:
        """Make every block's state at ``step`` held by ``min_copies`` peers: ``replicas`` (current at ``step``)
        plus standby holders. Returns the copies per block; a shortfall is warned about once, never raised. Only
        peers not banned when they acknowledged count (a replica applied the step, a holder answered with the copy):
        a peer banned for failing may be gone with its copy, one banned for good holds nothing the trainer trusts."""
        router = self.calls.router
        num_blocks = router.num_blocks
        trusted = {p: span for p, span in replicas.items() if not self._written_off(p)}
        servers = {b: [p for p, span in trusted.items() if b in span] for b in range(num_blocks)}
        confirmed: dict[int, list[PeerID]] = {b: [] for b in range(num_blocks)}
        asked: set[int] = set()
        if self.min_copies > 1:
            candidates = sorted(router.live_servers(eligible_only=False), key=lambda p: p.to_bytes())
            failed: set[PeerID] = set()  # holders that did not answer; one that answered short may try another source
            for attempt in range(MAX_ROUNDS):
                plan = self._plan(servers, confirmed, [p for p in candidates if p not in failed])
                if not plan:
                    break
                asked.update(b for blocks in plan.values() for b in blocks)
                replies = self._pool.map(
                    lambda item, attempt=attempt: self._replicate(*item, step, trusted, attempt), plan.items()
                )
                for (holder, blocks), held in zip(plan.items(), replies, strict=True):
                    if held is None or self._written_off(holder):
                        failed.add(holder)
                        continue
                    for block in blocks:
                        if held.get(block, -1) >= step:
                            confirmed[block].append(holder)
            self.holders = {b: holders for b, holders in confirmed.items() if holders}
        self.copies = {b: len(servers[b]) + len(confirmed[b]) for b in range(num_blocks) if servers[b]}
        self.unconfirmed = {b for b in asked if not confirmed[b]}
        self._warn_if_short(step)
        return self.copies

    def _written_off(self, peer: PeerID) -> bool:
        """Whether ``peer`` is banned now and silent since (``PeerHealth.written_off``)."""
        health = self.calls.router.health.get(peer)
        return health is not None and health.written_off(time.monotonic())

    def died_uncopied(self, replicas: dict[PeerID, range]) -> list[int]:
        """Blocks whose new state nobody holds any more: no holder could copy it (``unconfirmed``), and none of
        ``replicas`` (those that applied it) answers hello now (those that do not are banned). Their servers died
        after applying the step and before a holder copied it (a holder that found its source gone answers without
        the copy): the step must be committed again, from the copies of the step before, or it is lost at the next
        step."""
        suspects = {p: span for p, span in replicas.items() if any(b in span for b in self.unconfirmed)}
        if not suspects:
            return []
        answered = dict(zip(suspects, self._pool.map(self.calls.answers, suspects), strict=True))
        return sorted(b for b in self.unconfirmed if not any(answered[p] for p, span in suspects.items() if b in span))

    def _plan(
        self, servers: dict[int, list[PeerID]], confirmed: dict[int, list[PeerID]], candidates: list[PeerID]
    ) -> dict[PeerID, list[int]]:
        """Holder -> blocks to copy: for each block short of copies, its previous holders first, then the peers
        given the fewest blocks so far (spreading the work), never one of its own servers."""
        plan: dict[PeerID, list[int]] = {}
        for block, block_servers in servers.items():
            if not block_servers:
                continue  # no current replica to copy from (the commit will not have acknowledged this step)
            need = self.min_copies - len(block_servers) - len(confirmed[block])
            sticky = self.holders.get(block, [])
            eligible = [p for p in candidates if p not in block_servers and p not in confirmed[block]]
            eligible.sort(key=lambda p: (p not in sticky, len(plan.get(p, ()))))
            for holder in eligible[: max(0, need)]:
                plan.setdefault(holder, []).append(block)
        return plan

    def _replicate(
        self, holder: PeerID, blocks: list[int], step: int, replicas: dict[PeerID, range], attempt: int
    ) -> dict[int, int] | None:
        """Ask ``holder`` to copy ``blocks`` at ``step`` from their replicas; returns the steps it holds (None: it did
        not answer). Each ``attempt`` takes the next replica of a block as its source: the one before may be what
        failed (frozen or gone since it applied the step)."""
        sources: list[tuple[range, PeerID]] = []
        for block in blocks:
            holders = sorted((p for p, span in replicas.items() if block in span), key=lambda p: p.to_bytes())
            source = holders[attempt % len(holders)]
            if sources and sources[-1][0].stop == block and sources[-1][1] == source:
                sources[-1] = (range(sources[-1][0].start, block + 1), source)
            else:
                sources.append((range(block, block + 1), source))
        request = ReplicateRequest(
            adapter=self.calls.adapter, lora=self.lora, seed=self.seed, step=step, sources=sources
        )
        try:
            reply = self.calls.ask(holder, request, units=len(blocks))
        except (PeerFailure, RemoteError) as e:
            logger.warning("peer %s could not hold a copy of blocks %s at step %d: %s", holder, blocks, step, e)
            return None
        self.replicas.note_standby(holder, reply.steps)
        return reply.steps

    def _warn_if_short(self, step: int) -> None:
        short = {b: c for b, c in self.copies.items() if c < self.min_copies}
        if short and short != self._short:
            peers = len(self.calls.router.live_servers(eligible_only=False))
            logger.warning(
                "step %d is held by fewer than min_copies=%d peers: copies per block %s (%d live peer(s) in the "
                "swarm). A failure of the peer holding a single copy would lose this step; start more peers "
                "(`swarm peer --model ... --initial-peers ...`) to get %d copies, or pass min_copies=1 to accept it.",
                step,
                self.min_copies,
                short,
                peers,
                self.min_copies,
            )
        elif not short and self._short:
            logger.info("every block is held by at least %d peers again", self.min_copies)
        self._short = short or None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
