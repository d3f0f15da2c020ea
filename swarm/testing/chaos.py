"""Churn on a local swarm: a seeded schedule of crashes, freezes, clean leaves, restarts and joins, applied to real
peer processes while a client trains, for the churn benchmark and the chaos test.

Every peer the driver owns has a name, a checkpoint dir and an identity file, so a restarted peer comes back as
itself with its saved adapter state, as a volunteer's machine does after a reboot.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from swarm.blocks import spans_text
from swarm.net.protocol import Method
from swarm.testing.localswarm import LocalSwarm, Process

logger = logging.getLogger(__name__)

# What an event does to its peers: crash (SIGKILL), freeze (SIGSTOP, then SIGCONT or SIGKILL), a clean leave
# (SIGTERM), two crashes at the same moment, or a new peer joining.
KINDS = {"kill": 0.3, "freeze": 0.2, "term": 0.2, "double-kill": 0.15, "join": 0.15}
# Client-side phases a strike can wait for: it then hits the peer the client is calling with that request. Two strike
# a moment (the event's ``lag``) after the request, while the peer works on it: "replicate" while the peer pulls the
# standby copy the trainer asked for before acknowledging a step, "checkpoint" while the peer a commit was sent to
# applies the step and writes its checkpoint.
CHECKPOINT = "checkpoint"
PHASES = (Method.FORWARD, Method.BACKWARD, Method.COMMIT, Method.REPLICATE, CHECKPOINT)
REQUEST_OF = {CHECKPOINT: Method.COMMIT}
LAGGED = (Method.REPLICATE, CHECKPOINT)
# A peer-side phase: the strike waits (at most MOVE_WAIT s) for a peer to start moving to other blocks, and hits it.
MOVE, MOVE_WAIT = "move", 30.0
SPAN_LINE = re.compile(r"(?:now )?serving blocks (\d+):(\d+)")
COPIES_LINE = re.compile(r"holding standby copies of blocks ([\d:,]+|nothing)")
MOVE_LINE = re.compile(r"moving from blocks (\d+):(\d+) to (\d+):(\d+)")
TORN_WRITE_LINE = "discarding an interrupted checkpoint write"
JOINED_LINE, SERVING_LINE = "peers.daemon: announcing addresses", "peers.daemon: serving blocks"
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"  # the timestamp that starts each line of a peer's log


@dataclass(frozen=True)
class Restart:
    """One restarted process: seconds from its start to joining the DHT, and to serving (None: it never did)."""

    log: str
    joined: float | None
    serving: float | None


def _logged_at(text: str, marker: str) -> float | None:
    """The time (epoch seconds) of the first log line containing ``marker``."""
    for line in text.splitlines():
        if marker in line:
            try:
                return datetime.strptime(line[:23], LOG_TIME).timestamp()
            except ValueError:
                return None
    return None


def _since(started: float, at: float | None) -> float | None:
    return None if at is None else at - started


def start_times(started_at: dict[Path, float]) -> list[Restart]:
    """Per started process (its log -> when it was started): seconds to joining the DHT and to serving."""
    times = []
    for log, started in started_at.items():
        text = log.read_text(errors="replace") if log.exists() else ""
        joined, serving = _logged_at(text, JOINED_LINE), _logged_at(text, SERVING_LINE)
        times.append(Restart(log.stem, _since(started, joined), _since(started, serving)))
    return times


@dataclass(frozen=True)
class ChaosEvent:
    """One scheduled fault. ``phase``: wait (at most ``PHASE_WAIT`` s) for the client to send that method, then
    strike the peer it calls instead of ``targets[0]``; ``move``: wait for a peer to start a move, and strike it."""

    at: float
    kind: str
    targets: tuple[str, ...] = ()
    phase: str | None = None
    hold: float = 0.0  # freeze: seconds stopped
    thaw: bool = True  # freeze: SIGCONT after the hold (False: SIGKILL)
    lag: float = 0.0  # replicate / checkpoint: seconds from the request to the strike


PHASE_WAIT = 5.0


def chaos_schedule(seed: int, duration: float, mean_interval: float, names: list[str]) -> list[ChaosEvent]:
    """Events at exponential intervals (mean ``mean_interval`` s) over ``duration`` s, from ``seed`` alone."""
    rng = random.Random(seed)
    events, at = [], rng.expovariate(1.0 / mean_interval)
    while at < duration:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        targets = tuple(rng.sample(names, 2 if kind == "double-kill" else 1)) if kind != "join" else ()
        phase = rng.choice((None, *PHASES, MOVE)) if kind in ("kill", "freeze", "term") else None
        hold, thaw, lag = rng.uniform(1.0, 8.0), rng.random() < 0.6, rng.uniform(0.0, 0.05)
        events.append(ChaosEvent(at, kind, targets, phase, hold, thaw, lag))
        at += rng.expovariate(1.0 / mean_interval)
    return events


@dataclass
class Outage:
    """A peer down (crashed, frozen or left) from ``since`` until it serves again (``until``). ``copies``: the blocks
    it held standby copies of when struck: it was one of their state's holders too."""

    name: str
    blocks: range
    since: float
    pid: int  # the process struck: the outage of a crash ends when another process of that name serves
    until: float | None = None
    copies: frozenset[int] = frozenset()

    @property
    def held(self) -> set[int]:
        """Every block whose state it held: served or on standby."""
        return {*self.blocks, *self.copies}


