"""One trainer per adapter: a lease in the DHT, renewed in the background, taken back by the same trainer."""

from __future__ import annotations

import logging
import threading
import time

from hivemind import DHT
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


class AdapterBusyError(RuntimeError):
    """Another trainer holds the adapter's lease."""


def lease_key(model: str, adapter: str) -> str:
    return f"swarm:{model}:adapter:{adapter}:lease"


class AdapterLease:
    """The right to train ``adapter``. ``trainer`` names who holds it: a restarted process with the same trainer
    name takes it back at once; a different trainer waits until the holder's lease expires."""

    def __init__(self, dht: DHT, model: str, adapter: str, trainer: str, session: str, ttl: float = 30.0):
        self.dht, self.key, self.trainer, self.session, self.ttl = dht, lease_key(model, adapter), trainer, session, ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict | None:
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict) or found.expiration_time < get_dht_time():
            return None
        return None if found.value.get("released") else found.value

    def acquire(self, patience: float) -> None:
        """Take the lease, waiting up to ``patience`` seconds for another trainer's lease to expire."""
        deadline = time.monotonic() + patience
        while True:
            holder = self.holder()
            if holder is None or holder.get("trainer") == self.trainer:
                self._write()
                if (self.holder() or {}).get("session") == self.session:
                    break
            elif time.monotonic() > deadline:
                raise AdapterBusyError(
                    f"adapter is being trained by {holder.get('trainer')!r}; stop that trainer, wait for its lease "
                    f"to expire ({self.ttl:.0f}s after it stops), or pick another adapter name"
                )
            time.sleep(1.0)
        self._thread = threading.Thread(target=self._renew_loop, name="swarm-lease", daemon=True)
        self._thread.start()
        logger.info("holding the lease of %s as trainer %r", self.key, self.trainer)

    def _write(self, released: bool = False) -> None:
        value = {"trainer": self.trainer, "session": self.session, "released": released}
        self.dht.store(self.key, value, get_dht_time() + self.ttl)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._write()
            except Exception as e:
                logger.warning("could not renew the adapter lease: %s", e)

    def release(self) -> None:
        self._stop.set()
        try:
            self._write(released=True)
        except Exception as e:
            logger.warning("could not release the adapter lease: %s", e)
