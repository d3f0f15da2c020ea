"""A swarm inside the test's own process: a bootstrap node and real ``PeerDaemon``s over real hivemind P2P on
127.0.0.1 (hivemind's DHT and p2pd helper processes included), each peer on an event loop of its own.

It is the daemon's own code that runs (join, load, announce, serve, leave), only not in a process of its own: a
client in the same process trains through these peers as through any, and a test reaches into them (their backend,
adapters, ``FaultInjector``) without a wire protocol of its own; what it injects (faults, a liar's behaviour, a plan
hook) each peer takes at construction. Every peer and node is stopped on exit, failures too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.behaviour import Behaviour
from peers.config import PeerConfig
from peers.daemon import PeerDaemon, PlanHook
from swarm.net.records import ServerState
from swarm.net.security import Identity, SwarmKey
from swarm.ops.cli import start_bootstrap
from swarm.testing.faults import FaultInjector

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 15.0  # a peer that has not left by then is killed
# What every in-process peer differs in from `swarm peer`'s defaults: loopback, no relays, the spans a test gives
# stay where they are, and a leave that takes a blink.
IN_PROCESS = dict(host="127.0.0.1", relay="never", rebalance=False, leave_grace=0.2)


@contextlib.contextmanager
def _fork_shared_locks(deadline: float, name: str) -> Iterator[None]:
    """Hold hivemind's MPFuture locks, which every DHT process forked from this one shares (multiprocessing
    semaphores made at import): a DHT process stopped while holding one hangs every other DHT's replies (a test's
    client waited forever on ``dht.run_coroutine``), one killed holding one hangs them for good. Holding them, the
    peer is stopped or killed outside them. Separate processes, as real peers are, share none (the test fork server
    resets them in each child)."""
    locks = (MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock)
    held = []
    try:
        for lock in locks:
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise InProcessPeerError(f"peer {name} could not be stopped: a process holds hivemind's MPFuture lock")
            held.append(lock)
        yield
    finally:
        for lock in reversed(held):
            lock.release()


class InProcessPeerError(RuntimeError):
    """A peer did not come up; the message says why."""


class InProcessPeer:
    """A real ``PeerDaemon`` serving from a thread of this process. ``faults``: where a test arms failures;
    ``behaviour``, ``plan``: see ``PeerDaemon``."""

    def __init__(self, name: str, config: PeerConfig, behaviour: Behaviour | None = None, plan: PlanHook | None = None):
        self.name, self.config = name, config
        self.faults = FaultInjector(kill=self.kill)
        self.daemon = PeerDaemon(config, faults=self.faults, behaviour=behaviour, plan=plan)
        self.killed = False
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name=f"peer-{name}", daemon=True)
        self._served: concurrent.futures.Future | None = None

    @property
    def peer_id(self) -> PeerID:
        return self.daemon.identity.peer_id

    @property
    def backend(self) -> SpanBackend:
        """The peer's span compute, once it serves."""
        return self.daemon.standing.parts.backend

    @property
    def adapters(self) -> AdapterStore:
        """The peer's adapter state, once it serves."""
        return self.daemon.standing.parts.adapters

    @property
    def alive(self) -> bool:
        """Whether its daemon still runs: started, and neither killed nor stopped nor failed."""
        return not self.killed and self._served is not None and not self._served.done()

    def start(self) -> None:
        self._thread.start()
        self._served = asyncio.run_coroutine_threadsafe(self.daemon.serve(self._stop), self._loop)
        self._served.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._loop.stop))

    def _run(self) -> None:
        """The peer's event loop; once its daemon is done (left, failed or killed), its P2P client is closed here,
        in its loop (closed from another, at exit, it would complain), and what is left of it is cancelled."""
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        transport = getattr(self.daemon, "transport", None)  # set once the daemon joined
        if transport is not None:
            self._loop.run_until_complete(transport.shutdown())
        leftovers = asyncio.all_tasks(self._loop)
        for task in leftovers:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        self._loop.close()

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until the daemon announces itself online; raise with its error if it failed to start."""
        deadline = time.monotonic() + timeout
        while self.daemon.standing.state is not ServerState.ONLINE:
            if self._served.done():
                error = None if self._served.cancelled() else self._served.exception()
                raise InProcessPeerError(f"peer {self.name} stopped before serving: {error!r}") from error
            if time.monotonic() > deadline:
                raise InProcessPeerError(f"peer {self.name} did not serve within {timeout:.0f}s")
            time.sleep(0.05)

    def look_now(self) -> None:
        """Have the daemon hold a balance round now, as a client's ``unserved`` notice does (it refreshes its standby
        copies, and moves if its config lets it); ``daemon.woken_rounds`` counts it once held."""
        self._loop.call_soon_threadsafe(self.daemon.balance_now.set)

    def kill(self) -> None:
        """Die like a crashed machine, from any thread (a fault fires it from the peer's own loop): SIGKILL its DHT
        process and P2P daemon, so that every connection drops at once, and drop its loop without leaving."""
        self.killed = True
        with _fork_shared_locks(time.monotonic() + STOP_TIMEOUT, self.name):  # none is left held by the dead
            self._signal_network(signal.SIGKILL)
        if self._served is not None:
            self._served.cancel()

    def freeze(self, timeout: float = 10.0) -> None:
        """Hang like a frozen machine, seen from outside: SIGSTOP its DHT process and P2P daemon, so that nothing
        it is sent is answered while its connections stay open; returns once both are stopped (a test calling it
        next must find it frozen). ``thaw()`` undoes it."""
        deadline = time.monotonic() + timeout
        with _fork_shared_locks(deadline, self.name):
            stopped = self._signal_network(signal.SIGSTOP)
            if len(stopped) < 2:
                raise InProcessPeerError(f"peer {self.name} has no DHT process and P2P daemon to freeze: {stopped}")
            while not all(process.status() == psutil.STATUS_STOPPED for process in stopped):
                if time.monotonic() > deadline:
                    states = {process.pid: process.status() for process in stopped}
                    raise InProcessPeerError(f"peer {self.name} did not freeze within {timeout:.0f}s: {states}")
                time.sleep(0.01)

    def thaw(self) -> None:
        self._signal_network(signal.SIGCONT)

    def _signal_network(self, sig: int) -> list[psutil.Process]:
        """Signal the peer's DHT process and its P2P daemon (its children), once the daemon has joined; returns the
        processes signalled."""
        dht = getattr(self.daemon, "dht", None)
        if dht is None or not dht.is_alive():
            return []
        try:
            process = psutil.Process(dht.pid)
            signalled = [*process.children(recursive=True), process]  # p2pd, then the DHT process
            for each in signalled:
                each.send_signal(sig)
        except psutil.NoSuchProcess:
            return []  # it died on its own meanwhile
        return signalled

    def leave(self) -> None:
        """Ask the daemon to leave, as SIGTERM does (announce it, finish in-flight work, go); returns at once."""
        self.faults.release()
        if self._thread.is_alive() and not self.killed and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # its loop closed meanwhile: the daemon is done already (it failed, or left)
                pass

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Leave and wait for it; killed if that hangs."""
        self.leave()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("peer %s did not leave within %.0fs; killing it", self.name, timeout)
            self.kill()
            self._thread.join(timeout)
        if self.daemon.standing.parts is not None:
            self.daemon.standing.parts.service.compute.shutdown()
        dht = getattr(self.daemon, "dht", None)
        if dht is not None:
            dht.join(timeout)


class InProcessSwarm:
    """A bootstrap node and the peers a test adds, all in this process; ``close()`` (or leaving the ``with``)
    stops every one of them. ``defaults``: ``PeerConfig`` fields for every peer (each ``add_peer`` may override);
    with ``swarm_key`` (a key file's path) the bootstrap node is private too."""

    def __init__(self, model_dir: str | Path, workdir: Path, **defaults):
        self.model_dir, self.workdir = str(model_dir), Path(workdir)
        self.template = PeerConfig(model=self.model_dir, initial_peers=[], **{**IN_PROCESS, **defaults})
        self.peers: dict[str, InProcessPeer] = {}
        self.initial_peers: list[str] = []
        self._bootstrap = None

    def __enter__(self) -> InProcessSwarm:
        try:
            self.start_bootstrap()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_bootstrap(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load_or_create(self.workdir / "bootstrap.key")
        key = SwarmKey.load(self.template.swarm_key) if self.template.swarm_key else None  # a private swarm
        self._bootstrap = start_bootstrap([], identity, key, "127.0.0.1", 0)
        dht, _ = self._bootstrap
        self.initial_peers = [str(m) for m in dht.get_visible_maddrs() if "/ip4/127.0.0.1/" in str(m)]

    def add_peer(
        self,
        blocks: str | None,
        name: str | None = None,
        wait: bool = True,
        behaviour: Behaviour | None = None,
        plan: PlanHook | None = None,
        **config,
    ) -> InProcessPeer:
        """Start a peer serving ``blocks`` (START:END; None: the span it chooses, as ``swarm peer`` without
        ``--blocks``, of ``num_blocks`` blocks); by default wait until it serves. Its identity file is named after
        it unless ``identity`` says which (a peer restarted as itself). ``behaviour``, ``plan``: see
        ``PeerDaemon``."""
        name = name or f"peer{len(self.peers)}"
        if name in self.peers:
            raise ValueError(f"there is a peer {name!r} already")
        span = None if blocks is None else range(*(int(x) for x in blocks.split(":")))
        peer_config = replace(
            self.template,
            initial_peers=list(self.initial_peers),
            blocks=span,
            **{"identity": str(self.workdir / f"{name}.key"), **config},
        )
        peer = self.peers[name] = InProcessPeer(name, peer_config, behaviour, plan)
        peer.start()
        if wait:
            peer.wait_serving()
        return peer

    def start_peers(
        self,
        spans: dict[str, str],
        timeout: float = 60.0,
        behaviours: dict[str, Behaviour] | None = None,
        **config,
    ) -> dict[str, InProcessPeer]:
        """One peer per name -> START:END, started at once; returns when all serve. ``behaviours``: by name, the
        peers that lie (``swarm.testing.dishonest``)."""
        behaviours = behaviours or {}
        started = {
            name: self.add_peer(blocks, name, wait=False, behaviour=behaviours.get(name), **config)
            for name, blocks in spans.items()
        }
        for peer in started.values():
            peer.wait_serving(timeout)
        return started

    def close(self) -> None:
        """Every peer leaves at once (killed if it hangs), then the bootstrap node goes."""
        for peer in self.peers.values():
            peer.leave()
        for peer in self.peers.values():
            peer.stop()
        if self._bootstrap is not None:
            dht, p2p = self._bootstrap
            RemoteExpertWorker.run_coroutine(p2p.shutdown())
            dht.shutdown()
            self._bootstrap = None
