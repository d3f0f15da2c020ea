"""Pick a chain of live peers that covers blocks [0, n), from the DHT's announcements; ban peers that fail."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.records import ServerRecord, ServerState, read_servers

logger = logging.getLogger(__name__)


class NoRouteError(RuntimeError):
    """Some blocks have no live server."""


@dataclass(frozen=True)
class Hop:
    """Blocks [start, end) computed by one peer."""

    peer_id: PeerID
    start: int
    end: int

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


class Router:
    """The client's view of who serves what, refreshed from the DHT."""

    def __init__(self, dht: DHT, model: str, num_blocks: int):
        self.dht, self.model, self.num_blocks = dht, model, num_blocks
        self.servers: dict[int, list[ServerRecord]] = {}
        self.banned_until: dict[PeerID, float] = {}

    def refresh(self) -> None:
        self.servers = read_servers(self.dht, self.model, self.num_blocks)

    def ban(self, peer_id: PeerID, seconds: float) -> None:
        self.banned_until[peer_id] = time.monotonic() + seconds

    def usable(self, record: ServerRecord) -> bool:
        return record.state == ServerState.ONLINE and self.banned_until.get(record.peer_id, 0.0) <= time.monotonic()

    def uncovered(self, start: int = 0, end: int | None = None) -> list[int]:
        end = self.num_blocks if end is None else end
        return [b for b in range(start, end) if not any(self.usable(r) for r in self.servers.get(b, []))]

    def route(self, start: int = 0, end: int | None = None) -> list[Hop]:
        """Fewest hops: from each block, the usable server whose span reaches farthest (then the fastest)."""
        end = self.num_blocks if end is None else end
        hops: list[Hop] = []
        block = start
        while block < end:
            candidates = [r for r in self.servers.get(block, []) if self.usable(r)]
            if not candidates:
                missing = self.uncovered(start, end)
                raise NoRouteError(f"no live server for blocks {missing}; start peers with --blocks covering them")
            best = max(candidates, key=lambda r: (min(r.end, end), r.throughput))
            hops.append(Hop(best.peer_id, block, min(best.end, end)))
            block = hops[-1].end
        return hops

    def servers_of(self, blocks: range) -> set[PeerID]:
        """Every usable peer that serves at least one of ``blocks``."""
        return {r.peer_id for b in blocks for r in self.servers.get(b, []) if self.usable(r)}
