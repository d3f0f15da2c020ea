"""``swarm monitor``: a health page for a swarm, served by the standard library.

A background thread observes the swarm every ``refresh`` seconds, with the same observation and health state as
``swarm status`` (swarm/status.py, swarm/health.py), and keeps the last state; the HTTP server only hands it out:
``/api/v1/state`` as JSON, ``/`` and its assets from swarm/ops/monitor_static (no build step, no CDN). Anything that
goes wrong while observing becomes the state's ``error``, with what to do, and the next round tries again."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files

from swarm.net.errors import PEER_ERRORS, TRANSPORT_ERRORS, SwarmError
from swarm.net.security import SwarmKey
from swarm.ops.health import Tracker, build
from swarm.ops.status import NO_MODEL, Observer, no_such_model

logger = logging.getLogger(__name__)

API = "/api/v1/state"
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
RETRY_JOIN = 10.0  # seconds between attempts to join a swarm that refused or did not answer


@dataclass
class MonitorConfig:
    initial_peers: list[str]
    swarm_key: SwarmKey | None
    model: str | None = None
    replication: int = 2
    refresh: float = 3.0
    keep_gone: float = 600.0


@dataclass
class State:
    """What the page shows: the models' health from the last good round, and the last round's error, if any."""

    refresh: float
    updated_at: float | None = None
    error: str | None = None
    models: list[dict] = field(default_factory=list)


class Watcher:
    """Observes the swarm in a thread and keeps the newest ``State``; never lets an exception out."""

    def __init__(self, config: MonitorConfig):
        self.config = config
        self.tracker = Tracker(keep_gone=config.keep_gone)
        self.observer: Observer | None = None
        self.next_join = 0.0
        self.lock = threading.Lock()
        self.state = State(refresh=config.refresh, error="looking at the swarm for the first time...")
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="swarm-monitor", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)
        if self.observer is not None:
            self.observer.close()

    def snapshot(self) -> dict:
        with self.lock:
            return asdict(self.state)

    def _run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                models, error = self._round()
            except _Waiting:  # the previous error stands
                models, error = None, self.state.error
            except Exception as e:  # the boundary of a background loop: say so on the page and try again next round
                expected = isinstance(e, (SwarmError, *PEER_ERRORS))
                logger.warning("observing the swarm failed: %s", e, exc_info=not expected)
                models, error = None, _explain(e, self.config.refresh)
                if not isinstance(e, SwarmError):
                    self._drop_observer()  # rejoin: the DHT node may be what broke
            with self.lock:
                self.state.error = error
                if models is not None:
                    self.state.models, self.state.updated_at = models, time.time()
            self.stopping.wait(max(0.0, self.config.refresh - (time.monotonic() - started)))

    def _round(self) -> tuple[list[dict], str | None]:
        if self.observer is None:
            if time.monotonic() < self.next_join:
                raise _Waiting()
            self.next_join = time.monotonic() + max(RETRY_JOIN, self.config.refresh)
            self.observer = Observer(self.config.initial_peers, self.config.swarm_key)
        models = self.observer.models(self.config.model)
        if not models:
            served = self.observer.models() if self.config.model is not None else {}
            return [], NO_MODEL if self.config.model is None else no_such_model(self.config.model, served)
        states = []
        for name, num_blocks in sorted(models.items()):
            seen = self.observer.observe(name, num_blocks)
            health = build(name, num_blocks, seen.view, self.config.replication, seen.committed)
            states.append(asdict(self.tracker.update(health, time.time())))
        return states, None

    def _drop_observer(self) -> None:
        if self.observer is not None:
            try:
                self.observer.close()
            except TRANSPORT_ERRORS as e:
                logger.debug("closing the observer: %s", e)
            self.observer = None


class _Waiting(Exception):
    """Not yet time to try joining again; the previous error stands."""


def _explain(error: Exception, refresh: float) -> str:
    if isinstance(error, SwarmError):  # unreachable initial peers, a private swarm, a wrong key: says what to do
        return f"{error} (trying again every {max(RETRY_JOIN, refresh):.0f} s)"
    return (
        f"could not observe the swarm ({type(error).__name__}: {error}): check that the initial peers run and are "
        f"reachable from this machine; trying again every {refresh:g} s"
    )


class Handler(BaseHTTPRequestHandler):
    """GET only: the state as JSON, or one of the page's files."""

    watcher: Watcher  # set on the subclass made by ``serve``

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == API:
            self._send(HTTPStatus.OK, "application/json", json.dumps(self.watcher.snapshot()).encode())
        elif path in STATIC:
            name, kind = STATIC[path]
            self._send(HTTPStatus.OK, kind, files("swarm.ops").joinpath("monitor_static", name).read_bytes())
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", f"no such page: {path}; try / or {API}\n".encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        logger.debug("%s %s", self.address_string(), format % args)


def serve(config: MonitorConfig, host: str, port: int) -> tuple[ThreadingHTTPServer, Watcher]:
    """Start watching and serving (each in its own thread); the caller stops both with ``shutdown``."""
    watcher = Watcher(config)
    handler = type("BoundHandler", (Handler,), {"watcher": watcher})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    watcher.start()
    threading.Thread(target=server.serve_forever, name="swarm-monitor-http", daemon=True).start()
    return server, watcher


def shutdown(server: ThreadingHTTPServer, watcher: Watcher) -> None:
    server.shutdown()
    server.server_close()
    watcher.stop()
