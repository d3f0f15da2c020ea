"""What a peer tells others of itself: its records in the DHT (the span it serves, the one it loads, the blocks it
gave up lately), renewed before they lapse while it loads, and its answer to ``info``; each as of the end of its
compute thread's last job, never a change half made."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psutil
import torch
from hivemind import DHT

from peers.backend import SpanBackend
from peers.config import PeerConfig
from peers.leaving import LeavingBlocks
from peers.movelog import MoveLog
from peers.standing import Standing
from swarm.net.numerics import Numerics
from swarm.net.protocol import AdapterInfo, MemoryUse, PeerInfo
from swarm.net.records import ServerRecord, ServerState, announce, announce_model
from swarm.net.security import Identity
from swarm.spec import ModelSpec
from swarm.usage import tree_usage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    """What a peer tells of itself, as of the end of its compute thread's last job (``Announcer.publish``)."""

    adapters: dict[str, AdapterInfo]
    stores: dict[str, int]


class Announcer:
    """This peer's records and ``info``, read from its ``standing`` (what it serves and loads, how fast) and from what
    its compute thread last published. One announcement is one value that replaces the last (swarm/net/records.py);
    ``max_blocks``: how far it may grow, announced for the balancer."""

    def __init__(
        self,
        dht: DHT,
        config: PeerConfig,
        spec: ModelSpec,
        identity: Identity,
        standing: Standing,
        max_blocks: int,
        moves: MoveLog,
    ):
        self.dht, self.config, self.spec, self.identity = dht, config, spec, identity
        self.standing, self.max_blocks, self.moves = standing, max_blocks, moves
        self.leaving = LeavingBlocks(config.record_ttl)  # blocks given up lately, announced as leaving
        self.published: Published | None = None  # what the compute thread last published for readers off it

    def publish(self, backend: SpanBackend) -> None:
        """On the compute thread, after each of its jobs: what ``info`` and the records tell, as of that job's end
        (never a change half made), for readers that must not wait behind the queued forwards and backwards."""
        self.published = Published(backend.adapters.adapter_infos(), backend.store_use())

    def _adapter_infos(self) -> dict[str, AdapterInfo]:
        """What this peer holds of each adapter, as the compute thread last published it."""
        return {} if self.published is None else self.published.adapters

    async def records(self) -> list[tuple[ServerRecord, range]]:
        """What this peer announces, each record with the blocks it is announced under: online on the span it serves;
        joining on the blocks it loads that it does not serve yet."""
        now = self.standing
        records = []
        if now.serving:
            records.append((self._online_record(), now.serving))
        if now.joining:
            record = self._joining_record()
            records.append((record, range(max(now.joining.start, now.serving.stop), now.joining.stop)))
            records.append((record, range(now.joining.start, min(now.joining.stop, now.serving.start))))
        return [(record, blocks) for record, blocks in records if len(blocks)]

    def _online_record(self) -> ServerRecord:
        now, parts = self.standing, self.standing.parts
        adapters = {}
        for name, adapter in self._adapter_infos().items():
            steps = [step for block, step in adapter.steps.items() if block in now.serving]
            if steps:
                adapters[name] = min(steps)
        return ServerRecord(
            self.identity.peer_id,
            now.state,
            now.serving.start,
            now.serving.stop,
            now.throughput,
            adapters,
            now.moving_to,
            maddrs=now.maddrs,
            digests=now.digests_of(now.serving),
            max_blocks=self.max_blocks,
            home=self.config.blocks,
            links=parts.links.announced() if parts is not None else {},
            numerics=self.numerics(now.serving),
            cost=now.cost,
            max_tokens_in_flight=self.published.stores["tokens_in_flight_max"] if self.published else 0,
        )

    def _joining_record(self) -> ServerRecord:
        now = self.standing
        return ServerRecord(
            self.identity.peer_id,
            ServerState.JOINING,
            now.joining.start,
            now.joining.stop,
            now.throughput,
            maddrs=now.maddrs,
            digests=now.digests_of(now.joining),
            numerics=self.numerics(now.joining),
        )

    def numerics(self, blocks: range) -> Numerics:
        """The numerics this peer announces for ``blocks`` (swarm/net/numerics.py)."""
        if self.standing.parts is None:
            config = self.config  # blocks not loaded yet: no errors measured, read as the caps
            return Numerics(config.quant_mode, config.dtype, torch.device(config.device).type)
        return self.standing.parts.backend.numerics(blocks)

    async def announce(self, leaving: list[tuple[ServerRecord, range]] = ()) -> None:
        """Announce what this peer serves and loads, and the blocks it gave up lately (``leaving``: just now, given
        precedence over what it still announces there), in one value that replaces the last."""
        entries = self.leaving.announce(leaving, await self.records(), time.monotonic())
        name, owner, ttl = self.spec.name, self.identity.owner, self.config.record_ttl
        await asyncio.to_thread(announce, self.dht, name, owner, entries, ttl)
        await asyncio.to_thread(announce_model, self.dht, name, self.spec.num_blocks, owner, ttl)

    async def withdraw(self, blocks: list[int]) -> None:
        """Replace this peer's records on ``blocks`` by leaving ones: a joining record left there would count as a
        server to come until it expired, and the balancer would move the real servers away."""
        me = self.identity.peer_id
        leaving = ServerRecord(me, ServerState.LEAVING, min(blocks, default=0), max(blocks, default=0) + 1, 0.0)
        await self.announce([(leaving, range(b, b + 1)) for b in blocks])

    @contextlib.asynccontextmanager
    async def announcing(self) -> AsyncIterator[None]:
        """Announce this peer's records every ``record_ttl / 3`` while it loads blocks (joining, or moving while it
        serves its old span): a load longer than a record's lifetime (a big span from a slow disk) would otherwise
        let its records expire, and others would take its blocks for unserved and its choice for nobody's."""

        done = asyncio.Event()

        async def keep_announcing() -> None:
            while not await _wait_for(done, self.config.record_ttl / 3):
                try:
                    await self.announce()
                except TimeoutError as e:
                    logger.warning("announcing failed (will retry): %s", e)

        task = asyncio.create_task(keep_announcing())
        try:
            yield
        finally:
            done.set()
            await task  # an announcement under way lands before the caller announces what comes next, not after

    async def _memory(self) -> MemoryUse | None:
        """This peer's memory against its bounds, once it serves (an in-process peer counts the process it runs in)."""
        if self.published is None:
            return None
        stores = self.published.stores
        usage = await asyncio.to_thread(tree_usage, os.getpid())
        host = psutil.virtual_memory()
        return MemoryUse(rss=usage.rss, host_available=host.available, host_total=host.total, **stores)

    async def info(self) -> PeerInfo:
        """The answer to ``info``: what this peer serves, in what state, how fast, with which adapters and standby
        copies, its numerics, its memory and its last hour's moves."""
        now = self.standing
        standby = now.parts.replicator.standby if now.parts is not None else []
        return PeerInfo(
            self.spec.name,
            now.serving.start,
            now.serving.stop,
            now.state.value,
            now.throughput,
            self._adapter_infos(),
            standby,
            f"{self.config.quant_mode}/{self.config.dtype}",
            await self._memory(),
            self.moves.recent(),
        )


async def _wait_for(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` was set within ``seconds``."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True
