"""One trainer per adapter: a lease in the DHT, renewed in the background, taken back by the same trainer."""

from __future__ import annotations

import logging
import threading

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.net.errors import TRANSPORT_ERRORS, AdapterBusyError
from swarm.net.waiting import Deadline, WaitLine

logger = logging.getLogger(__name__)


def lease_key(model: str, adapter: str) -> str:
    return f"swarm:{model}:adapter:{adapter}:lease"


class AdapterLease:
    """The right to train ``adapter``. ``trainer`` names who holds it: a restarted process with the same trainer
    name takes it back at once; a different trainer waits until the holder's lease expires."""

    def __init__(self, dht: DHT, model: str, adapter: str, owner: bytes, trainer: str, session: str, ttl: float = 30.0):
        self.dht, self.key, self.owner, self.ttl = dht, lease_key(model, adapter), owner, ttl
        self.trainer, self.session = trainer, session
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holders(self) -> list[dict]:
        """Live, unreleased leases on this adapter (each signed by its holder)."""
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        return [
            item.value
            for item in found.value.values()
            if item.expiration_time >= now and isinstance(item.value, dict) and not item.value.get("released")
        ]

    def acquire(self, patience: float) -> None:
        """Take the lease, waiting up to ``patience`` seconds for another trainer's lease to expire."""
        deadline = Deadline(patience)
        waiting = WaitLine(f"waiting for the lease of {self.key}", deadline, logger)
        while others := [h for h in self.holders() if h.get("trainer") != self.trainer]:
            if deadline.passed:
                waiting.done("gave up")
                raise AdapterBusyError(
                    f"adapter is being trained by {others[0].get('trainer')!r}; stop that trainer, wait for its "
                    f"lease to expire ({self.ttl:.0f}s after it stops), or pick another adapter name"
                )
            waiting.update(f"trainer {others[0].get('trainer')!r} holds it until it expires")
            deadline.pause(1.0)
        waiting.done("free")
        self._write()
        self._thread = threading.Thread(target=self._renew_loop, name="swarm-lease", daemon=True)
        self._thread.start()
        logger.info("holding the lease of %s as trainer %r", self.key, self.trainer)

    def _write(self, released: bool = False) -> None:
        value = {"kind": "lease", "trainer": self.trainer, "session": self.session, "released": released}
        self.dht.store(self.key, value, get_dht_time() + self.ttl, subkey=self.owner)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._write()
            except TRANSPORT_ERRORS as e:
                logger.warning("could not renew the adapter lease: %s", e)
            except Exception:  # the boundary of a background loop: renew again next time
                logger.exception("renewing the adapter lease failed")

    def release(self) -> None:
        """Stop renewing (waiting for a renewal in flight) and mark the lease released, if it was ever taken."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._write(released=True)
        except TRANSPORT_ERRORS as e:
            logger.warning("could not release the adapter lease: %s", e)
