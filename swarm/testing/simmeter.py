"""The simulation's measurements (``swarm.testing.simulation``): coverage samples, the tokens/s that routes get out of
a placement, a saturating stream's, and how fast the swarm recovers from a burst of departures; what
``Simulation.run`` returns (``Stats``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from hivemind.p2p import PeerID

from swarm.client.flowplan import Server, plan_flow
from swarm.client.routing import NoRouteError, Router, RouterOptions
from swarm.net.view import SwarmView
from swarm.testing.steps import step_seconds

STREAM_BACKWARD_COST = 2.0  # a backward costs two forwards (``step_seconds``' default)


@dataclass
class Burst:
    """Peers leaving at once, and when the swarm was whole again."""

    at: float
    left: int
    worst_uncovered: int = 0
    covered_at: float | None = None
    replicated_at: float | None = None


class Sample(NamedTuple):
    at: float
    peers: int
    uncovered: int  # blocks without an online server
    thin: int  # blocks with fewer than R online servers
    least: int  # online servers of the least served block
    mean: float  # online servers per block
    capacity: int  # blocks the peers present can hold in all


class Throughput(NamedTuple):
    at: float
    routed: float  # tokens/s of a step routed by Router.route(), micro-batch by micro-batch
    widest: float  # tokens/s of the same step with every micro-batch on the widest chain
    alone: float  # tokens/s of a steady stream through the chain Router.route() gives one micro-batch alone
    best: float  # tokens/s of a steady stream through the widest chain
    capacity: float
    ideal: float


class Stream(NamedTuple):
    """A saturating stream's tokens/s, routed and as the largest flow allows, and the ideal's
    (``Meter.sample_stream``)."""

    at: float
    routed: float
    bound: float
    ideal: float


@dataclass
class Stats:
    samples: list[Sample] = field(default_factory=list)
    throughput: list[Throughput] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    moves: list[tuple[float, str, range, range]] = field(default_factory=list)
    aborted: int = 0
    relief: int = 0  # moves started for throughput
    arrivals: int = 0
    departures: int = 0
    decisions: int = 0
    decision_s: float = 0.0
    bursts: list[Burst] = field(default_factory=list)
    moves_per_epoch: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class Measured(Protocol):
    """What the meter reads of the simulation, as it runs."""

    config: Any
    now: float
    version: int
    peers: dict[str, Any]
    online: list[int]
    planned: list[int]
    throughput: list[float]
    stats: Stats

    def at(self, when: float, action: Callable, *args) -> None: ...

    def view(self) -> SwarmView: ...


class _NoTransport:
    """The router asks the transport whether a peer's process is gone; in the simulation departed peers have no
    records, so none is."""

    def is_gone(self, peer: PeerID) -> bool:
        return False

    def learn(self, records: object) -> None:
        pass


class Meter:
    """The simulation's measurements, each an event of its own (``sample*``) or called as the swarm changes; one
    router stands for the clients (``route_clock``: the time within a measured step at which it routes)."""

    def __init__(self, sim: Measured, model: str):
        self.sim = sim
        config = sim.config
        self.router = Router(
            None,
            _NoTransport(),
            model,
            config.num_blocks,
            RouterOptions(seed=config.seed),
            clock=lambda: self.route_clock,
        )
        self.route_clock = 0.0

    def track_bursts(self) -> None:
        holes, least = self.sim.online.count(0), min(self.sim.online)
        for burst in self.sim.stats.bursts:
            if burst.covered_at is None:
                burst.worst_uncovered = max(burst.worst_uncovered, holes)
                burst.covered_at = self.sim.now if holes == 0 else None
            if burst.replicated_at is None and least >= self.sim.config.replication:
                burst.replicated_at = self.sim.now

    def check_epochs(self) -> None:
        """Between two membership changes every move makes the swarm better, so the moves run out: a peer has little
        reason to move twice."""
        for epoch, moves in self.sim.stats.moves_per_epoch.items():
            if moves > self.sim.config.peers:
                self.sim.stats.failures.append(f"{moves} moves between two membership changes (epoch {epoch})")

    def sample(self) -> None:
        self.sim.at(self.sim.now + self.sim.config.sample_s, self.sample)
        online = self.sim.online
        holes = online.count(0)
        thin = sum(1 for c in online if c < self.sim.config.replication)
        capacity = sum(p.capacity for p in self.sim.peers.values())
        mean = sum(online) / len(online)
        self.sim.stats.samples.append(
            Sample(self.sim.now, len(self.sim.peers), holes, thin, min(online), mean, capacity)
        )
        if self._stalled(capacity):
            self.sim.stats.failures.append(f"stall at t={self.sim.now:.0f}s: blocks without a server and nobody moves")

    def _stalled(self, capacity: int) -> bool:
        if 0 not in self.sim.planned or capacity < self.sim.config.num_blocks:
            return False
        return all(p.settled and not p.asleep and p.decided == self.sim.version for p in self.sim.peers.values())

    def sample_throughput(self) -> None:
        self.sim.at(self.sim.now + self.sim.config.route_s, self.sample_throughput)
        config, view = self.sim.config, self.sim.view()
        speeds = {p.peer_id: p.speed for p in self.sim.peers.values()}
        ideal = sum(speeds[p.peer_id] for p in self.sim.peers.values() if p.serving) / config.num_blocks
        widest = widest_chain(view, speeds, config.num_blocks)
        if widest is None:
            self.sim.stats.throughput.append(
                Throughput(self.sim.now, 0.0, 0.0, 0.0, 0.0, min(self.sim.throughput), ideal)
            )
            return
        self.router.servers, self.router.busy_until = view.records, {}  # a new step: no work booked yet
        tokens = self.router.options.tokens

        def hops(chain: list[tuple[PeerID, int]]) -> list[tuple[PeerID, float]]:
            return [(peer, blocks * tokens / speeds[peer]) for peer, blocks in chain]

        def routed_at(at: float) -> list[tuple[PeerID, float]]:
            self.route_clock = at
            return hops([(h.peer_id, len(h.blocks)) for h in self.router.route()])

        in_flight = config.in_flight or self.router.in_flight()

        def step_rate(chain_at) -> float:
            return config.micro_batches * tokens / step_seconds(chain_at, config.micro_batches, in_flight)

        routed = step_rate(routed_at)
        alone = 0.0
        with contextlib.suppress(NoRouteError):  # one micro-batch with nothing else booked
            self.router.busy_until = {}
            alone = min(speeds[h.peer_id] / len(h.blocks) for h in self.router.route())
        on_widest = step_rate(lambda at: hops(widest))
        best = min(speeds[peer] / blocks for peer, blocks in widest)
        self.sim.stats.throughput.append(
            Throughput(self.sim.now, routed, on_widest, alone, best, min(self.sim.throughput), ideal)
        )

    def sample_stream(self) -> None:
        """The tokens/s of training micro-batches pushed through the swarm as fast as it takes them, every one
        routed by ``Router.route()`` as it starts, against the ideal: every online peer's speed spread evenly over the
        blocks, a micro-batch costing each block a forward and a backward (``1 + backward_cost`` forwards)."""
        self.sim.at(self.sim.now + self.sim.config.stream_s, self.sample_stream)
        config, view = self.sim.config, self.sim.view()
        serving = [p for p in self.sim.peers.values() if p.serving]
        if any(not view.online(b) for b in range(config.num_blocks)):
            return
        speeds = {p.peer_id: p.speed for p in serving}
        self.router.servers, self.router.busy_until = view.records, {}
        tokens = self.router.options.tokens

        def routed_at(at: float) -> list[tuple[PeerID, float]]:
            self.route_clock = at
            return [(h.peer_id, len(h.blocks) * tokens / speeds[h.peer_id]) for h in self.router.route()]

        in_flight = config.stream_in_flight * len(serving)
        micro_batches = config.stream_waves * in_flight
        routed = micro_batches * tokens / step_seconds(routed_at, micro_batches, in_flight, STREAM_BACKWARD_COST)
        ideal = sum(speeds.values()) / config.num_blocks / (1.0 + STREAM_BACKWARD_COST)
        servers = [Server(p.peer_id, p.serving.start, p.serving.stop, tokens / p.speed) for p in serving]
        plan = plan_flow(servers, 0, config.num_blocks)
        bound = plan.rate * tokens / (1.0 + STREAM_BACKWARD_COST) if plan else 0.0
        self.sim.stats.streams.append(Stream(self.sim.now, routed, bound, ideal))


def widest_chain(view: SwarmView, speeds: dict[PeerID, float], num_blocks: int) -> list[tuple[PeerID, int]] | None:
    """The chain of online servers through blocks [0, n) whose slowest hop is fastest: the best pipeline for a steady
    stream of micro-batches (dynamic programming from the last block back), as (peer, blocks) hops; None if some block
    has no server."""
    best: list[float] = [0.0] * num_blocks + [float("inf")]
    step: list[tuple[PeerID, int] | None] = [None] * num_blocks
    for b in range(num_blocks - 1, -1, -1):
        for r in view.online(b):
            for end in range(b + 1, min(r.end, num_blocks) + 1):
                rate = min(speeds[r.peer_id] / (end - b), best[end])
                if rate > best[b]:
                    best[b], step[b] = rate, (r.peer_id, end)
    if step[0] is None:
        return None
    chain, b = [], 0
    while b < num_blocks:
        peer, end = step[b]
        chain.append((peer, end - b))
        b = end
    return chain
