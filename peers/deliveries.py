"""Chain outputs handed straight to the client: the chain's last hop puts its output here under the token its forward
named (``Delivery``), and the client's ``collect`` of that token takes it, whichever of the two arrives first. So
the output crosses one link (this peer's to the client's) instead of travelling back through every hop before.

What is held is bounded: an output waits at most its hold (the chain's timeout), and at most ``max_held`` outputs
of ``max_bytes`` in all wait for their collect (past that, ``offer`` declines and the forward answers along the
chain with its output, as without a delivery). A collect waits at most its own ``wait``, and at most
``max_waiting`` collects wait at once: past that the one waiting longest is answered ``undelivered`` (most likely
one its client gave up on: its chain broke before this peer). A token whose output expired, was taken or whose
collect gave up is remembered a while, so that a late collect or output is settled at once."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from swarm.net.deltas import Delta
from swarm.net.errors import UndeliveredError
from swarm.net.protocol import CollectReply, CollectRequest

logger = logging.getLogger(__name__)

MAX_HELD = 64  # outputs waiting for their collect
MAX_HELD_BYTES = 512 << 20
MAX_WAITING = 256  # collects waiting for their output
ENDED_KEPT = 4096  # settled tokens remembered, so that a late collect is refused at once


@dataclass
class _Held:
    reply: CollectReply
    nbytes: int
    expiry: asyncio.TimerHandle


def _nbytes(outputs: object) -> int:
    if isinstance(outputs, Delta):
        return outputs.nbytes()
    return outputs.numel() * outputs.element_size()


class Deliveries:
    """The outputs this peer holds for collects, and the collects waiting for outputs. Used from the peer's event
    loop only (the handlers), so it needs no lock."""

    def __init__(self, max_held: int = MAX_HELD, max_bytes: int = MAX_HELD_BYTES, max_waiting: int = MAX_WAITING):
        self.max_held, self.max_bytes, self.max_waiting = max_held, max_bytes, max_waiting
        self.held: dict[str, _Held] = {}
        self.waiting: dict[str, asyncio.Future] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # token -> why it is settled

    @property
    def held_bytes(self) -> int:
        return sum(h.nbytes for h in self.held.values())

    def offer(self, token: str, reply: CollectReply, hold: float) -> bool:
        """Hand a chain's output to the collect of ``token``, now if it waits, else held up to ``hold`` seconds.
        False: past the bounds, nothing kept (the caller answers along the chain with the output instead)."""
        waiting = self.waiting.get(token)
        if waiting is not None and not waiting.done():
            waiting.set_result(reply)
            return True
        if token in self.ended or token in self.held:
            logger.info("dropped a chain output for %s: %s", token, self.ended.get(token, "one is held already"))
            return True  # its collect gave up (or a duplicate): nobody takes it
        nbytes = _nbytes(reply.outputs)
        if len(self.held) >= self.max_held or self.held_bytes + nbytes > self.max_bytes:
            logger.warning(
                "holding %d chain outputs (%d B) for their collects already: this one goes back along the chain",
                len(self.held),
                self.held_bytes,
            )
            return False
        expiry = asyncio.get_running_loop().call_later(hold, self._expire, token, hold)
        self.held[token] = _Held(reply, nbytes, expiry)
        return True

    async def collect(self, request: CollectRequest) -> CollectReply:
        """The output of ``request.token``, now or once it is offered within ``request.wait`` seconds; refused
        (``UndeliveredError``) past the wait, for a token settled already, or while too many collects wait."""
        token = request.token
        held = self.held.pop(token, None)
        if held is not None:
            held.expiry.cancel()
            self._end(token, "taken by its collect")
            return held.reply
        if token in self.ended:
            raise UndeliveredError(f"no chain output for token {token} here: {self.ended[token]}")
        if token in self.waiting:
            raise UndeliveredError(f"a collect of token {token} waits here already")
        if len(self.waiting) >= self.max_waiting:
            oldest = next(iter(self.waiting))
            self.waiting.pop(oldest).set_exception(
                UndeliveredError(f"{self.max_waiting} newer collects wait here: this one, the oldest, is let go")
            )
            self._end(oldest, "its collect was let go for newer ones")
        future = self.waiting[token] = asyncio.get_running_loop().create_future()
        try:
            reply = await asyncio.wait_for(future, request.wait)
        except asyncio.TimeoutError:
            self._end(token, f"its collect gave up after {request.wait:.1f}s")
            raise UndeliveredError(
                f"no chain output for token {token} within {request.wait:.1f}s: its chain did not reach this peer "
                "or broke here"
            ) from None
        finally:
            if self.waiting.get(token) is future:
                del self.waiting[token]
        self._end(token, "taken by its collect")
        return reply

    def _expire(self, token: str, hold: float) -> None:
        if self.held.pop(token, None) is not None:
            logger.info("dropped a chain output for %s: no collect came within %.1fs", token, hold)
            self._end(token, f"held {hold:.1f}s without a collect, then dropped")

    def _end(self, token: str, why: str) -> None:
        self.ended[token] = why
        self.ended.move_to_end(token)
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
