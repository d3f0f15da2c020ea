"""A router's view of the swarm kept fresh in the background: a look every ``refresh_every`` seconds, or at once when
asked (at a trainer's step start: swarm/client/session.py), on a thread of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from swarm.net.errors import PEER_ERRORS

logger = logging.getLogger(__name__)


class ViewRefresh:
    """Runs ``refresh`` (one look at the DHT) every ``every`` seconds, or sooner (``refresh_soon``), until
    ``stop()``."""

    def __init__(self, refresh: Callable[[], None], every: float):
        self._refresh, self._every = refresh, every
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._fresh = threading.Event()
        self._fresh.set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="swarm-router", daemon=True)
        self._thread.start()

    def refresh_soon(self) -> None:
        """Refresh in the background now."""
        self._fresh.clear()
        self._wake.set()

    def wait_fresh(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the refresh asked by ``refresh_soon`` to finish: a step that starts with
        both sees every peer that had announced itself by then, so a peer that joined or moved is brought in, and
        compared with the replicas it joins, before the step's micro-batches are routed."""
        self._fresh.wait(timeout)

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._every)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._refresh()
            except PEER_ERRORS as e:
                logger.warning("could not refresh the swarm view: %s", e)
            except Exception:  # the boundary of a background loop: the client goes on with the view it has
                logger.exception("refreshing the swarm view failed")
            finally:
                self._fresh.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
