"""The doors of any swarm process: decode, size limits, swarm-key check, ``hello``, refusals as clear errors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import AsyncIterator, Protocol  # noqa: UP035 -- matches the doors' signatures

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from swarm.net import lanes
from swarm.net.errors import TRANSPORT_ERRORS, RemoteError, RequestError
from swarm.net.message import Message, payload_bytes
from swarm.net.protocol import (
    RELAY_TIMEOUT,
    RELAY_TO,
    ErrorKind,
    HelloReply,
    HelloRequest,
    Method,
    PingReply,
    PingRequest,
    ReachableReply,
    ReachableRequest,
    Reply,
    Request,
    error_message,
    method_of,
    read_peer,
    read_request,
    refusal,
)
from swarm.net.reachability import ReachabilityProbe
from swarm.net.security import SwarmKey
from swarm.net.transport import Transport
from swarm.net.wire import DEFAULT_MAX_PAYLOAD_BYTES, PeerDoors, WireError, collect, decode, encode, verify

logger = logging.getLogger(__name__)

# A method's handler: its typed request in (decoded and checked against the registry), its typed reply out.
Handler = Callable[[Request], Awaitable[Reply]]
# A message in, a message out: what a fault hook wraps (the request as it arrived, before it is read).
MessageHandler = Callable[[Message], Awaitable[Message]]


MAX_ARRIVALS = 1024  # messages whose lanes are arriving at once, from all callers
RELAY_CALL_TIMEOUT = 600.0  # the longest a relay waits for the peer it passes a request on to


class DroppedReply(Exception):
    """A fault hook handled the request (or not) and lost its reply: the door fails, the caller sees a broken
    call rather than an answer."""


class FaultHook(Protocol):
    """Runs each request's handler, or fails around it: how tests inject failures into real peers
    (``swarm.testing.faults``) without patching them."""

    async def around(self, method: str, handler: MessageHandler, message: Message) -> Message: ...


class Doorkeeper:
    """Receives requests on the unary and stream doors and answers each one, whatever it holds. A request for
    another peer (``relay_to``: a peer behind NAT that keeps a connection here) is passed on to it."""

    def __init__(
        self,
        swarm_key: SwarmKey | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        relays: bool = True,
        faults: FaultHook | None = None,
        lane_wait: float = lanes.LANE_WAIT,
    ):
        self.swarm_key, self.max_payload_bytes, self.relays = swarm_key, max_payload_bytes, relays
        self.faults, self.lane_wait = faults, lane_wait
        self.probe = ReachabilityProbe()
        self.me, self.relay = "", None  # set by register()
        self.handlers: dict[str, Handler] = {
            Method.HELLO: self._hello,
            Method.PING: self._ping,
            Method.REACHABLE: self._reachable,
        }
        self.arrivals: dict[tuple, lanes.Arrivals] = {}  # (caller, message id) -> lanes received so far
        # method -> tensor bytes answered (before the wire's codec): what this node's replies carried, relayed ones too
        self.replied: Counter[str] = Counter()
        self._settling: set[asyncio.Task] = set()

    async def register(self, p2p: P2P) -> None:
        self.me = p2p.peer_id.to_base58()
        self.relay = Transport(p2p, self.swarm_key, self.max_payload_bytes)
        await PeerDoors().add_p2p_handlers(p2p, wrapper=self)

    async def unregister(self, p2p: P2P) -> None:
        await PeerDoors().remove_p2p_handlers(p2p)
        await self.probe.shutdown()

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertRequest:
        if request.ByteSize() > self.max_payload_bytes:
            reply = error_message(
                ErrorKind.TOO_LARGE, f"request exceeds this peer's {self.max_payload_bytes}-byte limit"
            )
        else:
            reply = await self.handle([request], context)
        parts = encode(reply)
        if len(parts) > 1:
            return encode(error_message(ErrorKind.TOO_LARGE, "reply too large for a unary call; use the stream door"))[
                0
            ]
        return parts[0]

    async def rpc_lane(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertRequest:
        """One lane of a message sent over parallel calls: the last lane in has the message handled; every lane
        answers with its share of the reply."""
        try:
            index, count, parts = lanes.lane_of(request)
            if not 0 < len(request.uid) <= 64:
                raise WireError("a lane needs a message id of 1 to 64 characters")
        except WireError as e:
            return lanes.pack(encode(error_message(ErrorKind.BAD_REQUEST, str(e))), 1)[0]
        self._expire_arrivals()
        key = (context.remote_id, request.uid)
        arrivals = self.arrivals.get(key)
        if arrivals is None:
            arrivals = self.arrivals[key] = lanes.Arrivals(count)
        arrivals.size += request.ByteSize()
        if arrivals.count != count or index in arrivals.parts or len(self.arrivals) > MAX_ARRIVALS:
            self._answer(arrivals, error_message(ErrorKind.BAD_REQUEST, "lanes of a message disagree or repeat"))
        elif arrivals.size > self.max_payload_bytes:
            self._answer(arrivals, error_message(ErrorKind.TOO_LARGE, f"request exceeds {self.max_payload_bytes} B"))
        else:
            arrivals.arrived(index, parts)
            if arrivals.complete and not arrivals.reply.done():
                self._answer(arrivals, self.handle(arrivals.ordered(), context))
        try:
            reply = await arrivals.replied(self.lane_wait)
        except asyncio.TimeoutError:
            reply = encode(error_message(ErrorKind.BAD_REQUEST, "the other lanes of this message never came"))
        finally:
            arrivals.answered += 1
            if arrivals.answered >= arrivals.count:
                self.arrivals.pop(key, None)
        if len(reply) == 1:
            return lanes.pack(reply, 1)[0]  # a reply of one part (a refusal, a small answer) goes whole on every lane
        return lanes.pack(reply, count)[index]

    def _answer(self, arrivals: lanes.Arrivals, reply: Message | Awaitable[Message]) -> None:
        """Settle a message's reply once (handled in a task of its own: a lane given up by its caller must not
        cancel the work the other lanes wait for)."""

        async def settle() -> None:
            try:
                message = reply if isinstance(reply, Message) else await reply
            except DroppedReply as e:
                if not arrivals.reply.done():
                    arrivals.reply.set_exception(e)  # every lane's call fails
                return
            if not arrivals.reply.done():
                size = lanes.chunk_bytes(payload_bytes(message.tensors))
                arrivals.reply.set_result(encode(message, chunk_bytes=size))

        task = asyncio.ensure_future(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _expire_arrivals(self) -> None:
        """Forget messages whose lanes stopped coming (their caller gave up or died)."""
        now = time.monotonic()
        for key in [k for k, a in self.arrivals.items() if not a.complete and now - a.started > 2 * self.lane_wait]:
            del self.arrivals[key]

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        try:
            parts = await collect(requests, self.max_payload_bytes)
            reply = await self.handle(parts, context)
        except WireError as e:
            reply = error_message(ErrorKind.TOO_LARGE if "limit" in str(e) else ErrorKind.BAD_REQUEST, str(e))
        for part in encode(reply):
            yield part

    async def handle(self, parts: list[runtime_pb2.ExpertRequest], context: P2PContext) -> Message:
        """Decode, check the swarm key, pass on what is for another peer; else read the request through the registry,
        run its handler and encode the reply. A refusal is answered, never raised."""
        try:
            message = decode(parts)
            method = method_of(message.meta)
            if self.swarm_key is not None and method != Method.HELLO:
                try:
                    verify(self.swarm_key, message, parts)
                except WireError as e:
                    return error_message(ErrorKind.UNAUTHORIZED, str(e))
            if message.meta.get(RELAY_TO, self.me) != self.me:
                return self._counted(method, await self._pass_on(message))
            handler = self.handlers.get(method) if isinstance(method, str) else None
            if handler is None:
                raise RequestError(f"unknown method {method!r}; known: {sorted(self.handlers)}")
            if self.faults is not None:
                return self._counted(method, await self.faults.around(method, partial(_typed, handler), message))
            return self._counted(method, await _typed(handler, message))
        except RequestError as e:
            logger.info("refused a request from %s: %s", context.remote_id, e)
            return refusal(e)
        except WireError as e:
            logger.info("refused a request from %s: %s", context.remote_id, e)
            return error_message(ErrorKind.BAD_REQUEST, str(e))
        except DroppedReply:
            raise
        except Exception as e:  # the boundary: a bug here answers `internal` and the peer serves on
            logger.exception("request from %s failed", context.remote_id)
            return error_message(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")

    def _counted(self, method: object, reply: Message) -> Message:
        self.replied[str(method)] += payload_bytes(reply.tensors)
        return reply

    async def _pass_on(self, message: Message) -> Message:
        """Relay a request to the peer it is for, over that peer's own connection here; its answer goes back as is."""
        target = read_peer(message.meta, RELAY_TO)
        if not self.relays:
            return error_message(ErrorKind.UNREACHABLE, "this node does not relay (started with --no-relay)")
        timeout = message.meta.get(RELAY_TIMEOUT)
        timeout = float(timeout) if isinstance(timeout, int | float) and 0 < timeout < RELAY_CALL_TIMEOUT else None
        if not await self.relay.connected(target):
            return error_message(ErrorKind.UNREACHABLE, f"{target} keeps no connection to this relay")
        try:
            return await self.relay.acall(target, message, timeout or RELAY_CALL_TIMEOUT, direct=True)
        except RemoteError as e:
            return Message(e.meta, [])
        except TRANSPORT_ERRORS as e:
            return error_message(ErrorKind.UNREACHABLE, f"this relay cannot reach {target}: {type(e).__name__} {e}")

    async def _ping(self, request: PingRequest) -> PingReply:
        """Answered here, on the event loop: a caller timing its link to this node must not time this node's
        compute queue."""
        return PingReply(0 if request.payload is None else request.payload.numel())

    async def _reachable(self, request: ReachableRequest) -> ReachableReply:
        """Dial the asking peer back (``maddrs``), or, for a peer behind NAT (``relayed``), say whether this node
        will pass requests on to it: it relays and holds the peer's connection."""
        if not request.relayed:
            return await self.probe.handle(request)
        if not self.relays:
            return ReachableReply(False, "this node does not relay (started with --no-relay)", refused=True)
        return ReachableReply(await self.relay.connected(request.peer))

    async def _hello(self, request: HelloRequest) -> HelloReply:
        """Who we are, unauthenticated: lets a newcomer tell 'private swarm' or 'wrong key' from other failures."""
        return HelloReply(self.swarm_key is not None, None if self.swarm_key is None else self.swarm_key.key_id)


async def _typed(handler: Handler, message: Message) -> Message:
    """Read the request through the registry, run its handler, and encode the typed reply."""
    reply = await handler(read_request(message))
    return reply.to_message()
