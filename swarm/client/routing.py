"""Pick chains of live peers over blocks, from the DHT's announcements; ban failing peers with backoff."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.blocks import spans_text
from swarm.client.flowplan import FlowPlan, Server, plan_flow
from swarm.client.links import LinkCosts, link_costs
from swarm.client.paths import Candidate, PlannedHop, fastest_chain
from swarm.client.viewrefresh import ViewRefresh
from swarm.net.errors import PEER_ERRORS, SwarmError, SwarmUnavailableError
from swarm.net.protocol import Method
from swarm.net.records import ServerRecord, ServerState, read_servers
from swarm.net.transport import Transport
from swarm.net.view import same_weights
from swarm.net.waiting import Deadline, WaitLine

logger = logging.getLogger(__name__)


class NoRouteError(SwarmError, RuntimeError):
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


@dataclass
class PeerHealth:
    """What the client learned about one peer: failures in a row (since when), ban, and its speed per method: from
    request to answer (what timeouts allow for), and computing alone (what routes are chosen by: the wait before is
    work already given to the peer, which the router counts apart)."""

    failures: int = 0
    failing_since: float | None = None
    banned_until: float = 0.0
    seconds_per_unit: dict[str, float] = field(default_factory=dict)
    compute_per_unit: dict[str, float] = field(default_factory=dict)

    def written_off(self, now: float) -> bool:
        """Banned at ``now`` and silent since: for good, or for a while after failing (one that answered a call
        since its ban is alive, whatever the ban's time left)."""
        return self.banned_until == float("inf") or (self.banned_until > now and self.failing_since is not None)


# Small requests that never wait for compute beyond a moment: a peer that does not answer them within this time is
# not worth waiting for (a dial to a dead address would otherwise take libp2p ~20 s to give up).
CONTROL_METHODS = frozenset({Method.OPEN, Method.INFO, Method.DIGEST, Method.REPLICATE, Method.FAST_FORWARD})
FIRST_CONTROL_TIMEOUT = 10.0
MIN_IN_FLIGHT, MAX_IN_FLIGHT = 4, 32  # micro-batches of a step in the swarm at once, when the user does not say
MIN_COMPUTE_SHARE = 0.25  # the least share of a hop's measured time a peer's own word on its compute time is taken for
UNKNOWN_SPEED = 1e-3  # tokens/s assumed of a server that announces none: routed to only when nothing else serves
# a stream saturates the swarm when even the fastest chain would keep a micro-batch waiting, behind work already
# routed, more than twice as long as it computes: then routes follow the flow plan (Router._follow_plan). At 1x the
# simulation's step of 16 (16 in flight at 100 peers) lost 1.5 % to plan chains; at 2x it is unchanged
SATURATED = 2.0
PLAN_SPEED_STEP = 1.1  # a flow plan is made again when a server's speed moves by more than this factor


@dataclass(frozen=True)
class RouterOptions:
    """How a router waits, bans and estimates. ``unreachable_wait``: how long a silent but connected peer counts as a
    possible holder of state; ``first_timeout`` / ``min_timeout``: a request's timeout before a peer's first answer,
    and the least after it; ``min_ban`` / ``max_ban``: a failing peer's first ban, doubled with each failure in a row
    up to the most; ``refresh_every``: seconds between reads of the DHT; ``seed``: the shuffle that lets equally fast
    servers share the work; ``tokens``: the size of a micro-batch routes are estimated for; ``hop_seconds``: the
    latency of passing activations to the next peer while no peer announces a measured link; ``bytes_per_token``:
    what one token's activations weigh on the wire (hidden size x bytes per value), carried over each link;
    ``chained``: hops pass activations peer to peer, over the links peers announce (else every hop goes through the
    client's own link, unmeasured); ``work_per_forward``: how long a peer is kept busy by one micro-batch, in forwards
    of it (a backward takes about two)."""

    unreachable_wait: float = 30.0
    first_timeout: float = 60.0
    min_timeout: float = 2.0
    min_ban: float = 2.0
    max_ban: float = 120.0
    refresh_every: float = 3.0
    seed: int | None = None
    tokens: int = 1024
    hop_seconds: float = 0.01
    bytes_per_token: float = 0.0
    chained: bool = True
    work_per_forward: float = 3.0


class Router:
    """The client's view of who serves what, refreshed from the DHT in the background, and the chains it routes
    micro-batches over: the fastest for each micro-batch, given the work already sent to each peer.

    Peers whose process is gone (the transport saw their connection close) are left out at once, whatever their
    records still say, until they announce again. A peer that stopped answering but keeps its connection (frozen,
    overloaded) may still hold state: it counts as a possible holder for ``unreachable_wait`` seconds.
    """

    def __init__(
        self,
        dht: DHT,
        transport: Transport,
        model: str,
        num_blocks: int,
        options: RouterOptions | None = None,
        *,
        eligible: Callable[[PeerID], bool] = lambda peer: True,
        on_moved: Callable[[PeerID], None] = lambda peer: None,
        weights: dict[int, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``options``: how it waits, bans and estimates (``RouterOptions``; its defaults without one); ``clock``: the
        time work drains by (a simulation's)."""
        self.dht, self.transport, self.model, self.num_blocks = dht, transport, model, num_blocks
        self.options, self.clock = options or RouterOptions(), clock
        self.activation_bytes = self.options.tokens * self.options.bytes_per_token
        self.servers: dict[int, list[ServerRecord]] = {}
        self.health: dict[PeerID, PeerHealth] = {}
        self.eligible = eligible  # whether a peer may be routed to (it holds the adapter at the client's step)
        # a peer that serves other blocks than at the last refresh (it moved, joined more, or took some over): the
        # step of its new blocks is not known, so whoever tracks steps checks it again before it is routed to
        self.on_moved = on_moved
        # block -> the digest of the base weights the adapter trains on; blocks not pinned yet are pinned by the first
        # announcements seen (a client whose folder holds no block tensors); peers with other weights are left out
        self.weights: dict[int, str] = dict(weights or {})
        self.random = random.Random(self.options.seed)
        self.busy_until: dict[PeerID, float] = {}  # when the work this client routed to each peer should be done
        # the flow plan saturated streams follow (see route()), what it was made for, and each chain's credit
        self._plan: tuple[tuple, FlowPlan | None, list[float]] | None = None
        self._lock = threading.Lock()
        self._booking = threading.Lock()  # micro-batches in flight route at once: each sees the others' work
        # the view refreshed in the background (started by whoever owns the router: a simulation's never is)
        self.refresher = ViewRefresh(self.refresh, self.options.refresh_every)

    # --- the swarm's view -------------------------------------------------------------------------------------

    @property
    def servers(self) -> dict[int, list[ServerRecord]]:
        """Every announcement per block, as of the last refresh."""
        return self._servers

    @servers.setter
    def servers(self, servers: dict[int, list[ServerRecord]]) -> None:
        """A new view, and what each link it announces costs, worked out once per view (a simulation sets views
        here too)."""
        self._servers = servers
        records = (r for records in servers.values() for r in records) if self.options.chained else ()
        self.links: LinkCosts = link_costs(records, self.activation_bytes, self.options.hop_seconds)

    def refresh(self) -> None:
        servers = read_servers(self.dht, self.model, self.num_blocks)
        self._pin(servers)
        servers = same_weights(servers, self.weights)
        self.transport.learn(r for records in servers.values() for r in records)
        with self._lock:
            before, self.servers = _online_blocks(self.servers), servers
        after = _online_blocks(servers)
        for peer in sorted(before.keys() & after.keys(), key=lambda p: p.to_bytes()):
            if before[peer] != after[peer]:
                was, now = spans_text(sorted(before[peer])), spans_text(sorted(after[peer]))
                logger.info("peer %s now serves blocks %s (was %s)", peer, now, was)
                self.on_moved(peer)

    def _pin(self, servers: dict[int, list[ServerRecord]]) -> None:
        """Pin the blocks not pinned yet to the digest most of their online servers announce."""
        learned = {}
        for block, records in servers.items():
            counts = Counter(r.digests[block] for r in records if r.state == ServerState.ONLINE and block in r.digests)
            if block in self.weights or not counts:
                continue
            ranked = counts.most_common()
            if len(ranked) > 1:
                logger.warning(
                    "block %d is served from %d different base weights under the name %r; training on the most "
                    "served (%d of %d peers). Load the model folder with its weights to pin the right ones",
                    block,
                    len(ranked),
                    self.model,
                    ranked[0][1],
                    sum(counts.values()),
                )
            learned[block] = ranked[0][0]
        if learned:
            logger.info("pinned the base weights of blocks %s to what their peers announce", spans_text(learned))
            self.weights.update(learned)

    # --- health -----------------------------------------------------------------------------------------------

    def _health(self, peer: PeerID) -> PeerHealth:
        return self.health.setdefault(peer, PeerHealth())

    def ban(self, peer: PeerID, reason: str) -> float:
        """Stop using a peer for a while; each failure in a row doubles the ban (capped)."""
        health = self._health(peer)
        health.failures += 1
        if health.failing_since is None:
            health.failing_since = time.monotonic()
        seconds = min(self.options.max_ban, self.options.min_ban * 2 ** (health.failures - 1))
        health.banned_until = time.monotonic() + seconds
        logger.warning("peer %s failed (%s); banned for %.0fs", peer, reason, seconds)
        return seconds

    def distrust(self, peer: PeerID, reason: str) -> None:
        """Never use this peer again in this client (it returned results its replicas disagree with)."""
        self._health(peer).banned_until = float("inf")
        logger.error("peer %s is banned for good: %s", peer, reason)

    def succeeded(
        self, peer: PeerID, method: str, units: float, seconds: float | None, compute: float | None = None
    ) -> None:
        """The peer answered; ``seconds`` (None: not known, the answer of a whole chain) it took for ``units``, of
        them ``compute`` computing (None: it did not say)."""
        health = self._health(peer)
        health.failures, health.failing_since = 0, None
        for measured, rates in ((seconds, health.seconds_per_unit), (compute, health.compute_per_unit)):
            if measured is not None:
                rate = measured / max(units, 1.0)
                old = rates.get(method)
                rates[method] = rate if old is None else 0.7 * old + 0.3 * rate

    def timeout(self, peer: PeerID, method: str, units: float) -> float:
        """Generous before the first answer; afterwards a few times the peer's measured speed, plus the work this
        client has routed to it and not seen done (the request waits behind it: a slow replica sent its share is
        loaded, not failing). A peer that died or froze meanwhile is found by the call's watch, not by this."""
        rate = self._health(peer).seconds_per_unit.get(method)
        if rate is None:
            return (
                min(self.options.first_timeout, FIRST_CONTROL_TIMEOUT)
                if method in CONTROL_METHODS
                else self.options.first_timeout
            )
        queued = max(0.0, self.busy_until.get(peer, 0.0) - self.clock())
        return max(self.options.min_timeout, 1.0 + 5.0 * rate * max(units, 1.0) + queued)

    def usable(self, record: ServerRecord, eligible_only: bool = True) -> bool:
        """Online, not gone, not banned, and (unless told otherwise) eligible: holding the adapter at the client's
        step."""
        return (
            record.state == ServerState.ONLINE
            and not self.transport.is_gone(record.peer_id)
            and self._health(record.peer_id).banned_until <= time.monotonic()
            and (not eligible_only or self.eligible(record.peer_id))
        )

    # --- routes -----------------------------------------------------------------------------------------------

    def replicas(self, block: int, eligible_only: bool = True) -> list[ServerRecord]:
        with self._lock:
            return [r for r in self.servers.get(block, []) if self.usable(r, eligible_only)]

    def _usable_servers(self, start: int, end: int) -> dict[PeerID, ServerRecord]:
        """Each usable server of blocks [start, end) and its record, each peer looked at once it is found usable
        (a record stands under each of its blocks: looking at every block's replicas cost most of a route's time at
        1000 peers)."""
        found: dict[PeerID, ServerRecord] = {}
        with self._lock:
            for block in range(start, end):
                for record in self.servers.get(block, []):
                    if record.peer_id not in found and self.usable(record):
                        found[record.peer_id] = record
        return found

    def live_servers(self, eligible_only: bool = True) -> dict[PeerID, range]:
        """Every usable peer and the span it announces."""
        with self._lock:
            records = [r for records in self.servers.values() for r in records if self.usable(r, eligible_only)]
        return {r.peer_id: range(r.start, r.end) for r in records}

    def may_hold_state(self, peer: PeerID) -> bool:
        """Whether a peer that announces blocks may still hold their state: not gone, and not silent for longer
        than ``unreachable_wait`` (a frozen or partitioned peer is waited for that long, no longer)."""
        if self.transport.is_gone(peer):
            return False
        since = self._health(peer).failing_since
        return since is None or time.monotonic() - since < self.options.unreachable_wait

    def announced(self) -> dict[int, list[PeerID]]:
        """Per block, every peer announcing it online (banned or not) that may still hold its state."""
        with self._lock:
            return {
                block: [r.peer_id for r in records if r.state == ServerState.ONLINE and self.may_hold_state(r.peer_id)]
                for block, records in self.servers.items()
            }

    def in_flight(self, tokens: int | None = None) -> int:
        """How many micro-batches of a step to keep in the swarm at once: two per usable server, so that each has
        the next one waiting while another travels (with one per server, replicas added made no step faster: each
        micro-batch spends most of its time on the other hops), at least ``MIN_IN_FLIGHT``, at most
        ``MAX_IN_FLIGHT``; and, for micro-batches of ``tokens`` (batch x length), no more than the servers of any
        block admit together by the bounds they announce (``--max-tokens-in-flight``), at least one."""
        count = max(MIN_IN_FLIGHT, min(MAX_IN_FLIGHT, 2 * len(self.live_servers())))
        room = None if tokens is None else self.admitted(tokens)
        return count if room is None else max(1, min(count, room))

    def admitted(self, tokens: int) -> int | None:
        """The fewest micro-batches of ``tokens`` that the usable servers of a block admit in flight together, over
        the blocks whose servers all announce a bound (None: no block's do). Other clients' micro-batches count
        against the same bounds: a peer refuses what passes its bound, and the client routes around it."""
        with self._lock:
            bounds = [[r.max_tokens_in_flight for r in records if self.usable(r)] for records in self.servers.values()]
        rooms = [sum(bound // max(1, tokens) for bound in block) for block in bounds if block and all(block)]
        return min(rooms, default=None)

    def uncovered(self, start: int = 0, end: int | None = None, eligible_only: bool = True) -> list[int]:
        end = self.num_blocks if end is None else end
        return [b for b in range(start, end) if not self.replicas(b, eligible_only)]

    def route(self, start: int = 0, end: int | None = None, prefer: PeerID | None = None) -> list[Hop]:
        """The chain that should finish a micro-batch earliest (``paths.fastest_chain``), and its work booked on its
        peers, so that the next micro-batch in flight goes to other replicas while these are busy: micro-batches
        spread over a span's servers in proportion to their speed, and a slow peer gets less work, not none. A hop
        costs its peer's compute and the transfer from the hop before, over the link that one measured to it
        (``swarm.client.links``). ``prefer`` (it holds this micro-batch's state, or the chain before could not
        reach it) costs no compute. When even the fastest chain would wait behind booked work more than twice what it
        computes (a saturated stream), micro-batches follow the swarm's flow plan instead (``_follow_plan``)."""
        end = self.num_blocks if end is None else end
        records = self._usable_servers(start, end)
        with self._booking:
            now, links = self.clock(), self.links
            candidates = [self._candidate(r, now, prefer, links) for r in records.values()]
            self.random.shuffle(candidates)  # equally fast servers share the work
            planned = fastest_chain(candidates, start, end)
            if planned is None:
                raise NoRouteError(f"no live server for blocks {self.uncovered(start, end)}")
            computing = sum(hop.finishes - hop.begins for hop in planned)
            if prefer is None and _queued(planned, candidates) > SATURATED * computing:
                followed = self._follow_plan(candidates, start, end, now)
                if followed is not None:
                    return followed
            for hop in planned:
                work = (hop.finishes - hop.begins) * self.options.work_per_forward
                self.busy_until[hop.peer_id] = now + hop.begins + work
        return [Hop(hop.peer_id, hop.start, hop.end) for hop in planned]

    def _follow_plan(self, candidates: list[Candidate], start: int, end: int, now: float) -> list[Hop] | None:
        """The stream saturates the servers: what counts is how many micro-batches go through, not how soon this one
        does. Route it over the flow plan's next chain (``swarm.client.flowplan``), each chain taking its share of
        micro-batches in turn (smooth weighted round robin), so that servers get work where it is needed, in
        proportion to their speed. None if no plan covers the blocks."""
        made_for = (start, end) + tuple(
            sorted((c.peer_id.to_bytes(), c.start, c.end, _speed_step(c.block_seconds)) for c in candidates)
        )
        if self._plan is None or self._plan[0] != made_for:
            servers = [Server(c.peer_id, c.start, c.end, c.block_seconds) for c in candidates]
            plan = plan_flow(servers, start, end)
            self._plan = (made_for, plan, [0.0] * (len(plan.chains) if plan else 0))
        _, plan, credit = self._plan
        if plan is None:
            return None
        for i, chain in enumerate(plan.chains):
            credit[i] += chain.rate
        chosen = max(range(len(credit)), key=credit.__getitem__)
        credit[chosen] -= plan.rate
        seconds = {c.peer_id: c.block_seconds for c in candidates}
        hops = [Hop(peer, a, c) for peer, a, c in plan.chains[chosen].hops]
        for hop in hops:
            queued_until = max(now, self.busy_until.get(hop.peer_id, now))
            self.busy_until[hop.peer_id] = (
                queued_until + len(hop.blocks) * seconds[hop.peer_id] * self.options.work_per_forward
            )
        return hops

    def block_seconds(self, record: ServerRecord) -> float:
        """Compute time of one block of a micro-batch on this server: what it said its forwards took computing, else
        what the client measured of them (its queue and link included), else what it announces (its tokens/s through
        its whole span)."""
        health = self._health(record.peer_id)
        measured = health.seconds_per_unit.get(Method.FORWARD)
        said = health.compute_per_unit.get(Method.FORWARD)
        if said is not None and measured is not None:
            # believed down to a part of what the client measured: a peer claiming to compute in no time would
            # otherwise be sent every micro-batch
            return max(said, measured * MIN_COMPUTE_SHARE) * self.options.tokens
        if measured is not None:
            return measured * self.options.tokens
        return self.options.tokens / (max(record.throughput, UNKNOWN_SPEED) * (record.end - record.start))

    def _candidate(self, record: ServerRecord, now: float, prefer: PeerID | None, links: LinkCosts) -> Candidate:
        into = links.into.get(record.peer_id, {})
        if record.peer_id == prefer:
            return Candidate(record.peer_id, record.start, record.end, 0.0, 0.0, links.default, into)
        busy_for = max(0.0, self.busy_until.get(record.peer_id, now) - now)
        block_seconds = self.block_seconds(record)
        return Candidate(record.peer_id, record.start, record.end, block_seconds, busy_for, links.default, into)

    def wait_route(
        self,
        start: int = 0,
        end: int | None = None,
        prefer: PeerID | None = None,
        patience: float = 60.0,
        on_wait: Callable[[], None] | None = None,
        on_missing: Callable[[list[int]], None] | None = None,
    ) -> list[Hop]:
        """A route, waiting up to ``patience`` seconds for missing blocks to get a server again; ``on_wait`` runs
        between looks (the caller brings new peers in), ``on_missing`` before each, with the blocks missing (the
        caller tells peers to take them over)."""

        def attempt() -> list[Hop] | None:
            try:
                return self.route(start, end, prefer)
            except NoRouteError:
                return None

        return self._wait(attempt, start, end, patience, eligible_only=True, on_wait=on_wait, on_missing=on_missing)

    def _wait(
        self,
        attempt: Callable,
        start: int,
        end: int | None,
        patience: float,
        eligible_only: bool,
        on_wait: Callable[[], None] | None = None,
        on_missing: Callable[[list[int]], None] | None = None,
    ):
        result = attempt()
        if result is not None:
            return result
        deadline = Deadline(patience)
        missing = self.uncovered(start, end, eligible_only)
        since = time.strftime("%H:%M:%S")
        waiting = WaitLine("waiting for a server to (re)join", deadline, logger, logging.WARNING)
        while not deadline.passed:
            waiting.update(f"blocks {spans_text(missing)} have no live server since {since}")
            if on_missing is not None:
                on_missing(self.uncovered(start, end, eligible_only=False))
            deadline.pause(min(1.0, self.options.min_ban))
            try:
                self.refresh()
                if on_wait is not None:
                    on_wait()
            except PEER_ERRORS as e:
                logger.warning("could not refresh the swarm view: %s", e)
            result = attempt()
            if result is not None:
                waiting.done("served again")
                return result
            missing = self.uncovered(start, end, eligible_only) or missing
        waiting.done("gave up")
        raise SwarmUnavailableError.unserved(missing, patience)


def _queued(planned: list[PlannedHop], candidates: list[Candidate]) -> float:
    """Seconds the chain's micro-batch waits behind work already routed to its hops' peers (at most: the transfer
    into a hop is not taken off)."""
    busy_for = {c.peer_id: c.busy_for for c in candidates}
    waits, arrives = 0.0, 0.0
    for hop in planned:
        waits += max(0.0, busy_for[hop.peer_id] - arrives)
        arrives = hop.finishes
    return waits


def _speed_step(block_seconds: float) -> int:
    """A server's speed, rounded to steps of ``PLAN_SPEED_STEP``: what a flow plan is made again for."""
    return round(math.log(max(block_seconds, 1e-9)) / math.log(PLAN_SPEED_STEP))


def _online_blocks(servers: dict[int, list[ServerRecord]]) -> dict[PeerID, set[int]]:
    """Per peer, the blocks it announces online."""
    blocks: dict[PeerID, set[int]] = {}
    for block, records in servers.items():
        for r in records:
            if r.state == ServerState.ONLINE:
                blocks.setdefault(r.peer_id, set()).add(block)
    return blocks
