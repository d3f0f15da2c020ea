"""The peer daemon: join the DHT, choose and load a span of blocks, serve it, keep announcing it, keep standby
copies and checkpoints of adapter state, move to where the swarm needs it, leave cleanly.

``PeerDaemon`` runs a peer's life and wires its collaborators together, each with one job, sharing where the peer
stands (peers/standing.py) rather than the daemon: what it tells others (peers/announcer.py), loading its blocks
(peers/spanloader.py), choosing and moving its span (peers/mover.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Protocol

import psutil
from hivemind.p2p import P2P

from peers.announcer import Announcer
from peers.backend import SpanBackend
from peers.behaviour import Behaviour
from peers.checkpoints import CheckpointStore, CheckpointWriter
from peers.claim import ProcessClaim, lock_path_of_checkpoints, lock_path_of_identity, refuse_if_serving_elsewhere
from peers.compute import Compute
from peers.config import PeerConfig, device_free_bytes, max_blocks, span_length
from peers.links import LinkProber
from peers.movelog import MoveLog
from peers.mover import Mover
from peers.orphans import OrphanCheck
from peers.peer_client import PeerClient
from peers.placement import Placement
from peers.pullers import RecentPullers
from peers.reduction.audit import AUDIT_RATE
from peers.replication import Replicator, StandbyPolicy
from peers.service import InfoDoors, PeerHooks, PeerService
from peers.spanloader import SpanLoader
from peers.standing import PeerParts, Standing
from swarm.blocks import spans_text
from swarm.hub import resolve_model
from swarm.net.deltas import DeltaReferences
from swarm.net.errors import PEER_ERRORS, SwarmAccessError
from swarm.net.network import check_access, join_dht, load_swarm_key
from swarm.net.protocol import CommittedRequest
from swarm.net.reachability import choose_relays, verify_relayed
from swarm.net.records import ServerState, read_servers
from swarm.net.security import Identity
from swarm.net.servicer import FaultHook
from swarm.net.suspects import suspect
from swarm.net.transport import Transport
from swarm.net.view import SwarmView, observe
from swarm.spec import load_spec
from swarm.weights import block_digests

logger = logging.getLogger(__name__)

MIN_ROUND_GAP = 1.0  # seconds between the end of a balance round and one held early on a client's notice
ANNOUNCE_RETRY = 2.0  # seconds before announcing again after a DHT call timed out (records live RECORD_TTL, 30 s)
LEAVE_TIMEOUT = 20.0  # seconds past the leave grace after which a leaving peer exits whatever is stuck


class PlanHook(Protocol):
    """Sees a peer's loads and moves: how tests give it a slow disk or a scripted move
    (tests/integration/test_crowded_start.py) without patching the daemon."""

    def loading(self, blocks: range) -> None:
        """Runs in the loading thread just before ``blocks`` load (a join's, or a move's new blocks)."""

    def decided(self, target: range | None) -> range | None:
        """The move the balancer decided (None: stay); returns the one the peer makes."""


class PeerDaemon:
    """One process serving a span of one model's blocks, moving it when the swarm needs it elsewhere. What tests
    inject, each given here and None in a real peer: ``faults`` (failures around the handlers), ``behaviour`` (what
    its compute does to its results: a liar's, peers/behaviour.py), ``plan`` (sees its loads and moves).

    Where it stands (its span, state, speed, and once loaded the parts it runs) is ``standing``; ``loader`` loads its
    blocks; ``announcer`` and ``mover`` are made once it has joined the DHT."""

    def __init__(
        self,
        config: PeerConfig,
        faults: FaultHook | None = None,
        behaviour: Behaviour | None = None,
        plan: PlanHook | None = None,
    ):
        self.config, self.faults, self.behaviour, self.plan = config, faults, behaviour, plan
        # a hub id: its revision resolved to a commit, its small files fetched; the shards come with each span
        self.source = resolve_model(config.model, config.revision, config.token)
        self.spec = load_spec(self.source.folder, name=self.source.name)
        self.swarm_key = load_swarm_key(config.swarm_key)
        # an identity file from before this run may be serving elsewhere already (a copy on another machine)
        self.known_identity = config.identity is not None and Path(config.identity).exists()
        self.identity = Identity.load_or_create(config.identity)
        locks = [lock_path_of_identity(self.identity.path)]
        if config.checkpoint_dir:
            locks.append(lock_path_of_checkpoints(Path(config.checkpoint_dir)))
        self.claim = ProcessClaim(self.identity.peer_id, locks)
        free = device_free_bytes(config)  # before this peer loads anything: what its memory model sizes
        span_len = span_length(self.spec, config, free)
        capacity = max_blocks(self.spec, config, span_len, free)
        self.placement = Placement(self.spec.num_blocks, span_len, config.replication, capacity, config.blocks)
        self.rng = random.Random(self.identity.peer_id.to_bytes())
        self.store = CheckpointStore(config.checkpoint_dir) if config.checkpoint_dir else None
        self.writer = CheckpointWriter(self.store, config.checkpoint_every) if self.store else None
        self.standing = Standing()  # where it stands: its span, state, speed; the parts it runs once loaded
        loading = plan.loading if plan is not None else None
        self.loader = SpanLoader(self.source, self.spec, config, self.standing, free, self.store, behaviour, loading)
        self.announcer: Announcer | None = None  # made once the DHT is joined: what it tells others
        self.mover: Mover | None = None  # ... and with it: choosing and moving its span
        self.view: SwarmView | None = None
        self.orphans: OrphanCheck | None = None  # made once the transport is: what tells an orphan from a silent peer
        self.balance_now = asyncio.Event()  # a client found blocks without a server: hold the next round at once
        self.hurry = asyncio.Event()  # told to leave twice: skip what is left of the leave grace
        self.woken_rounds = 0  # balance rounds held early on a client's notice
        self.moves = MoveLog()  # the moves it made, and why
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- the life of a peer -----------------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Join, check access, choose and load blocks, serve until SIGINT/SIGTERM; then announce leaving,
        finish in-flight work, go. Given ``stop``, serve until it is set instead: a peer embedded in another
        program (``swarm.testing.inprocess``) takes none of its signals and never exits its process."""
        embedded = stop is not None
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, stop)
        self.claim.acquire()
        try:
            await self._serve(stop, embedded)
        finally:
            self.claim.release()

    def _on_signal(self, stop: asyncio.Event) -> None:
        """SIGINT or SIGTERM: leave (announce it, give clients the grace to notice, finish in-flight work). Again
        while leaving (Ctrl-C twice, or a supervisor that knows no client is left): skip the rest of the grace."""
        if stop.is_set() and not self.hurry.is_set():
            logger.info("told again: leaving without waiting out the grace")
            self.hurry.set()
        stop.set()

    async def _serve(self, stop: asyncio.Event, embedded: bool) -> None:
        """Join, load and take state, serve until ``stop``, leave."""
        self._loop = asyncio.get_running_loop()
        p2p, timeline = await self._join(embedded)
        await self._start_serving(p2p, timeline)
        await self._serve_until(stop)
        await self._leave(p2p, exit_if_stuck=not embedded)

    async def _join(self, embedded: bool) -> tuple[P2P, StartTimeline]:
        """Relays chosen, the DHT joined with this peer's identity, its addresses known; the start timed from the
        process's start (``embedded``: from now)."""
        config = self.config
        timeline = StartTimeline(psutil.Process().create_time() if not embedded else time.time())
        self.standing.digests = await asyncio.to_thread(block_digests, self.spec)
        announce = list(config.announce_maddrs)
        relays = await choose_relays(
            config.initial_peers, config.host, config.port, announce, config.relay, self.swarm_key
        )
        if self.known_identity and config.initial_peers:
            await refuse_if_serving_elsewhere(self.identity, self.spec, config.initial_peers, self.swarm_key)
        self.dht = join_dht(
            config.initial_peers,
            self.identity,
            self.swarm_key,
            host=config.host,
            port=config.port,
            announce_maddrs=announce,
            relays=relays,
            join_timeout=config.join_timeout,
            check_identity=False,  # looked for just above, where it can be: a fresh identity file is nobody's
        )
        p2p = await self.dht.replicate_p2p()
        self.transport = Transport(p2p, self.swarm_key, on_unresponsive=partial(suspect, self.dht))
        self._joined()
        try:
            await check_access(self.transport, config.initial_peers)
            self.standing.maddrs = await self._addresses(p2p, relays)
            self.claim.note_addresses(self.standing.maddrs)
        except BaseException:
            self.dht.shutdown()
            raise
        timeline.mark("join")
        return p2p, timeline

    def _joined(self) -> None:
        """What needs the DHT and the transport, made once they are: the orphan check, the announcer, the mover."""
        config, me = self.config, self.identity.peer_id
        self.orphans = OrphanCheck(me, self.transport, config.record_ttl, told=config.blocks is not None)
        self.announcer = Announcer(
            self.dht, config, self.spec, self.identity, self.standing, self.placement.max_blocks, self.moves
        )
        decided = self.plan.decided if self.plan is not None else None
        self.mover = Mover(
            me,
            self.placement,
            self.standing,
            self.announcer,
            self.loader,
            self._observe,
            self.moves,
            self.rng,
            config.leave_grace,
            self.store,
            decided,
        )

    async def _start_serving(self, p2p: P2P, timeline: StartTimeline) -> None:
        """Choose the span (or take ``--blocks``), load it and take its state while answering ``info`` only, then open
        every door."""
        config, now = self.config, self.standing
        joining_doors = InfoDoors(self.announcer.info, self.swarm_key, config.max_payload_mb << 20, faults=self.faults)
        await joining_doors.register(p2p)
        if config.blocks is None:
            now.joining = await self.mover.choose_span()
        else:
            now.joining = config.blocks
            await self.announcer.announce()
        timeline.mark("choose")
        async with self.announcer.announcing():
            now.parts = self._assemble(await asyncio.to_thread(self.loader.load, now.joining))
            await now.parts.replicator.take_state(await self._observe(), now.joining)
        await joining_doors.unregister(p2p)
        await now.parts.service.register(p2p)
        now.serving, now.joining, now.state = now.joining, None, ServerState.ONLINE
        self.orphans.serving()
        timeline.mark("load and take state")
        logger.info(
            "serving blocks %d:%d of %s as %s (%s)",
            now.serving.start,
            now.serving.stop,
            self.spec.name,
            self.identity.peer_id,
            timeline.text(),
        )

    def _assemble(self, backend: SpanBackend) -> PeerParts:
        """The compute thread, the replicator and the service around a loaded backend and its adapters' store, each
        made with what it needs: nothing is wired in afterwards."""
        config, adapters = self.config, backend.adapters
        compute = Compute(after=partial(self.announcer.publish, backend))
        self.announcer.publish(backend)  # no job has run on the new compute thread yet: published before anyone reads
        policy = StandbyPolicy(config.standby_blocks, config.standby_every)
        peers = PeerClient(self.transport, self.behaviour)
        replicator = Replicator(adapters, compute, peers, self.identity.peer_id, policy, self._checkpoint)
        hooks = PeerHooks(
            after_commit=self._after_commit,
            after_revert=self._checkpoint,
            on_committed=replicator.on_committed,
            on_replicate=replicator.hold,
            on_unserved=self._on_unserved,
        )
        pullers = RecentPullers()
        service = PeerService(
            backend,
            adapters,
            compute,
            self.announcer.info,
            peers,
            hooks,
            pullers,
            self.swarm_key,
            config.max_payload_mb << 20,
            faults=self.faults,
            references=DeltaReferences(max_bytes=config.delta_references_mb << 20),
            audit_rate=AUDIT_RATE if config.audit_rate is None else config.audit_rate,
        )
        links = LinkProber(self.transport, rng=random.Random(self.rng.random()))
        return PeerParts(backend, adapters, compute, peers, service, replicator, links, pullers)

    async def _serve_until(self, stop: asyncio.Event) -> None:
        """Announce every third of the records' lifetime and balance every round (early when woken) until ``stop``."""
        config = self.config
        next_announce, next_round, last_round = 0.0, self._next_round(), 0.0
        while not stop.is_set():
            if time.monotonic() >= next_announce:
                try:
                    await self.announcer.announce()
                    next_announce = time.monotonic() + config.record_ttl / 3
                except TimeoutError as e:  # the DHT is slow or restarting: serve on, and announce again soon
                    logger.warning("announcing failed (will retry in %.0f s): %s", ANNOUNCE_RETRY, e)
                    next_announce = time.monotonic() + ANNOUNCE_RETRY  # before the records lapse, if it can
            woken = await self._sleep(stop, min(next_announce, next_round) - time.monotonic())
            if stop.is_set():
                break
            if woken:  # at most one early round a second, however many notices come
                await asyncio.sleep(max(0.0, last_round + MIN_ROUND_GAP - time.monotonic()))
                self.woken_rounds += 1
            elif time.monotonic() < next_round:
                continue  # woken to announce
            try:
                await self._balance_round()
            except PEER_ERRORS as e:
                logger.warning("balancing round failed (will retry): %s", e)
            except Exception:  # the boundary of a background loop: the peer serves on, and retries next round
                logger.exception("balancing round failed (will retry)")
            last_round, next_round = time.monotonic(), self._next_round()

    def _next_round(self) -> float:
        """When the next balance round is due: jittered, so that peers started together do not look together."""
        return time.monotonic() + self.config.balance_interval * self.rng.uniform(0.5, 1.5)

    async def _sleep(self, stop: asyncio.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``stop`` or a client's notice of unserved blocks; True if the notice came."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.balance_now.wait())]
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        woken = self.balance_now.is_set()
        self.balance_now.clear()
        return woken

    def _on_unserved(self, model: str, blocks: list[int]) -> None:
        """A client found ``blocks`` without a live server: look at the swarm now (it may be this peer's to take
        them over). Notices for another model are ignored."""
        if model != self.spec.name or self._loop is None:
            return
        logger.info("a client finds blocks %s without a live server: looking at the swarm now", spans_text(blocks))
        self._loop.call_soon_threadsafe(self.balance_now.set)

    # --- each balance round -----------------------------------------------------------------------------------

    async def _observe(self, retry_timeout: float | None = None) -> SwarmView:
        """Look at the swarm (see ``observe``) and remember what was seen."""
        self.view = await observe(
            self.dht,
            self.transport,
            self.spec.name,
            self.spec.num_blocks,
            self.identity.peer_id,
            self.standing.digests,
            retry_timeout=retry_timeout,
        )
        if self.orphans is not None:
            self.orphans.saw(self.view)
        return self.view

    async def _balance_round(self) -> None:
        """Free idle generation sessions, time the links to the next hops (in the background: peers/links.py; the
        live servers of the block after its span), refresh standby copies, then move if that strictly helps the
        swarm's coverage, is this peer's step of a plan that brings a block without a server back, or relieves the
        slowest block (the span throughputs the peers announce, this one's as last measured). A move over blocks
        nobody else answered for waits for a second look (peers/orphans.py)."""
        parts, me = self.standing.parts, self.identity.peer_id
        await parts.compute(parts.backend.sessions.expire)
        looked = time.monotonic()
        view = await self._observe()
        parts.links.start([r.peer_id for r in view.online(self.standing.serving.stop, exclude=me)])
        changed = await parts.replicator.refresh_standby(view, self.standing.serving)
        for name in changed:
            await self._checkpoint(name)
        if not self.config.rebalance:
            return
        move = await self.mover.decide(view)
        if move is not None and move.covers:
            read = partial(asyncio.to_thread, read_servers, self.dht, self.spec.name, self.spec.num_blocks)
            move = await self.orphans.confirmed(move, view, looked, self._observe, self.mover.decide, read)
        if move is not None:
            await self.mover.move(move)

    # --- after a step -----------------------------------------------------------------------------------------

    async def _checkpoint(self, name: str) -> None:
        if self.writer is not None:
            adapters = self.standing.parts.adapters
            meta, states = await self.standing.parts.compute(
                lambda: (adapters.adapter(name).meta, adapters.snapshot(name))
            )
            self.writer.submit(name, meta, states)

    async def _after_commit(self, name: str) -> None:
        """A step was applied here: checkpoint it (in the background) and tell the peers keeping standby copies
        of these blocks, so they pull the new state now rather than at their next round (told first: a copy one
        step behind when both servers die is a step the trainer must wait for or lose)."""
        parts = self.standing.parts
        adapters = parts.adapters
        config, seed, steps = await parts.compute(
            lambda: (adapters.adapter(name).config_wire, adapters.adapter(name).seed, adapters.adapter(name).steps())
        )
        steps = {block: step for block, step in steps.items() if block in self.standing.serving}
        notice = CommittedRequest(adapter=name, lora=config, seed=seed, steps=steps, source=self.identity.peer_id)
        blocks = list(steps)
        watchers = self.view.watchers(blocks) if self.view is not None else []
        for peer in dict.fromkeys([*watchers, *parts.pullers.of(blocks)]):
            parts.service.in_background(parts.peers.notify_committed(peer, notice))
        await self._checkpoint(name)

    # --- joining and leaving ----------------------------------------------------------------------------------

    async def _addresses(self, p2p, relays: list[str]) -> list[str]:
        """Where others dial this peer: its own addresses, or (behind NAT) its addresses through the relays that
        proved to work."""
        if not relays:
            maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
            logger.info("announcing addresses %s", " ".join(maddrs))
            return maddrs
        maddrs = await verify_relayed(self.transport, relays, self.identity.peer_id)
        port = f"port {self.config.port}" if self.config.port else "a port (--port N)"
        if not maddrs:
            raise SwarmAccessError(
                f"this peer is not reachable from outside, and no relay let it through ({' '.join(relays)}): open "
                f"{port} to this machine and pass --public-ip or --announce-maddrs, or join through a bootstrap "
                "node that relays (`swarm dht` without --no-relay)"
            )
        logger.warning(
            "not reachable from outside; serving through relay %s (slower). Open %s or pass --announce-maddrs "
            "to serve directly.",
            " ".join(maddrs),
            port,
        )
        return maddrs

    async def _leave(self, p2p, exit_if_stuck: bool) -> None:
        """Announce leaving, finish in-flight work, go. Bounded: a signal sent to the whole process group (systemd,
        ``kill -- -PGID``) has stopped the P2P daemon and the DHT process too, and the peer must exit anyway
        (``exit_if_stuck``: the whole process, if even the bounded wait hangs)."""
        logger.info("leaving: announcing it, then finishing in-flight requests")
        if exit_if_stuck:
            watchdog = threading.Timer(self.config.leave_grace + LEAVE_TIMEOUT, _exit_now)
            watchdog.daemon = True
            watchdog.start()
        self.standing.state = ServerState.LEAVING
        try:
            await asyncio.wait_for(self._finish(p2p), timeout=self.config.leave_grace + LEAVE_TIMEOUT / 2)
            logger.info("left the swarm")
        except PEER_ERRORS as e:
            logger.warning("could not leave cleanly (%s: %s); exiting anyway", type(e).__name__, e)
        finally:
            self.dht.shutdown()

    async def _finish(self, p2p) -> None:
        parts = self.standing.parts
        if self.dht.is_alive():
            await self.announcer.announce()
        with contextlib.suppress(asyncio.TimeoutError):  # told again (``hurry``): the rest of the grace is skipped
            await asyncio.wait_for(self.hurry.wait(), self.config.leave_grace)
        await parts.compute(lambda: None)
        await parts.links.close()
        if self.writer is not None:
            self.writer.close()
        await parts.service.unregister(p2p)


def _exit_now() -> None:
    """The last resort of a leave that hangs (a dead DHT process or P2P daemon under a thread): exit anyway."""
    logger.error("leaving took too long; exiting now")
    logging.shutdown()
    os._exit(1)


class StartTimeline:
    """When a peer's start reached each phase: what a restart costs, and where (printed when it serves)."""

    def __init__(self, started: float):
        self.started, self.imported = started, time.time()  # the daemon runs once its imports are done
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time()))

    def text(self) -> str:
        parts, last = [f"{self.imported - self.started:.1f} s to start Python and import"], self.imported
        for phase, at in self.marks:
            parts.append(f"{at - last:.1f} s to {phase}")
            last = at
        return f"{last - self.started:.1f} s after the process started: " + ", ".join(parts)


def run_peer(config: PeerConfig) -> None:
    """Serve until told to stop, then exit the process at once: after a signal to the whole process group, threads
    stuck on the dead DHT process or P2P daemon would otherwise hold the interpreter's exit forever."""
    daemon = PeerDaemon(config)
    asyncio.new_event_loop().run_until_complete(daemon.serve())
    logging.shutdown()
    os._exit(0)
