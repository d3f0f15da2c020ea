"""Generation sessions a peer serves: one KV cache per session for the blocks it runs, so each new token costs one
small request instead of a re-run of the prefix. Memory is bounded (``--max-inference-mb``, reserved for the
session's whole length when it opens) and idle sessions are freed after ``--inference-timeout`` seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import DynamicCache

from swarm.net.errors import InferenceMemoryError, SessionLostError

logger = logging.getLogger(__name__)


@dataclass
class InferenceSession:
    """One client's generation through some blocks: the keys and values of the ``length`` tokens seen so far."""

    blocks: range
    batch: int
    max_length: int
    reserved: int  # bytes set aside for ``max_length`` tokens
    cache: DynamicCache
    length: int = 0
    last_used: float = field(default_factory=time.monotonic)


class InferenceSessions:
    """The sessions of one peer, within ``budget`` bytes; a session idle for ``timeout`` seconds is freed."""

    def __init__(self, budget: int, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.budget, self.timeout, self.clock = budget, timeout, clock
        self.sessions: dict[str, InferenceSession] = {}

    @property
    def reserved(self) -> int:
        return sum(s.reserved for s in self.sessions.values())

    def open(self, key: str, blocks: range, batch: int, max_length: int, reserve: int, cache: DynamicCache):
        """A new session (a reopened key starts over: the client replays its prefix)."""
        self.sessions.pop(key, None)
        self.expire()
        if self.reserved + reserve > self.budget:
            raise InferenceMemoryError(
                f"no room for a generation session of {batch}x{max_length} tokens on blocks "
                f"{blocks.start}:{blocks.stop} ({reserve / 2**20:.1f} MiB; {self.reserved / 2**20:.1f} of "
                f"{self.budget / 2**20:.0f} MiB in use by {len(self.sessions)} session(s)): the peer's "
                "--max-inference-mb is full. Try again later, generate shorter texts, or raise --max-inference-mb"
            )
        session = self.sessions[key] = InferenceSession(blocks, batch, max_length, reserve, cache)
        session.last_used = self.clock()
        return session

    def get(self, key: str) -> InferenceSession:
        self.expire()
        session = self.sessions.get(key)
        if session is None:
            raise SessionLostError(
                f"generation session {key} is not open here: it ended, was idle for more than "
                f"{self.timeout:.0f}s (--inference-timeout), or this peer restarted. Open a new one (the client "
                "replays the prefix)"
            )
        session.last_used = self.clock()
        return session

    def end(self, key: str) -> bool:
        return self.sessions.pop(key, None) is not None

    def expire(self) -> int:
        """Free the sessions idle for longer than ``timeout``; returns how many."""
        now = self.clock()
        idle = [key for key, s in self.sessions.items() if now - s.last_used > self.timeout]
        for key in idle:
            del self.sessions[key]
        if idle:
            logger.info("freed %d idle generation session(s)", len(idle))
        return len(idle)