class ChaosPeers:
    """Named peer processes of one model in a LocalSwarm: start, restart as themselves, read their spans."""

    def __init__(
        self,
        local: LocalSwarm,
        model: Path,
        extra: list[str],
        workdir: Path,
        restart_nice: int = 0,
        envs: dict[str, dict[str, str]] | None = None,
    ):
        """``restart_nice``: the niceness a restarted peer starts at, until it serves (``serving()``): on one shared
        machine its start (imports, loading) then takes idle CPU rather than the running swarm's, as on its own
        machine. 0 leaves restarts to compete, as they did. ``envs``: peer name -> environment it runs with, every
        time it starts (other CPU kernels, say)."""
        self.local, self.model, self.extra, self.workdir = local, model, extra, workdir
        self.envs = envs or {}
        self.restart_nice = restart_nice
        self.niced: set[str] = set()  # restarted peers still at restart_nice
        self.processes: dict[str, Process] = {}
        self.restarts = itertools.count(1)
        self.restarted_at: dict[Path, float] = {}  # the log of each restarted process -> when it was started

    def start(self, name: str, blocks: str | None = None) -> Process:
        state = self.workdir / name
        state.mkdir(parents=True, exist_ok=True)
        args = [*self.extra, "--checkpoint-dir", str(state / "checkpoints"), "--identity", str(state / "identity")]
        restart = name in self.processes
        log_name = f"{name}.{next(self.restarts)}" if restart else name
        started = time.time()
        prefix = ["nice", "-n", str(self.restart_nice)] if restart and self.restart_nice else None
        env = self.envs.get(name)
        process = self.local.start_peer(
            self.model, blocks, name=log_name, extra=args, wait=False, prefix=prefix, env=env
        )
        self.processes[name] = process
        if prefix:
            self.niced.add(name)
        if restart:
            self.restarted_at[process.log] = started
        return process

    def serving(self, name: str) -> None:
        """``name`` serves again: back to the niceness of the others, with its DHT process and P2P daemon."""
        if name not in self.niced:
            return
        self.niced.discard(name)
        try:
            root = psutil.Process(self.processes[name].pid)
            for process in [root, *root.children(recursive=True)]:
                process.nice(0)
        except psutil.NoSuchProcess:
            pass  # struck again meanwhile: its restart starts niced

    def restart_times(self) -> list[Restart]:
        """How long each restarted process took to join the swarm and to serve, read from its log."""
        return start_times(self.restarted_at)

    def alive(self, name: str) -> bool:
        return self.processes[name].popen.poll() is None

    def log_text(self, name: str) -> str:
        log = self.processes[name].log
        return log.read_text(errors="replace") if log.exists() else ""

    def span(self, name: str) -> range:
        """The blocks the peer's log says it serves now (empty before it serves)."""
        found = SPAN_LINE.findall(self.log_text(name))
        return range(int(found[-1][0]), int(found[-1][1])) if found else range(0)

    def copies(self, name: str) -> frozenset[int]:
        """The blocks the peer's log says it holds standby copies of now (of the adapter it last logged)."""
        found = COPIES_LINE.findall(self.log_text(name))
        if not found or found[-1] == "nothing":
            return frozenset()
        runs = [run.split(":") for run in found[-1].split(",")]
        return frozenset(b for start, end in runs for b in range(int(start), int(end)))

    def name_of(self, peer_id: str) -> str | None:
        for name in list(self.processes):
            if f" as {peer_id}" in self.log_text(name):
                return name
        return None

    def logs(self) -> list[Path]:
        """Every peer's log, restarts included."""
        return sorted(p for p in self.local.workdir.glob("*.log") if p.name.split(".")[0] in self.processes)


