"""What a peer's moves were and why: one line in its log per move, and the last hour's moves in its ``info`` (so
``swarm status --peers`` and the health page can show an operator a peer that keeps moving, and why it did)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from swarm.net.protocol import MoveEntry

logger = logging.getLogger(__name__)

KEPT_SECONDS = 3600.0  # moves older than this are forgotten: an operator asks "what moved lately"
MAX_KEPT = 64  # a peer moving more often than this an hour is broken; its info stays small all the same


class MoveLog:
    """The moves this peer made, newest last, within ``KEPT_SECONDS``."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.entries: deque[MoveEntry] = deque(maxlen=MAX_KEPT)

    def starting(self, source: range, target: range, reason: str) -> None:
        """The one line of a move in the peer's log, with its reason (a move may still be called off)."""
        logger.info("moving from blocks %s to %s: %s", _text(source), _text(target), reason)

    def add(self, source: range, target: range, reason: str) -> MoveEntry:
        """A move made: the peer now serves ``target``."""
        entry = MoveEntry(self.clock(), source.start, source.stop, target.start, target.stop, reason)
        self.entries.append(entry)
        return entry

    def recent(self, seconds: float = KEPT_SECONDS) -> list[MoveEntry]:
        since = self.clock() - seconds
        return [entry for entry in self.entries if entry.at >= since]


def _text(span: range) -> str:
    return f"{span.start}:{span.stop}"
