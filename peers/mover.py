"""Where a peer serves, and getting there: the span it chooses when it joins (yielding to a peer that chose the same
one at the same moment), the move its balance rounds decide (peers/placement.py ``decide_move``), and the move made
without a gap: the new blocks loaded and their state taken beside the old span, the move announced and checked once
more, the blocks handed over announced leaving and drained before they are unloaded."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import PeerID

from peers.announcer import Announcer
from peers.balancer import badness, choose_span, coverage_with, safe_to_drop
from peers.checkpoints import CheckpointStore
from peers.movelog import MoveLog
from peers.placement import Move, Placement, decide_move, movers, others_serving, planned_throughput
from peers.spanloader import SpanLoader
from peers.standing import Standing
from swarm.blocks import spans_text
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT = 60.0  # seconds a move waits for the micro-batches in flight on the blocks it hands over
DRAIN_SEEN = 6.0  # ... at least: two of a client's view refreshes (swarm/client/routing.py), so it sees them leaving
DRAIN_QUIET = 10.0  # ... or, where no step commits, until no trainer sent work here for this long (its view refreshes
# every 3 s meanwhile; a trainer idle past a move's end would wait on it, as tests/e2e/test_durable.py's does)
DRAIN_POLL = 0.2

Look = Callable[[], Awaitable[SwarmView]]  # a look at the swarm (the daemon's, which it remembers)
Decided = Callable[[range | None], range | None]  # a test's plan: the move decided (None: stay) -> the one made


class Mover:
    """Chooses and moves this peer's span (``standing.serving``). ``me``: its peer id; ``placement``: the model's
    size and the swarm's placement settings; ``look``: a fresh look at the swarm; ``rng``: the peer's own, seeded by
    its id (its jitters and ties); ``store``: its checkpoints, whose blocks it prefers at its start; ``decided``: a
    test's plan, which has the last word on each move (``PlanHook.decided``)."""

    def __init__(
        self,
        me: PeerID,
        placement: Placement,
        standing: Standing,
        announcer: Announcer,
        loader: SpanLoader,
        look: Look,
        moves: MoveLog,
        rng: random.Random,
        leave_grace: float,
        store: CheckpointStore | None = None,
        decided: Decided | None = None,
    ):
        self.me, self.placement, self.standing, self.announcer, self.loader = me, placement, standing, announcer, loader
        self.look, self.moves, self.rng, self.leave_grace = look, moves, rng, leave_grace
        self.store, self.decided = store, decided

    # --- choosing a span at the start -------------------------------------------------------------------------

    async def choose_span(self) -> range:
        """Pick the span that helps most; announce it as joining; look again, and yield to a smaller-id peer that
        chose the same span at the same moment. A peer restarting on the blocks its checkpoint holds goes at once:
        it may hold their newest state, and a second server of them is no waste. Of equal spans, one whose weights are
        on disk wins (a model from the hub: nothing to download)."""
        held = await asyncio.to_thread(self.store.blocks) if self.store is not None else set()
        on_disk = set(await asyncio.to_thread(self.loader.on_disk))
        if not held:
            await asyncio.sleep(self.rng.uniform(0.0, 1.0))  # fresh peers starting together spread out
        view = await self.look()
        span = self._best(view, view.coverage(self.me), held, on_disk)
        if held.issuperset(span):
            self.standing.joining = span
            await self.announcer.announce()
            logger.info("chose blocks %d:%d (its checkpoint holds them)", span.start, span.stop)
            return span
        span = await self._yield_to_others(span, held, on_disk)
        logger.info("chose blocks %d:%d", span.start, span.stop)
        return span

    def _best(self, view: SwarmView, coverage: dict[int, int], held: set[int], on_disk: set[int]) -> range:
        """The span that helps most on ``view``, counted as ``coverage``."""
        p = self.placement
        throughput = planned_throughput(view, p.num_blocks, self.me)
        return choose_span(coverage, p.num_blocks, p.span_len, p.replication, throughput, self.rng, held, on_disk)

    async def _yield_to_others(self, span: range, held: set[int], on_disk: set[int]) -> range:
        """Announce ``span`` as joining and look again, up to three times: a span that peers joining before this one
        (smaller ids) have made worse than another is given up for that one."""
        p = self.placement
        for _ in range(3):
            self.standing.joining = span
            await self.announcer.announce()
            await asyncio.sleep(1.0 + self.rng.uniform(0.0, 1.0))
            view = await self.look()
            coverage = view.coverage(self.me, joining_before=self.me)
            best = self._best(view, coverage, held, on_disk)
            mine = badness(coverage_with(coverage, p.num_blocks, span), p.replication)
            if mine <= badness(coverage_with(coverage, p.num_blocks, best), p.replication):
                break
            logger.info(
                "span %s was taken by another joining peer; choosing %s instead",
                spans_text(list(span)),
                spans_text(list(best)),
            )
            await self.announcer.withdraw([b for b in span if b not in best])
            span = best
        return span

    # --- moving while serving ---------------------------------------------------------------------------------

    async def decide(
        self, view: SwarmView, yielding: frozenset[PeerID] = frozenset(), one_at_a_time: bool = True
    ) -> Move | None:
        """The move this peer would make on ``view`` (None: stay), as ``decide_move`` decides it; a test's plan has
        the last word."""
        now = self.standing
        move = await asyncio.to_thread(  # a plan search may take a few hundred ms: not on the event loop
            decide_move, view, self.me, now.serving, now.throughput, self.placement, yielding, now.cost, one_at_a_time
        )
        if self.decided is None:
            return move
        target = self.decided(None if move is None else move.target)
        if target is None:
            return None
        return move if move is not None and move.target == target else Move(target, "told by a test's plan")

    async def move(self, move: Move) -> None:
        """Serve ``move.target`` instead of the current span without a gap: load it and take its state while still
        serving the old span, announce the move, check that the blocks handed over stay covered, switch, and drain
        the blocks handed over (their micro-batches in flight finish here) before they are unloaded."""
        now, old, target = self.standing, self.standing.serving, move.target
        self.moves.starting(old, target, move.reason)
        now.joining = target
        await self.announcer.announce()
        await self._load(target)
        handed_over = [b for b in old if b not in target]
        if handed_over and not await self._still_wanted(target, handed_over):
            await self._cancel(old, target)
            return
        now.serving, now.joining, now.moving_to = target, None, None
        self.moves.add(old, target, move.reason)
        await self._hand_over(old, handed_over)
        logger.info("now serving blocks %d:%d, %.0f tokens/s", target.start, target.stop, now.throughput)

    async def _load(self, target: range) -> None:
        """The target's blocks this peer lacks, fetched and loaded beside the span it serves, and their state taken;
        its records renewed meanwhile."""
        parts = self.standing.parts
        async with self.announcer.announcing():
            digests = await asyncio.to_thread(self.loader.fetch, target)
            if digests is not None:
                await parts.compute(self.loader.use_digests, digests)
            layers = await asyncio.to_thread(self.loader.load_layers, target)
            await parts.replicator.take_state(await self.look(), target)
        await parts.compute(parts.backend.install, layers)

    async def _still_wanted(self, target: range, handed_over: list[int]) -> bool:
        """Announce the move, look again, and go on only if the move still stands and the blocks ``handed_over`` keep
        a server. Peers deciding on one snapshot may all move to the same blocks (a churn test saw two leave 2:4 for
        0:2 at once, then both move back): of peers moving at once, the smallest id goes on; the others count it where
        it goes and move only if that still calls for their move."""
        me = self.me
        self.standing.moving_to = target
        await self.announcer.announce()
        await asyncio.sleep(1.0 + self.rng.uniform(0.0, 1.0))
        view = await self.look()
        later = frozenset(p for p in movers(view) if p.to_bytes() > me.to_bytes())
        still = await self.decide(view, later, one_at_a_time=False)  # begun at rest: only movers decide
        if still is None or still.target != target:
            logger.info("not moving to %d:%d: a peer moving at the same time does", target.start, target.stop)
            return False
        unsafe = [b for b in handed_over if not safe_to_drop(b, others_serving(view, b, me), me.to_base58())]
        if unsafe:
            logger.info("not moving: blocks %s would be left without a server; keeping them", unsafe)
            return False
        return True

    async def _cancel(self, old: range, target: range) -> None:
        """Stay on ``old``: drop what was loaded of ``target`` and the records announcing the move."""
        parts = self.standing.parts
        self.standing.moving_to, self.standing.joining = None, None
        await parts.compute(parts.backend.remove, [b for b in target if b not in old])
        await self.announcer.announce()
        await self.announcer.withdraw([b for b in target if b not in old])

    async def _hand_over(self, old: range, handed_over: list[int]) -> None:
        """Announce ``handed_over`` leaving, give clients the leave grace to see it, drain and unload them; then
        measure the span served now."""
        now, parts = self.standing, self.standing.parts
        leaving = ServerRecord(self.me, ServerState.LEAVING, old.start, old.stop, now.throughput)
        await self.announcer.announce([(leaving, range(b, b + 1)) for b in handed_over])
        await asyncio.sleep(self.leave_grace)
        async with self.announcer.announcing():  # a drain may outlast the records
            await self._drain(handed_over)
        await parts.compute(parts.backend.remove, handed_over)
        now.throughput = await parts.compute(self.loader.throughput, parts.backend)

    async def _drain(self, blocks: list[int]) -> None:
        """Keep serving ``blocks`` after announcing them leaving until no trainer counts on them here, at most
        ``DRAIN_TIMEOUT``: clients have had time to see the leaving records (``DRAIN_SEEN``), nothing of the step in
        progress is held on them (gradients committed, kept forwards used), and two steps committed since (a trainer
        asks every replica it knew of at the step's start to commit it, ones holding nothing there too, and routes a
        step by the view it read at the commit before: the second step is the first routed without these blocks),
        or no trainer sent work here for ``DRAIN_QUIET``. Micro-batches in flight finish where they started instead of
        being replayed elsewhere."""
        parts = self.standing.parts
        adapters = parts.adapters
        started = time.monotonic()
        progress = await parts.compute(adapters.progress)

        def left() -> tuple[int, bool]:
            quiet = time.monotonic() - adapters.last_trained >= DRAIN_QUIET
            return adapters.in_flight(blocks), quiet or adapters.progress() >= progress + 2

        while True:
            held, committed = await parts.compute(left)
            if held == 0 and committed and time.monotonic() - started >= DRAIN_SEEN:
                return
            if time.monotonic() - started >= DRAIN_TIMEOUT:
                logger.warning(
                    "blocks %s still hold %d things of the step in progress after %.0f s; handing them over anyway "
                    "(the trainer replays what it misses)",
                    spans_text(blocks),
                    held,
                    DRAIN_TIMEOUT,
                )
                return
            await asyncio.sleep(DRAIN_POLL)
