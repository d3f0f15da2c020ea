"""Pick chains of live peers over blocks, from the DHT's announcements; ban failing peers with backoff."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.records import ServerRecord, ServerState, read_servers

logger = logging.getLogger(__name__)


class NoRouteError(RuntimeError):
    """Some blocks have no live server."""


class SwarmUnavailableError(RuntimeError):
    """Blocks stayed without any live server for longer than the client's patience."""


@dataclass(frozen=True)
class Hop:
    """Blocks [start, end) computed by one peer."""

    peer_id: PeerID
    start: int
    end: int

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass
class PeerHealth:
    """What the client learned about one peer: failures in a row, ban, and its speed per method."""

    failures: int = 0
    banned_until: float = 0.0
    seconds_per_unit: dict[str, float] = field(default_factory=dict)


class Router:
    """The client's view of who serves what, refreshed from the DHT in the background."""

    def __init__(
        self,
        dht: DHT,
        model: str,
        num_blocks: int,
        *,
        first_timeout: float = 60.0,
        min_timeout: float = 2.0,
        min_ban: float = 2.0,
        max_ban: float = 120.0,
        refresh_every: float = 3.0,
        seed: int | None = None,
    ):
        self.dht, self.model, self.num_blocks = dht, model, num_blocks
        self.first_timeout, self.min_timeout = first_timeout, min_timeout
        self.min_ban, self.max_ban, self.refresh_every = min_ban, max_ban, refresh_every
        self.servers: dict[int, list[ServerRecord]] = {}
        self.health: dict[PeerID, PeerHealth] = {}
        self.eligible: Callable[[PeerID], bool] = lambda peer: True
        self.on_wait: Callable[[], None] = lambda: None  # run while waiting for a route: bring new peers in
        self.random = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the swarm's view -------------------------------------------------------------------------------------

    def refresh(self) -> None:
        servers = read_servers(self.dht, self.model, self.num_blocks)
        with self._lock:
            self.servers = servers

    def start(self) -> None:
        """Refresh the view every ``refresh_every`` seconds until ``stop()``."""
        self._thread = threading.Thread(target=self._refresh_loop, name="swarm-router", daemon=True)
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_every):
            try:
                self.refresh()
            except Exception as e:
                logger.warning("could not refresh the swarm view: %s", e)

    def stop(self) -> None:
        self._stop.set()

    # --- health -----------------------------------------------------------------------------------------------

    def _health(self, peer: PeerID) -> PeerHealth:
        return self.health.setdefault(peer, PeerHealth())

    def ban(self, peer: PeerID, reason: str) -> float:
        """Stop using a peer for a while; each failure in a row doubles the ban (capped)."""
        health = self._health(peer)
        health.failures += 1
        seconds = min(self.max_ban, self.min_ban * 2 ** (health.failures - 1))
        health.banned_until = time.monotonic() + seconds
        logger.warning("peer %s failed (%s); banned for %.0fs", peer, reason, seconds)
        return seconds

    def distrust(self, peer: PeerID, reason: str) -> None:
        """Never use this peer again in this client (it returned results its replicas disagree with)."""
        self._health(peer).banned_until = float("inf")
        logger.error("peer %s is banned for good: %s", peer, reason)

    def succeeded(self, peer: PeerID, method: str, units: float, seconds: float) -> None:
        health = self._health(peer)
        health.failures = 0
        rate = seconds / max(units, 1.0)
        old = health.seconds_per_unit.get(method)
        health.seconds_per_unit[method] = rate if old is None else 0.7 * old + 0.3 * rate

    def timeout(self, peer: PeerID, method: str, units: float) -> float:
        """Generous before the first answer; afterwards a few times the peer's measured speed."""
        rate = self._health(peer).seconds_per_unit.get(method)
        if rate is None:
            return self.first_timeout
        return max(self.min_timeout, 1.0 + 5.0 * rate * max(units, 1.0))

    def usable(self, record: ServerRecord, eligible_only: bool = True) -> bool:
        """Online, not banned, and (unless told otherwise) eligible: holding the adapter at the client's step."""
        return (
            record.state == ServerState.ONLINE
            and self._health(record.peer_id).banned_until <= time.monotonic()
            and (not eligible_only or self.eligible(record.peer_id))
        )

    # --- routes -----------------------------------------------------------------------------------------------

    def replicas(self, block: int, eligible_only: bool = True) -> list[ServerRecord]:
        with self._lock:
            return [r for r in self.servers.get(block, []) if self.usable(r, eligible_only)]

    def live_servers(self, eligible_only: bool = True) -> dict[PeerID, range]:
        """Every usable peer and the span it announces."""
        with self._lock:
            records = [r for records in self.servers.values() for r in records if self.usable(r, eligible_only)]
        return {r.peer_id: range(r.start, r.end) for r in records}

    def announced(self) -> dict[int, list[PeerID]]:
        """Per block, every peer announcing it online (banned or not): who might still hold its state."""
        with self._lock:
            return {
                block: [r.peer_id for r in records if r.state == ServerState.ONLINE]
                for block, records in self.servers.items()
            }

    def uncovered(self, start: int = 0, end: int | None = None, eligible_only: bool = True) -> list[int]:
        end = self.num_blocks if end is None else end
        return [b for b in range(start, end) if not self.replicas(b, eligible_only)]

    def route(self, start: int = 0, end: int | None = None, prefer: PeerID | None = None) -> list[Hop]:
        """Fewest hops; among servers reaching equally far, pick at random weighted by throughput."""
        end = self.num_blocks if end is None else end
        hops: list[Hop] = []
        block = start
        while block < end:
            candidates = self.replicas(block)
            if not candidates:
                raise NoRouteError(f"no live server for blocks {self.uncovered(start, end)}")
            reach = max(min(r.end, end) for r in candidates)
            farthest = [r for r in candidates if min(r.end, end) == reach]
            preferred = [r for r in farthest if r.peer_id == prefer]
            if preferred:
                chosen = preferred[0]
            else:
                chosen = self.random.choices(farthest, weights=[max(r.throughput, 1e-3) for r in farthest])[0]
            hops.append(Hop(chosen.peer_id, block, reach))
            block = reach
        return hops

    def wait_covered(self, patience: float, eligible_only: bool = False) -> None:
        """Wait up to ``patience`` seconds until every block has a live server."""
        self._wait(
            lambda: None if self.uncovered(eligible_only=eligible_only) else True, 0, None, patience, eligible_only
        )

    def wait_route(
        self, start: int = 0, end: int | None = None, prefer: PeerID | None = None, patience: float = 60.0
    ) -> list[Hop]:
        """A route, waiting up to ``patience`` seconds for missing blocks to get a server again."""

        def attempt() -> list[Hop] | None:
            try:
                return self.route(start, end, prefer)
            except NoRouteError:
                return None

        return self._wait(attempt, start, end, patience, eligible_only=True)

    def _wait(self, attempt: Callable, start: int, end: int | None, patience: float, eligible_only: bool):
        result = attempt()
        if result is not None:
            return result
        since = time.monotonic()
        missing = self.uncovered(start, end, eligible_only)
        logger.warning(
            "blocks %s have no live server since %s; waiting up to %.0fs for one to (re)join",
            missing,
            time.strftime("%H:%M:%S"),
            patience,
        )
        while time.monotonic() - since < patience:
            time.sleep(min(1.0, self.min_ban))
            try:
                self.refresh()
                self.on_wait()
            except Exception as e:
                logger.warning("could not refresh the swarm view: %s", e)
            result = attempt()
            if result is not None:
                return result
            missing = self.uncovered(start, end, eligible_only) or missing
        raise SwarmUnavailableError(
            f"blocks {missing} have had no live server for {patience:.0f}s; start a peer serving them "
            f"(swarm peer --blocks {missing[0]}:{missing[-1] + 1} ...) or raise the client's patience"
        )
