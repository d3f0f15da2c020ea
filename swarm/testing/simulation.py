"""A thousand peers, simulated: the real balancer, span choice and router against a simulated DHT and clock.

    .venv/bin/python scripts/simulate_swarm.py          # 100 and 1000 peers, 6 simulated hours, seed 0

(this module is the simulation; the script prints its table and draws its figures)

Real (imported, not copied): a new peer picks its span with ``choose_span``, weighing the throughput
``planned_throughput`` makes of the records; every settled peer runs a balance round every ~5 s and calls
``next_move`` on what ``settled_spans`` makes of the records, span throughputs included, as
``PeerDaemon._balance_round`` does; a move hands its old blocks over only if ``safe_to_drop`` lets it, as
``Mover.move`` does; pipelines come from ``Router.route()``; the records are ``ServerRecord``s in a
``SwarmView``.

Simulated: the DHT (every record is seen by every peer at once: no propagation delay, no expiry), the clock, and the
peers: a capacity in blocks (1-8, so that 100 peers hold ~3.5 copies of an 80-block model, near the 2 the balancer
keeps), a speed, loading (``--load-s`` per new block), churn (exponential lifetimes with a mean of ``--lifetime-h``,
Poisson arrivals at the rate that keeps the population stable, and ``--bursts`` bursts in which 10-20 % of the peers
leave at once). A departure is a crash: pings drop the peer at once, with no handover. A peer's rounds are ``5 s x
U(0.5, 1.5)`` apart, the factor drawn once per peer (the daemon draws it every round). A new peer chooses once (the
daemon looks again after announcing; here no two peers choose at the same instant).

Figures (after the first 15 min, the cold start; PNGs in ``--out``):
- coverage: blocks with an online server (all the time, and all the time the peers' capacity covers the model);
  replication: online servers per block (least served block, mean).
- recovery after a burst: time from the burst until every block has an online server again, and until every block
  has ``--replication`` of them; 0 when the burst broke neither.
- moves and aborted moves (refused by ``safe_to_drop`` after loading) per hour, and the moves started for throughput
  (every block served and the badness unchanged: ``relief_move``); the most moves in one epoch (the time between two
  membership changes: an arrival, a peer coming online, a departure).
- routes: every ``route_s``, the time of a training step of ``micro_batches`` micro-batches, ``in_flight`` at once
  (``swarm.testing.steps``: forward along each chain, backward back, peers working in turn), with each micro-batch
  routed by ``Router.route()`` as it starts (it sees the work routed before it, so micro-batches spread over replicas),
  against the same step with every micro-batch on the widest chain (the chain whose slowest hop is fastest: the best
  single pipeline); tokens/s of the step. Also a single chain's own throughput for a steady stream (the least over
  its hops of the hop's speed, a peer's tokens/s through one block divided by the hop's blocks): the chain the router
  gives one micro-batch with nothing else booked (the fastest for that micro-batch) against the widest.
- placement: ideal: the summed per-block speed of all online peers over the number of blocks, what every block would
  get if compute were spread evenly; capacity: the least over blocks of its servers' summed span throughput, each
  peer's time split evenly over the blocks of its span. capacity / ideal tells how evenly spans spread compute (1:
  perfect); routes need not split a peer's time evenly, so it understates what a placement can deliver (below).
- saturated stream (every ``stream_s``; the script measures it in runs of at most 200 peers): many micro-batches at
  once, ``stream_in_flight`` per serving peer and ``stream_waves`` times that many in all, as a crowd of clients would
  send, each routed by ``Router.route()`` as it starts (one router stands for the crowd: it sees all their work); its
  tokens/s against the ideal's, a micro-batch costing every block a forward and a backward, the fill and the drain of
  the run included. Where the even split of ``capacity`` leaves a peer's time idle on blocks others cover, routes that
  follow the flow plan (``swarm.client.flowplan``) use it; the largest flow (that plan's rate, pipelines always full)
  is what the placement allows any routes, so it is the placement's capacity as routes see it.

Invariants (the exit status is 1 if one fails): no oscillation (a peer choosing to move back to a span it chose to
leave in the same epoch); at most one move per peer of the population in an epoch; no stall (a block without a server
while every peer is settled, their capacity covers the model, and every round says stay); and the stall search:
random placements of heterogeneous spans, played in rounds of ``next_move``, all reach full coverage, with no move that
uncovers a block or raises the badness, and then stop moving (the unit tests also play it with random speeds: every
move for throughput raises the sorted per-block throughputs).

Rounds known to stay are skipped (``SimConfig.exact`` plays them all, to check that this changes nothing): while the
state is unchanged, and while every block has its replicas for every peer but the one ``relief_move`` names.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.p2p import PeerID
from tqdm import tqdm

from peers.balancer import (
    MIN_GAIN,
    RELIEVE_BELOW,
    Snapshot,
    badness,
    block_throughput,
    choose_span,
    next_move,
    relief_move,
    safe_to_drop,
)
from peers.placement import Settled, others_serving, settled_spans
from swarm.net.protocol import PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView
from swarm.testing.simmeter import Burst, Meter, Stats

logger = logging.getLogger(__name__)

MODEL = "simulated-80"
CAPACITIES = (1, 2, 3, 4, 6, 8)  # blocks a peer can hold, and how common each is: 3.1 on average
CAPACITY_WEIGHTS = (0.15, 0.3, 0.25, 0.15, 0.1, 0.05)
SPEED_PER_CAPACITY = 250.0  # median tokens/s through one block, per block of capacity: bigger GPUs are faster
STATE_S = 2.0  # taking the adapter state of a span from a replica
HANDOFF_S = 1.5  # announcing the move and looking again before handing blocks over (Mover.move)
WARMUP_S = 900.0  # the cold start, left out of the summary


@dataclass
class SimConfig:
    """One run: the target population, how long, and the swarm's and peers' parameters (times in seconds)."""

    peers: int = 100
    hours: float = 6.0
    seed: int = 0
    num_blocks: int = 80
    replication: int = 2
    lifetime_h: float = 1.0
    bursts: int = 4
    round_s: float = 5.0
    load_s: float = 10.0
    sample_s: float = 10.0
    route_s: float = 300.0
    micro_batches: int = 16  # in a step whose time is measured every route_s (swarm.testing.steps)
    in_flight: int | None = None  # of them at once; None: as the client's default does (Router.in_flight)
    # every stream_s, a stream that saturates the swarm (many clients' work at once): stream_in_flight micro-batches
    # per server at once, stream_waves times that many in all, routed by Router.route(); 0: not measured (a route
    # costs ~7 ms at 100 peers and ~70 ms at 1000, so a sample takes ~10 s and ~10 min)
    stream_s: float = 0.0
    # a stream saturates only if it keeps the plan's pipelines full: a chain of ~23 hops at 100 peers holds about as
    # many micro-batches as it has hops (Little's law), so 2 per server left them part empty (0.75-0.77 of the ideal
    # with the largest flow at 0.87-0.89) and 4 fill them (0.84-0.85; 8: 0.85-0.86)
    stream_in_flight: int = 4
    stream_waves: int = 8
    # relief_move's rule: a settled peer moves to relieve the weakest block below this fraction of the mean block
    # throughput, if the move lifts the blocks it touches by this gain (the daemon's constants unless swept)
    relieve_below: float = RELIEVE_BELOW
    min_gain: float = MIN_GAIN
    # call next_move in every round of every peer; by default rounds whose answer is known to be "stay" are skipped
    exact: bool = False


@dataclass
class Peer:
    """A simulated peer daemon: its capacity and speed, what it serves, and where it is going."""

    peer_id: PeerID
    capacity: int
    speed: float  # tokens/s through one block
    interval: float  # seconds between balance rounds
    phase: float
    serving: range = range(0)
    joining: range | None = None
    moving_to: range | None = None
    decided: int = -1  # the state version at which its last round chose to stay
    round_pending: bool = False
    asleep: bool = False  # its rounds stopped while every block had its replicas; woken when one lacks them
    left: dict[range, int] = field(default_factory=dict)  # spans it chose to leave -> the membership epoch then

    @property
    def name(self) -> str:
        return self.peer_id.to_base58()

    @property
    def settled(self) -> bool:
        return bool(self.serving) and self.joining is None

    def records(self) -> list[tuple[ServerRecord, list[int]]]:
        """What it announces, and under which blocks, as Announcer.records: online on its span, joining on the
        blocks it is loading."""
        found = []
        if self.serving:
            start, stop, tput = self.serving.start, self.serving.stop, self.speed / len(self.serving)
            online = ServerRecord(self.peer_id, ServerState.ONLINE, start, stop, tput, moving_to=self.moving_to)
            found.append((online, list(self.serving)))
        if self.joining:
            tput = self.speed / len(self.serving) if self.serving else 0.0  # a new peer has not measured itself
            joining = ServerRecord(self.peer_id, ServerState.JOINING, self.joining.start, self.joining.stop, tput)
            found.append((joining, [b for b in self.joining if b not in self.serving]))
        return found


def arrival_rate(config: SimConfig) -> float:
    """Peers arriving per second: what keeps ``config.peers`` present, each staying ``lifetime_h`` on average."""
    return config.peers / (config.lifetime_h * 3600.0)


def new_peer(rng: random.Random, config: SimConfig) -> Peer:
    """A peer drawn from the population: its capacity, speed and balance-round interval and phase."""
    capacity = min(rng.choices(CAPACITIES, CAPACITY_WEIGHTS)[0], config.num_blocks)
    speed = SPEED_PER_CAPACITY * capacity * rng.lognormvariate(0.0, 0.3)
    interval = config.round_s * rng.uniform(0.5, 1.5)
    return Peer(PeerID(rng.randbytes(32)), capacity, speed, interval, rng.uniform(0.0, interval))


class Simulation:
    """An event loop over simulated time; every change of a peer's records goes through `_update`."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self.events: list[tuple[float, int, Callable, tuple]] = []
        self.order = itertools.count()
        self.peers: dict[str, Peer] = {}
        self.alive: dict[PeerID, PeerInfo] = {}
        self.version = 0  # bumped by any change of records
        self.epoch = 0  # bumped by membership changes: arrivals, peers coming online, departures
        n = config.num_blocks
        self.coverage = [0] * n  # online + joining servers per block: what a new peer counts (SwarmView.coverage)
        self.planned = [0] * n  # servers per block, moving peers counted where they go: what the balancer counts
        self.online = [0] * n  # online servers per block: what clients can use
        self.throughput = [0.0] * n  # summed span throughput of the online servers per block
        self.known = [0.0] * n  # the same, moving peers counted where they go, new ones left out
        self.fresh = [0] * n  # new (joining) peers per block, which the balancer counts as the median settled one
        self._view: tuple[int, SwarmView, Settled] | None = None
        self._relieved: tuple[int, str | None] = (-1, None)  # (version, the peer relief_move names then)
        self.stats = Stats()
        self.meter = Meter(self, MODEL)

    # --- the event loop ---------------------------------------------------------------------------------------

    def at(self, when: float, action: Callable, *args) -> None:
        heapq.heappush(self.events, (when, next(self.order), action, args))

    def run(self, progress: bool = False) -> Stats:
        config = self.config
        end = config.hours * 3600.0
        for _ in range(config.peers):
            self.at(self.rng.uniform(0.0, 60.0), self._arrive, False)
        self.at(self.rng.expovariate(arrival_rate(self.config)), self._arrive, True)
        for k in range(config.bursts):
            self.at(WARMUP_S + (end - WARMUP_S) * (k + 0.5) / config.bursts, self._burst)
        self.at(0.0, self.meter.sample)
        self.at(WARMUP_S, self.meter.sample_throughput)
        if config.stream_s > 0:
            self.at(WARMUP_S, self.meter.sample_stream)
        bar = tqdm(total=int(end), unit="sim s", disable=not progress, leave=False, mininterval=1.0)
        while self.events and self.events[0][0] <= end:
            when, _, action, args = heapq.heappop(self.events)
            bar.update(int(when) - bar.n)
            self.now = when
            action(*args)
        bar.close()
        self.meter.check_epochs()
        return self.stats

    # --- the swarm's state ------------------------------------------------------------------------------------

    def _count(self, peer: Peer, sign: int) -> None:
        for b in peer.serving:
            self.online[b] += sign
            self.coverage[b] += sign
            self.throughput[b] += sign * peer.speed / len(peer.serving)
        for b in peer.joining or ():
            if b not in peer.serving:
                self.coverage[b] += sign
        going = peer.serving if peer.joining is None else peer.joining
        for b in going:
            self.planned[b] += sign
            if peer.serving:
                self.known[b] += sign * peer.speed / len(going)
            else:
                self.fresh[b] += sign

    def _update(self, peer: Peer, **changes) -> None:
        self._count(peer, -1)
        for name, value in changes.items():
            setattr(peer, name, value)
        self._count(peer, +1)
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        if self._clean():
            mover = self.peers.get(self._relief() or "")
            waking = [] if mover is None else [mover]
        else:
            waking = list(self.peers.values())
        for peer in waking:
            if peer.asleep:
                peer.asleep = False
                self._schedule_round(peer)
        self.meter.track_bursts()

    def _clean(self) -> bool:
        """Every block has its replicas: no round can move for coverage (no peer holds more than its capacity), only
        the peer `_relief` names can move, for throughput."""
        return badness(self.planned, self.config.replication) == (0, 0)

    def _relief(self) -> str | None:
        """The peer that `relief_move` names in this state, if any (cached per version): the real one, on what
        `settled_spans` makes of the records, unless `_may_relieve` rules every move out."""
        if self._relieved[0] != self.version:
            move = None
            if self._may_relieve():
                config = self.config
                swarm = self._snapshot()[1].snapshot(config.num_blocks, config.replication)
                move = relief_move(swarm, config.relieve_below, config.min_gain)
            self._relieved = (self.version, None if move is None else move[0])
        return self._relieved[1]

    def _may_relieve(self) -> bool:
        """False when `relief_move` is sure to find nothing, told from the running sums (most states, at once): no
        settled peer is fast enough to lift the weakest block by the rule's gain, or that block is not below the rule's
        level of the mean. The margins absorb rounding: the sums are made in another order than the balancer's."""
        rates, level, gain = self._rates(), self.config.relieve_below, self.config.min_gain
        if not rates or max(rates) <= gain * min(self.known) * (1 - 1e-9):
            return False  # `known` leaves new peers out: it is at most the balancer's throughput
        flow = self._planned_throughput(statistics.median(rates))
        floor = min(flow)
        return floor < level * sum(flow) / len(flow) * (1 + 1e-9) and max(rates) > gain * floor * (1 - 1e-9)

    def _rates(self) -> list[float]:
        """The settled peers' span throughputs."""
        return [p.speed / len(p.serving) for p in self.peers.values() if p.settled]

    def _planned_throughput(self, guess: float | None = None) -> list[float]:
        """Per block, the throughput `planned_throughput` makes of the records: a new peer counts as the median
        settled one (`guess`, computed when not given)."""
        if guess is None:
            rates = self._rates()
            guess = statistics.median(rates) if rates else 0.0
        return [known + fresh * guess for known, fresh in zip(self.known, self.fresh, strict=True)]

    def view(self) -> SwarmView:
        return self._snapshot()[0]

    def _snapshot(self) -> tuple[SwarmView, Settled]:
        """The records every peer reads this instant, and what settled_spans makes of them (cached per version)."""
        if self._view is None or self._view[0] != self.version:
            records: dict[int, list[ServerRecord]] = {b: [] for b in range(self.config.num_blocks)}
            for peer in self.peers.values():
                for record, blocks in peer.records():
                    for b in blocks:
                        records[b].append(record)
            view = SwarmView(records, self.alive)
            self._view = (self.version, view, settled_spans(view, self.config.num_blocks))
        return self._view[1], self._view[2]

    # --- peers come and go ------------------------------------------------------------------------------------

    def _arrive(self, poisson: bool) -> None:
        config = self.config
        if poisson:
            self.at(self.now + self.rng.expovariate(arrival_rate(self.config)), self._arrive, True)
        peer = new_peer(self.rng, self.config)
        coverage = dict(enumerate(self.coverage))
        throughput = dict(enumerate(self._planned_throughput()))
        span = choose_span(coverage, config.num_blocks, peer.capacity, config.replication, throughput, self.rng)
        self.peers[peer.name] = peer
        self.alive[peer.peer_id] = PeerInfo(MODEL, span.start, span.stop, ServerState.JOINING.value, 0.0, {}, [])
        self.stats.arrivals += 1
        self.epoch += 1
        self._update(peer, joining=span)
        self.at(self.now + len(span) * config.load_s + STATE_S, self._come_online, peer)
        self.at(self.now + self.rng.expovariate(1.0 / (config.lifetime_h * 3600.0)), self._leave, peer)

    def _present(self, peer: Peer) -> bool:
        return self.peers.get(peer.name) is peer

    def _come_online(self, peer: Peer) -> None:
        if self._present(peer):
            self.epoch += 1
            self._update(peer, serving=peer.joining, joining=None)
            self._schedule_round(peer)

    def _leave(self, peer: Peer) -> None:
        if self._present(peer):
            self._count(peer, -1)
            del self.peers[peer.name], self.alive[peer.peer_id]
            self.stats.departures += 1
            self.epoch += 1
            self._changed()

    def _burst(self) -> None:
        fraction = self.rng.uniform(0.10, 0.20)
        gone = self.rng.sample(sorted(self.peers), round(fraction * len(self.peers)))
        logger.info("t=%.2fh: burst, %d of %d peers leave at once", self.now / 3600, len(gone), len(self.peers))
        for name in gone:
            self._leave(self.peers[name])
        self.stats.bursts.append(Burst(self.now, len(gone)))
        self.meter.track_bursts()

    # --- balance rounds and moves -----------------------------------------------------------------------------

    def _schedule_round(self, peer: Peer) -> None:
        if not peer.round_pending:
            peer.round_pending = True
            # the next of phase + k x interval, always computed so: a woken peer's round falls at the very instant it
            # would have, had it never slept (`when + interval` would round differently)
            k = int((self.now - peer.phase) // peer.interval) + 1
            k += peer.phase + k * peer.interval <= self.now  # float rounding
            self.at(peer.phase + k * peer.interval, self._round, peer)

    def _round(self, peer: Peer) -> None:
        peer.round_pending = False
        if not self._present(peer) or not peer.settled:
            return
        if not self.config.exact and self._clean() and self._relief() != peer.name:
            peer.asleep = True
            return
        if self.config.exact or peer.decided != self.version:
            target = self._decide(peer)
            if target is not None:
                self._start_move(peer, target)
                return
            peer.decided = self.version
        self._schedule_round(peer)

    def _decide(self, peer: Peer) -> range | None:
        config = self.config
        swarm = self._snapshot()[1].snapshot(config.num_blocks, config.replication)
        started = time.perf_counter()
        target = next_move(
            swarm,
            peer.name,
            peer.capacity,
            peer.capacity,
            relieve_below=config.relieve_below,
            min_gain=config.min_gain,
        )
        self.stats.decision_s += time.perf_counter() - started
        self.stats.decisions += 1
        return target

    def _start_move(self, peer: Peer, target: range) -> None:
        if peer.left.get(target) == self.epoch:
            self.stats.failures.append(
                f"oscillation: {peer.name[:8]} chose to move back to {target.start}:{target.stop} at "
                f"t={self.now:.0f}s, with no change in membership since it chose to leave it"
            )
        peer.left[peer.serving] = self.epoch
        self.stats.moves_per_epoch[self.epoch] = self.stats.moves_per_epoch.get(self.epoch, 0) + 1
        before = badness(self.planned, self.config.replication)
        self._update(peer, joining=target)
        # every block served, badness unchanged: not for coverage nor replicas, so for throughput (relief_move)
        self.stats.relief += before[0] == 0 and badness(self.planned, self.config.replication) == before
        loading = sum(1 for b in target if b not in peer.serving) * self.config.load_s + STATE_S
        self.at(self.now + loading, self._loaded, peer)

    def _loaded(self, peer: Peer) -> None:
        if not self._present(peer):
            return
        if all(b in peer.joining for b in peer.serving):
            self._finish_move(peer)
            return
        self._update(peer, moving_to=peer.joining)
        self.at(self.now + HANDOFF_S, self._hand_over, peer)

    def _hand_over(self, peer: Peer) -> None:
        if not self._present(peer):
            return
        view = self.view()
        handed_over = [b for b in peer.serving if b not in peer.joining]
        if all(safe_to_drop(b, others_serving(view, b, peer.peer_id), peer.name) for b in handed_over):
            self._finish_move(peer)
            return
        self.stats.aborted += 1
        self._update(peer, joining=None, moving_to=None)
        self._schedule_round(peer)

    def _finish_move(self, peer: Peer) -> None:
        self.stats.moves.append((self.now, peer.name, peer.serving, peer.joining))
        self._update(peer, serving=peer.joining, joining=None, moving_to=None)
        self._schedule_round(peer)


# --- the stall search ---------------------------------------------------------------------------------------------


def settle(
    spans: dict[str, range],
    num_blocks: int,
    replication: int,
    rng: random.Random,
    max_rounds: int = 100,
    speeds: dict[str, float] | None = None,
) -> dict[str, range]:
    """Play balance rounds (each peer in random order, moving at once) until nobody moves; returns the final spans,
    or raises AssertionError when a move uncovers a block or raises the badness, or it never settles. With `speeds`
    (peer -> span throughput), a move that keeps the badness while every block has a server must raise the sorted
    per-block throughputs (the weakest block first): the potential that keeps moves for throughput from cycling."""
    spans = dict(spans)
    for _ in range(max_rounds):
        moved = False
        for me in rng.sample(sorted(spans), len(spans)):
            counts = _counts(spans, num_blocks)
            target = next_move(
                Snapshot(spans, num_blocks, replication, speeds=speeds), me, len(spans[me]), len(spans[me])
            )
            if target is None:
                continue
            assert all(counts[b] > 1 for b in spans[me] if b not in target), f"{me} uncovers a block: {spans}"
            before, flow = badness(counts, replication), _sorted_flow(spans, num_blocks, speeds)
            spans[me] = target
            after = badness(_counts(spans, num_blocks), replication)
            assert after <= before, f"{me} made it worse: {spans}"
            if speeds is not None and after == before and 0 not in counts:
                assert _sorted_flow(spans, num_blocks, speeds) > flow, f"{me} gained no throughput: {spans}"
            moved = True
        if not moved:
            return spans
    raise AssertionError(f"still moving after {max_rounds} rounds: {spans}")


def _sorted_flow(spans: dict[str, range], num_blocks: int, speeds: dict[str, float] | None) -> list[float]:
    return sorted(block_throughput(spans, speeds or {}, num_blocks))


def _counts(spans: dict[str, range], num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for span in spans.values():
        for b in span:
            counts[b] += 1
    return counts


def random_swarm(rng: random.Random, num_blocks: int, max_len: int) -> dict[str, range]:
    """Random spans of random lengths, at least `num_blocks` blocks in all."""
    spans, total = {}, 0
    while total < num_blocks or rng.random() < 0.3:
        length = rng.randint(1, min(num_blocks, max_len))
        start = rng.randint(0, num_blocks - length)
        spans[f"peer-{len(spans):03d}"] = range(start, start + length)
        total += length
    return spans


def stall_search(cases: int, seed: int, random_speeds: bool = False) -> list[str]:
    """Random placements that enough capacity can cover: every one must settle with every block served. With
    `random_speeds`, each peer has a random span throughput and may also move for it."""
    rng, failures = random.Random(seed), []
    for _ in range(cases):
        num_blocks, replication = rng.randint(2, 80), rng.randint(1, 3)
        spans = random_swarm(rng, num_blocks, rng.choice((2, 4, 8)))
        speeds = {peer: 100.0 * rng.lognormvariate(0.0, 0.5) for peer in spans} if random_speeds else None
        try:
            final = settle(spans, num_blocks, replication, rng, speeds=speeds)
            assert 0 not in _counts(final, num_blocks), f"stalled at {final}"
        except AssertionError as e:
            failures.append(f"{num_blocks} blocks, R={replication}, from {spans}: {e}")
    return failures


# --- report -------------------------------------------------------------------------------------------------------


def summary(config: SimConfig, stats: Stats, wall_s: float) -> dict[str, str]:
    """The printed figures of one run; coverage and replication leave the cold start out."""
    after = [s for s in stats.samples if s.at >= WARMUP_S] or stats.samples
    n = config.num_blocks
    tput = [t for t in stats.throughput if t.best > 0]
    return {
        "peers (mean)": f"{_mean(s.peers for s in after):.0f}",
        "arrivals / departures": f"{stats.arrivals} / {stats.departures}",
        "peers leaving in each burst": ", ".join(str(b.left) for b in stats.bursts) or "-",
        "time fully covered": f"{100 * _mean(s.uncovered == 0 for s in after):.2f} %",
        "  of the time capacity allows": f"{100 * _mean(s.uncovered == 0 for s in after if s.capacity >= n):.2f} %",
        "time every block >= R": f"{100 * _mean(s.thin == 0 for s in after):.2f} %",
        "min / mean replication": f"{min(s.least for s in after)} / {_mean(s.mean for s in after):.1f}",
        "blocks a burst uncovered": ", ".join(str(b.worst_uncovered) for b in stats.bursts) or "-",
        "coverage back after (s)": ", ".join(_since(b, b.covered_at) for b in stats.bursts) or "-",
        "every block >= R after (s)": ", ".join(_since(b, b.replicated_at) for b in stats.bursts) or "-",
        "moves / hour": f"{len(stats.moves) / config.hours:.1f}",
        "aborted moves / hour": f"{stats.aborted / config.hours:.1f}",
        "moves for throughput / hour": f"{stats.relief / config.hours:.1f}",
        "most moves in one epoch": str(max(stats.moves_per_epoch.values(), default=0)),
        f"step of {config.micro_batches}, routed / widest chain": f"{_mean(t.routed / t.widest for t in tput):.2f}",
        "step, routed (tokens/s)": f"{_mean(t.routed for t in tput):.0f}",
        "one chain alone / widest (stream)": f"{_mean(t.alone / t.best for t in tput):.2f}",
        "capacity / ideal (even split)": f"{_mean(t.capacity / t.ideal for t in tput):.2f}",
        f"saturated stream ({config.stream_in_flight} per server), routed / ideal": _stream_mean(stats, "routed"),
        "  the largest flow / ideal": _stream_mean(stats, "bound"),
        "next_move calls (ms each)": f"{stats.decisions} ({1000 * stats.decision_s / max(1, stats.decisions):.2f})",
        "wall time (s)": f"{wall_s:.0f}",
        "invariants": "ok" if not stats.failures else f"{len(stats.failures)} FAILED",
    }


def _since(burst: Burst, at: float | None) -> str:
    return "never" if at is None else f"{at - burst.at:.0f}"


def _stream_mean(stats: Stats, field: str) -> str:
    """The mean over the stream samples of ``field`` (a ``Stream`` field) against the ideal, or "-" if none."""
    if not stats.streams:
        return "-"
    return f"{_mean(getattr(st, field) / st.ideal for st in stats.streams):.2f}"


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0
