"""Calling peers on behalf of one adapter: what counts as a peer's fault, its ban, and retries within patience."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID

from swarm.client.current import CurrentPeers
from swarm.client.routing import Hop, Router
from swarm.net.chain import MAX_ROUTE_MADDRS
from swarm.net.compression import WireFormat
from swarm.net.errors import (
    TRANSPORT_ERRORS,
    LeaseLostError,
    RemoteError,
    ReplyError,
    SwarmError,
    SwarmUnavailableError,
)
from swarm.net.message import Message
from swarm.net.protocol import PEER_STATE_ERRORS, ErrorKind, Held, Reply, Request, method_of, read_reply
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

# A request sent on: the call itself, its timeout, ban and error handling included (what a call hook is handed).
Send = Callable[[Message], Message]
# Sees each request the client makes, with the peer it goes to, and sends it on (or runs code before or after it):
# how tests watch a client's requests or time a fault at one (``swarm.testing.faults.CallTap``) without patching.
CallHook = Callable[[PeerID, Message, Send], Message]
# Handed a call in flight (the transport's future), so that another thread may cancel it.
Started = Callable[[Future], None]


class PeerFailure(SwarmError):
    """A peer failed or refused for its own reasons; the peer is banned and the work goes elsewhere."""

    def __init__(self, peer: PeerID, reason: str):
        super().__init__(f"{peer}: {reason}")
        self.peer, self.reason = peer, reason


@dataclass
class Recovery:
    """A failure the client routed around: who, during what, and how long the retry took."""

    peer: PeerID
    during: str
    step: int
    seconds: float
    reason: str = ""  # what the peer did: the failure that was routed around


class PeerCalls:
    """Every request the client makes for its adapter goes through ``ask``: the transport's errors and a peer's
    refusals for its own state become ``PeerFailure`` after a ban (and the peer's step is forgotten); a refusal of
    the request itself raises. Anything else is a bug on this side and surfaces. ``hook``: sees each request (see
    ``CallHook``); None costs nothing."""

    def __init__(
        self,
        transport: Transport,
        router: Router,
        current: CurrentPeers,
        adapter: str,
        patience: float,
        wire: WireFormat | None = None,
        hook: CallHook | None = None,
    ):
        self.transport, self.router, self.current = transport, router, current
        self.adapter, self.patience = adapter, patience
        self.wire = wire or WireFormat()
        self.hook = hook
        self.recoveries: list[Recovery] = []

    def holder_maddrs(self, ledger: dict[int, dict[str, Held]]) -> dict[str, list[str]]:
        """Where this client reaches the holders a ledger names: a replica fetching from one it found gone, or knows
        at an older address (restarted on another port), dials it there instead of failing at once."""
        holders = {held.holder for by_mb in ledger.values() for held in by_mb.values()}
        known = {peer.to_base58(): maddrs for peer, maddrs in self.transport.addresses.items()}
        return {peer: list(known[peer][:MAX_ROUTE_MADDRS]) for peer in sorted(holders) if known.get(peer)}

    def ask(
        self,
        peer: PeerID,
        request: Request,
        units: float = 1.0,
        floor: float = 0.0,
        measured: bool = True,
        started: Started | None = None,
    ) -> Reply:
        """One typed request, its typed reply; failures of the peer (a reply that breaks its schema too) become
        PeerFailure after a ban, refusals of the request raise. ``measured``: the time it takes is the peer's own
        (not that of a chain behind it). ``started``: handed the call in flight, for another thread to cancel."""
        message = request.to_message()
        call = partial(self.call, peer, units=units, floor=floor, measured=measured, started=started)
        reply = call(message) if self.hook is None else self.hook(peer, message, call)
        try:
            return read_reply(request, reply)
        except ReplyError as e:
            raise self.peer_failed(peer, str(e)) from e

    def call(
        self,
        peer: PeerID,
        message: Message,
        units: float = 1.0,
        floor: float = 0.0,
        measured: bool = True,
        started: Started | None = None,
    ) -> Message:
        """One encoded request (what :meth:`ask` sends, through the hook if there is one); failures of the peer
        become PeerFailure (after a ban), refusals of the request raise."""
        method = str(method_of(message.meta))
        since = time.monotonic()
        timeout = floor + self.router.timeout(peer, method, units)
        try:
            reply = self.transport.call(peer, message, timeout, watch=True, started=started)
        except RemoteError as e:
            if e.kind == ErrorKind.FENCED:
                raise LeaseLostError(str(e)) from None
            if e.kind == ErrorKind.WEIGHTS_MISMATCH:  # another model under the same name: never route to it
                self.router.distrust(peer, str(e))
                self.current.forget(peer)
                raise PeerFailure(peer, str(e)) from e
            if e.kind not in PEER_STATE_ERRORS:
                raise
            raise self.peer_failed(peer, str(e)) from e
        except TRANSPORT_ERRORS as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise self.peer_failed(peer, f"{method}: {reason}") from e
        self.router.succeeded(peer, method, units, time.monotonic() - since if measured else None)
        return reply

    def likely_reachable(self, peer: PeerID) -> bool:
        """Whether this client may reach ``peer`` itself (see ``Transport.likely_reachable``)."""
        return RemoteExpertWorker.run_coroutine(self.transport.likely_reachable(peer))

    def answers(self, peer: PeerID) -> bool:
        """Whether ``peer`` answers hello (alive, however busy: ``Transport.answers``); one that does not is banned
        and its step forgotten, like a failed call."""
        if RemoteExpertWorker.run_coroutine(self.transport.answers(peer)):
            return True
        self.peer_failed(peer, "it does not answer hello")
        return False

    def peer_failed(self, peer: PeerID, reason: str) -> PeerFailure:
        """Ban the peer for a while and forget its step; the work goes elsewhere."""
        self.router.ban(peer, reason)
        self.current.forget(peer)
        return PeerFailure(peer, reason)

    def attempts(self, during: str) -> Attempts:
        """The retry of one piece of work (a hop, a segment, a token) over whichever replicas are live."""
        return Attempts(self, during)

    def recovered(self, failed: PeerID | None, during: str, step: int, since: float | None, reason: str = "") -> None:
        if failed is None or since is None:
            return
        seconds = time.monotonic() - since
        self.recoveries.append(Recovery(failed, during, step, seconds, reason))
        logger.warning(
            "recovered from the failure of peer %s during %s (step %d) in %.2fs%s",
            failed,
            during,
            step,
            seconds,
            f" ({reason})" if reason else "",
        )


class Attempts:
    """One piece of work tried on one replica after another. The first failure starts the patience clock; work
    that keeps failing on every server (each one answering with an internal error, say) is given up after
    ``patience`` rather than retried forever; success records the recovery. What counts as a peer's fault, and its
    ban with backoff, is ``PeerCalls.call``'s to say."""

    def __init__(self, calls: PeerCalls, during: str):
        self.calls, self.during = calls, during
        self.last_failed: PeerID | None = None
        self.last_reason = ""
        self.since: float | None = None

    def failed(self, error: PeerFailure, hop: Hop) -> None:
        """Note a failure on ``hop``; raise SwarmUnavailableError once the work has failed for ``patience``."""
        self.last_failed, self.last_reason, self.since = error.peer, error.reason, self.since or time.monotonic()
        if time.monotonic() - self.since > self.calls.patience:
            raise SwarmUnavailableError(
                f"blocks {hop.start}:{hop.end} have failed on every server tried for {self.calls.patience:.0f}s; "
                f"the last error: {error}. See that peer's log, or raise the client's patience"
            ) from error

    def succeeded(self, step: int) -> None:
        """The work went through: a recovery, if it had failed; the next piece starts with a clean slate."""
        self.calls.recovered(self.last_failed, self.during, step, self.since, self.last_reason)
        self.last_failed = self.since = None
        self.last_reason = ""