@dataclass
class ChurnStats:
    """What the chaos did: events applied by kind and phase, outages, and the overlaps that may lose a step."""

    applied: dict[str, int] = field(default_factory=dict)
    outages: list[Outage] = field(default_factory=list)

    def count(self, what: str) -> None:
        self.applied[what] = self.applied.get(what, 0) + 1

    def shared_outages(self) -> list[tuple[Outage, Outage]]:
        """Pairs of overlapping outages of peers that held a common block's state (served, or as a standby copy): the
        only case where a step may be lost (every block's state lives on at least two peers)."""
        pairs = []
        for a, b in itertools.combinations(self.outages, 2):
            overlap = a.since < (b.until or float("inf")) and b.since < (a.until or float("inf"))
            if overlap and a.name != b.name and a.held & b.held:
                pairs.append((a, b))
        return pairs


class ChaosDriver:
    """Applies a schedule to ChaosPeers from a background thread; restarts every stricken peer after
    ``restart_delay`` (or leaves it gone when the swarm has more than ``target_size`` peers, so joins and
    departures balance). ``on_request`` is the client-side hook for phase-aimed strikes."""

    def __init__(
        self,
        peers: ChaosPeers,
        schedule: list[ChaosEvent],
        restart_delay: float = 2.0,
        target_size: int | None = None,
        max_size: int | None = None,
    ):
        self.peers, self.schedule = peers, schedule
        self.restart_delay = restart_delay
        self.target_size = target_size or len(peers.processes)
        self.max_size = max_size or self.target_size + 2
        self.stats = ChurnStats()
        self.started = 0.0
        self.actions: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()
        self.lock = threading.Lock()
        self.armed: ChaosEvent | None = None
        self.armed_until = 0.0
        self.joins = itertools.count(1)
        self.stopping = threading.Event()
        self.released = threading.Event()
        # Peers are restarted from this thread, and a child started by a thread is SIGKILLed when that thread ends
        # (PR_SET_PDEATHSIG follows the thread): it lives on, idle, until close().
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    # --- scheduling -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.started = time.monotonic()
        for event in self.schedule:
            self._later(event.at, lambda event=event: self._fire(event))
        self.thread.start()

    def stop(self) -> None:
        """Stop striking; thaw frozen peers so that the swarm can finish."""
        self.stopping.set()
        with self.lock:
            for name in list(self.peers.processes):
                if self.peers.alive(name):
                    self.peers.processes[name].signal(signal.SIGCONT)
            for outage in self.stats.outages:
                if outage.until is None:
                    outage.until = self.now()

    def close(self) -> None:
        """End the driver's thread: only once the peers it restarted are stopped (see ``thread``)."""
        self.stopping.set()
        self.released.set()
        if self.thread.ident is not None:
            self.thread.join(10)

    def now(self) -> float:
        return time.monotonic() - self.started

    def _later(self, at: float, action: Callable[[], None]) -> None:
        with self.lock:
            heapq.heappush(self.actions, (at, next(self.order), action))

    def _run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                due = self.actions and self.actions[0][0] <= self.now()
                action = heapq.heappop(self.actions)[2] if due else None
            if action is None:
                self._expire_armed()
                self._mark_recovered()
                self.stopping.wait(0.05)
                continue
            try:
                action()
            except Exception:  # the boundary of the driver's loop: log it, and strike on
                logger.exception("chaos action failed")
        self.released.wait()

    # --- striking -------------------------------------------------------------------------------------------------

    def _fire(self, event: ChaosEvent) -> None:
        if event.kind == "join":
            self._join()
        elif event.phase == MOVE:
            self._watch_moves(event, self._moves_so_far(), self.now() + MOVE_WAIT)
        elif event.phase is not None:
            self._expire_armed(force=True)
            with self.lock:
                self.armed, self.armed_until = event, self.now() + PHASE_WAIT
        else:
            self._strike(event, self._targets(event))

    def _targets(self, event: ChaosEvent) -> list[str]:
        """The event's live targets; a target already down is replaced by a live peer (in name order), so that an
        event is not skipped because an earlier one struck its peer."""
        alive = [name for name in sorted(self.peers.processes) if self.peers.alive(name)]
        chosen = [t for t in event.targets if t in alive]
        spare = [name for name in alive if name not in chosen]
        return chosen + spare[: len(event.targets) - len(chosen)]

    def _moves_so_far(self) -> dict[str, int]:
        return {name: len(MOVE_LINE.findall(self.peers.log_text(name))) for name in list(self.peers.processes)}

    def _watch_moves(self, event: ChaosEvent, before: dict[str, int], until: float) -> None:
        """Strike the first peer whose log shows a new move (it is loading or taking state for its new blocks)."""
        moving = [n for n, count in self._moves_so_far().items() if count > before.get(n, 0) and self.peers.alive(n)]
        if moving:
            self._strike(event, moving[:1])
        elif self.now() > until:
            self._strike(event, self._targets(event), late=True)
        else:
            self._later(self.now() + 0.5, lambda: self._watch_moves(event, before, until))

    def _expire_armed(self, force: bool = False) -> None:
        """An armed strike whose request did not come in PHASE_WAIT s (the client paused, or its next event is due)
        hits its scheduled targets: a schedule's events are all applied, whatever the client does."""
        with self.lock:
            event = self.armed
            if event is None or not (force or self.now() > self.armed_until):
                return
            self.armed = None
        self._strike(event, self._targets(event), late=True)

    def on_request(self, method: str, peer_id: str) -> None:
        """Called by the client before each request: an armed phase strike hits the peer it is about to call."""
        with self.lock:
            event = self.armed
            if event is None or method != REQUEST_OF.get(event.phase, event.phase):
                return
            self.armed = None
        if self.now() > self.armed_until:
            self._strike(event, self._targets(event), late=True)
            return
        name = self.peers.name_of(peer_id)
        if name is None or not self.peers.alive(name):
            return
        if event.phase in LAGGED:
            self._later(self.now() + event.lag, lambda: self._strike(event, [name] if self.peers.alive(name) else []))
        else:
            self._strike(event, [name])

    def _strike(self, event: ChaosEvent, names: list[str], late: bool = False) -> None:
        if not names or self.stopping.is_set():
            return
        kind = event.kind
        self.stats.count(f"{kind}@{event.phase}" if event.phase and not late else kind)
        for name in names:
            self._outage(name)
            process = self.peers.processes[name]
            copies = sorted(self.peers.copies(name))
            held = f"blocks {_span_text(self.peers.span(name))}" + (f", copies {spans_text(copies)}" if copies else "")
            logger.info("chaos t=%.1fs: %s %s (%s)", self.now(), kind, name, held)
            if kind == "freeze":
                process.signal(signal.SIGSTOP)
                then = signal.SIGCONT if event.thaw else signal.SIGKILL
                self._later(self.now() + event.hold, lambda p=process, s=then, n=name: self._thaw(p, s, n))
            else:
                process.signal(signal.SIGTERM if kind == "term" else signal.SIGKILL)
                self._later(self.now() + self.restart_delay, lambda n=name, p=process: self._restart(n, p))

    def _thaw(self, process: Process, sig: int, name: str) -> None:
        process.signal(sig)
        if sig == signal.SIGKILL:
            self._later(self.now() + self.restart_delay, lambda: self._restart(name, process))
        else:
            self._recovered(name)

    def _restart(self, name: str, process: Process) -> None:
        """Start ``name`` again once ``process`` is gone; only once per process: a peer struck again while going
        down (in its leave grace, or frozen) has two restarts queued, and two processes sharing one identity and
        checkpoint dir are not a peer (requests for its id reach either one)."""
        if self.stopping.is_set() or self.peers.processes[name] is not process:
            return
        try:
            process.popen.wait(30)  # a clean leave takes its grace period
        except subprocess.TimeoutExpired:
            process.signal(signal.SIGKILL)
            process.popen.wait(10)
        if sum(self.peers.alive(n) for n in self.peers.processes) >= self.target_size:
            logger.info("chaos t=%.1fs: %s stays gone (the swarm has its size)", self.now(), name)
            self._recovered(name)
            return
        logger.info("chaos t=%.1fs: restarting %s", self.now(), name)
        self.peers.start(name)

    def _join(self) -> None:
        if sum(self.peers.alive(n) for n in self.peers.processes) >= self.max_size:
            return
        name = f"joiner{next(self.joins)}"
        logger.info("chaos t=%.1fs: %s joins", self.now(), name)
        self.stats.count("join")
        self.peers.start(name)

    # --- outages --------------------------------------------------------------------------------------------------

    def _outage(self, name: str) -> None:
        with self.lock:
            pid = self.peers.processes[name].pid
            outage = Outage(name, self.peers.span(name), self.now(), pid, copies=self.peers.copies(name))
            self.stats.outages.append(outage)

    def _recovered(self, name: str) -> None:
        with self.lock:
            for outage in self.stats.outages:
                if outage.name == name and outage.until is None:
                    outage.until = self.now()

    def _mark_recovered(self) -> None:
        """A restarted peer's outage ends when it serves again (its new log says so); a frozen one's when thawed."""
        for outage in [o for o in self.stats.outages if o.until is None]:
            restarted = self.peers.processes[outage.name].pid != outage.pid
            if restarted and self.peers.alive(outage.name) and "serving blocks" in self.peers.log_text(outage.name):
                self._recovered(outage.name)
                self.peers.serving(outage.name)


def _span_text(blocks: range) -> str:
    return f"{blocks.start}:{blocks.stop}" if blocks else "none"


def count_moves(logs: list[Path]) -> tuple[int, int, int]:
    """(moves, takeovers, torn checkpoint writes) from peers' logs: a takeover is a move that grows the span over
    orphaned blocks; a torn write is one a restarted peer found interrupted (a strike hit it while writing)."""
    moves = takeovers = torn = 0
    for log in logs:
        text = log.read_text(errors="replace")
        for a, b, c, d in MOVE_LINE.findall(text):
            moves += 1
            takeovers += int(d) - int(c) > int(b) - int(a)
        torn += text.count(TORN_WRITE_LINE)
    return moves, takeovers, torn


# Peer starts each event causes: a crash, a clean leave or a freeze ending in SIGKILL (after its hold) restarts its
# peer, a double crash two, a join starts one; a freeze that thaws starts none.
STARTS = {"kill": 1, "term": 1, "double-kill": 2, "join": 1}


class ShadowStarts:
    """Peer processes started in a swarm of their own at the moments a chaos schedule would start peers, each killed
    once it serves: a control run's load. It costs the machine what a restart costs (imports, loading, joining a DHT,
    a P2P daemon), while the training swarm sees no failure, so a run beside it tells how much of churn's cost on a
    shared machine is the CPU of restarts alone."""

    def __init__(self, local: LocalSwarm, model: Path, schedule: list[ChaosEvent], blocks: str, delay: float = 2.0):
        self.local, self.model, self.blocks = local, model, blocks
        self.starts = sorted(
            e.at + (e.hold if e.kind == "freeze" else 0.0) + delay
            for e in schedule
            for _ in range(STARTS.get(e.kind, int(not e.thaw)))
        )
        self.started_at: dict[Path, float] = {}  # each start's log -> when it was started
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shadow-starts", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.ident is not None:  # started
            self.thread.join(timeout=30.0)

    def restart_times(self) -> list[Restart]:
        """How long each start took to join its DHT and to serve, read from its log."""
        return start_times(self.started_at)

    def _run(self) -> None:
        begun, pending, live = time.monotonic(), list(self.starts), []
        while not self.stopping.is_set() and (pending or live):
            if pending and time.monotonic() - begun >= pending[0]:
                pending.pop(0)
                name = f"shadow{len(self.started_at) + 1}"
                started = time.time()
                process = self.local.start_peer(self.model, self.blocks, name=name, wait=False)
                self.started_at[process.log] = started
                live.append(process)
            for process in [p for p in live if SERVING_LINE in p.log.read_text(errors="replace")]:
                process.stop()
                live.remove(process)
            self.stopping.wait(0.2)
        for process in live:
            process.stop()
