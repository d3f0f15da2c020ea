"""Calling a peer: pick unary or stream, encode, send, decode, and turn refusals into RemoteError."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from functools import partial

from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import as_aiter

from swarm.net import lanes
from swarm.net.addresses import dial, only_relayed, relay_of
from swarm.net.errors import TRANSPORT_ERRORS, ErrorKind, RemoteError
from swarm.net.message import Message, payload_bytes
from swarm.net.protocol import (
    RELAY_TIMEOUT,
    RELAY_TO,
    STREAMED_REPLIES,
    HelloRequest,
    Method,
    Reply,
    Request,
    expected_reply,
    method_of,
    raise_if_error,
    read_reply,
)
from swarm.net.records import ServerRecord
from swarm.net.security import SwarmKey
from swarm.net.suspects import suspect
from swarm.net.wire import DEFAULT_MAX_PAYLOAD_BYTES, PeerDoors, WireError, collect, decode, encode

STREAM_ATTEMPTS = 3
# What a live peer answers within seconds however busy (its event loop, a read of its state): a timeout of one of
# these says frozen or cut off, where a forward's or a commit's may only say loaded.
LIVENESS_METHODS = frozenset({Method.HELLO, Method.INFO})
PROBE_EVERY = 1.0  # seconds a watched call runs before (and between) asking whether its peer answers at all
PROBE_TIMEOUT = 3.0  # a peer that does not answer hello in this long is frozen or cut off, not merely busy
GONE_RECHECK = 3.0  # seconds after which a call to a peer found gone dials it once more (at most once that often)
RECHECK_DIAL_TIMEOUT = 2.0

logger = logging.getLogger(__name__)


class PeerGoneError(ConnectionError):
    """The peer's connection closed (its process died, or its machine left the network): not merely slow."""


class PeerFrozenError(TimeoutError):
    """The peer keeps its connection but answers nothing, not even hello: frozen (SIGSTOP, a hung machine) or cut
    off. Waiting for the call's own timeout would only wait longer."""


class Transport:
    """A way to call other peers' doors over hivemind P2P: async inside peers, sync for the client.

    It tells a peer that is gone from one that is only slow or frozen. A process that dies takes its TCP
    connections with it within milliseconds, while a frozen one keeps them open; so a peer this transport has
    been connected to and is not any more, or a failed call to a peer that leaves no connection behind, marks the
    peer gone. Calls to a gone peer fail at once (libp2p would spend ~20 s on a dial and a peer-routing search)
    until the peer announces itself again (``learn``).

    A peer may restart under the same id before its new record reaches this process (a ledger or a route names it
    first): a call to a peer found gone more than ``GONE_RECHECK`` seconds ago dials it once more, briefly, and
    brings it back if that works.

    A peer is dialed at the addresses from its own record (``learn``) before the first call, so reaching it never
    depends on libp2p's peer routing having found it; a peer behind NAT is reached through its relay.
    """

    def __init__(
        self,
        p2p: P2P,
        swarm_key: SwarmKey | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        on_unresponsive: Callable[[PeerID], None] | None = None,
    ):
        self.p2p, self.swarm_key, self.max_payload_bytes = p2p, swarm_key, max_payload_bytes
        self.on_unresponsive = on_unresponsive  # told of each peer a hello or info timed out on, still connected
        self.seen: set[PeerID] = set()  # peers this transport has had an answer from
        self.gone: dict[PeerID, float] = {}  # peer -> wall-clock time its connection was found closed
        self.rechecked: dict[PeerID, float] = {}  # gone peer -> wall-clock time of the last dial that tried it again
        self.addresses: dict[PeerID, list[str]] = {}  # peer -> the multiaddrs it announced
        self.laned: Counter[str] = Counter()  # method -> requests sent as parallel lanes (too large for one call)
        self.sent: Counter[str] = Counter()  # method -> tensor bytes of the requests sent (before the wire's codec)

    @classmethod
    def for_dht(cls, dht: DHT, swarm_key: SwarmKey | None = None) -> Transport:
        """A transport sharing the P2P daemon of a DHT, driven from synchronous code."""
        p2p = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())
        return cls(p2p, swarm_key, on_unresponsive=partial(suspect, dht))

    def call(
        self,
        peer: PeerID,
        message: Message,
        timeout: float | None = None,
        watch: bool = False,
        started: Callable[[Future], None] | None = None,
    ) -> Message:
        """Send ``message`` and wait for the reply; a refusal becomes a RemoteError. ``watch``: see :meth:`acall`.
        ``started`` is handed the call in flight, which another thread may cancel (then CancelledError here)."""
        call = RemoteExpertWorker.run_coroutine(self.acall(peer, message, timeout, watch=watch), return_future=True)
        if started is not None:
            started(call)
        return call.result()

    def ask(self, peer: PeerID, request: Request, timeout: float | None = None) -> Reply:
        """:meth:`aask`, from synchronous code."""
        return RemoteExpertWorker.run_coroutine(self.aask(peer, request, timeout))

    async def aask(
        self, peer: PeerID, request: Request, timeout: float | None = None, direct: bool = False, watch: bool = False
    ) -> Reply:
        """Send a typed request and read the typed reply: a refusal raises RemoteError, a reply that does not fit
        the method's schema ReplyError."""
        return read_reply(request, await self.acall(peer, request.to_message(), timeout, direct, watch))

    async def acall(
        self,
        peer: PeerID,
        message: Message,
        timeout: float | None = None,
        direct: bool = False,
        watch: bool = False,
    ) -> Message:
        """Call ``peer``; a peer behind NAT (announced only through relays) is called through one of its relays,
        unless ``direct`` (what a relay itself does). ``watch``: while the reply is awaited, ask the peer every
        ``PROBE_EVERY`` seconds whether it answers at all (hello); one that does not within ``PROBE_TIMEOUT`` is
        given up at once (PeerFrozenError) instead of at the end of ``timeout``, which may be long (a chain's)."""
        if not watch:
            return await self._acall(peer, message, timeout, direct)
        call = asyncio.ensure_future(self._acall(peer, message, timeout, direct))
        probe: asyncio.Future | None = None
        try:
            while True:
                waiting = {call} if probe is None else {call, probe}
                await asyncio.wait(waiting, timeout=PROBE_EVERY, return_when=asyncio.FIRST_COMPLETED)
                if call.done():
                    return call.result()
                if probe is None:
                    probe = asyncio.ensure_future(self.answers(peer, direct))
                elif probe.done():
                    if not probe.result():
                        raise PeerFrozenError(
                            f"peer {peer} stopped answering (not even hello within {PROBE_TIMEOUT:.0f}s): frozen or "
                            "cut off"
                        )
                    probe = None
        finally:
            for task in (call, probe):
                if task is not None and not task.done():
                    task.cancel()

    async def answers(self, peer: PeerID, direct: bool = False) -> bool:
        """Whether the peer answers hello (a refusal is an answer too): alive, however busy."""
        try:
            await self._acall(peer, HelloRequest().to_message(), PROBE_TIMEOUT, direct)
        except RemoteError:
            return True
        except TRANSPORT_ERRORS:
            return False
        return True

    async def _acall(self, peer: PeerID, message: Message, timeout: float | None, direct: bool) -> Message:
        relays = [] if direct else self._relays(peer)
        if relays:
            return await self._call_relayed(peer, relays, message, timeout)
        if await self._still_gone(peer):
            raise self._mark_gone(peer)
        if peer in self.seen:
            # its connection closed: dead, or restarted while this process did not call it (a clean leave, then a
            # restart: a churn run waited 10 s for the restarted peer's next announcement, having called it gone)
            if not await self.connected(peer) and not await self._redial(peer):
                raise self._mark_gone(peer)
        elif peer in self.addresses and not await self._dial(peer):
            raise self._mark_gone(peer)
        try:
            reply = await self._send(peer, message, timeout)
        except TRANSPORT_ERRORS as e:
            if not await self.connected(peer):
                raise self._mark_gone(peer) from e
            if isinstance(e, TimeoutError) and method_of(message.meta) in LIVENESS_METHODS and self.on_unresponsive:
                self.on_unresponsive(peer)  # connected, yet silent to what any live peer answers in moments
            raise
        self.seen.add(peer)
        return reply

    async def _call_relayed(
        self, peer: PeerID, relays: list[PeerID], message: Message, timeout: float | None
    ) -> Message:
        """Hand the request to a relay, which passes it on over the connection the peer keeps to it. (libp2p's own
        relayed connections are reset after 128 KiB, far less than one request of activations.)"""
        if await self._still_gone(peer):
            raise self._mark_gone(peer)
        wrapped = Message({**message.meta, RELAY_TO: peer.to_base58(), RELAY_TIMEOUT: timeout}, message.tensors)
        for relay in relays:
            try:
                reply = await self.acall(relay, wrapped, timeout, direct=True)
            except RemoteError as e:
                if e.kind == ErrorKind.UNREACHABLE:
                    continue  # this relay lost its connection to the peer
                raise
            except PeerGoneError:
                continue
            self.seen.add(peer)
            return reply
        raise self._mark_gone(peer)

    async def _send(self, peer: PeerID, message: Message, timeout: float | None) -> Message:
        stub = PeerDoors.get_stub(self.p2p, peer)
        payload = payload_bytes(message.tensors)
        self.sent[str(method_of(message.meta))] += payload
        streamed = method_of(message.meta) in STREAMED_REPLIES
        laned = max(payload, expected_reply(message.meta))  # the larger of the request and its expected reply
        if laned > lanes.LANE_BYTES and not streamed:
            self.laned[method_of(message.meta)] += 1
            return await asyncio.wait_for(self._send_lanes(stub, message, laned), timeout=timeout)
        parts = encode(message, self.swarm_key)
        if len(parts) == 1 and not streamed:
            reply = await stub.rpc_call(parts[0], timeout=timeout)
            return raise_if_error(decode([reply]))
        return raise_if_error(await asyncio.wait_for(self._stream(stub, parts), timeout=timeout))

    async def _send_lanes(self, stub, message: Message, size: int) -> Message:
        """A large request (or one that expects a large reply: ``size``, the larger) as one call per chunk of
        ``size``, all at once (see ``swarm.net.lanes``); the reply comes back spread over the same calls."""
        chunk = lanes.chunk_bytes(size)
        parts = encode(message, self.swarm_key, chunk)
        packed = lanes.pack(parts, max(1, len(parts) - 1, -(-size // chunk)), uuid.uuid4().hex)
        replies = await asyncio.gather(*(stub.rpc_lane(lane) for lane in packed))
        return raise_if_error(decode(lanes.unpack(list(replies))))

    async def likely_reachable(self, peer: PeerID) -> bool:
        """Whether a call to ``peer`` may get through: not found gone, and connected here now or reached through a
        relay. (Another peer that could not connect to it may be out of its reach only.)"""
        if peer in self.gone:
            return False
        return bool(self._relays(peer)) or await self.connected(peer)

    async def connected(self, peer: PeerID) -> bool:
        """Whether the P2P daemon holds an open connection to ``peer`` right now."""
        try:
            return any(info.peer_id == peer for info in await self.p2p.list_peers())
        except TRANSPORT_ERRORS:
            return True  # cannot tell: do not declare anyone gone

    async def _dial(self, peer: PeerID) -> bool:
        try:
            await dial(self.p2p, peer, self.addresses[peer])
            return True
        except TRANSPORT_ERRORS as e:
            logger.debug("could not dial %s at %s: %s", peer, self.addresses[peer], e)
            return False

    def _relays(self, peer: PeerID) -> list[PeerID]:
        """The relays a peer announced itself through (none: it is dialed directly); each relay's own address is
        remembered so that it can be dialed."""
        maddrs = self.addresses.get(peer, [])
        if not only_relayed(maddrs):
            return []
        relays = []
        for maddr in maddrs:
            relay_maddr, relay = relay_of(maddr)
            self.addresses.setdefault(relay, [relay_maddr])
            relays.append(relay)
        return relays

    async def _still_gone(self, peer: PeerID) -> bool:
        """Whether calls to ``peer`` fail at once: its connection was found closed, and no dial since (one per
        ``GONE_RECHECK`` seconds at most, none for a mark set ahead in time) reached it again."""
        since = self.gone.get(peer)
        if since is None:
            return False
        now = time.time()
        if now - max(since, self.rechecked.get(peer, 0.0)) < GONE_RECHECK or peer not in self.addresses:
            return True
        self.rechecked[peer] = now
        if not await self._redial(peer):
            return True
        self._revive(peer)
        return False

    async def _redial(self, peer: PeerID) -> bool:
        """Dial ``peer`` once, briefly, at the addresses of its newest record: whether it answers again after its
        connection closed (a peer restarted under the same id, perhaps on another port)."""
        if peer not in self.addresses:
            return False
        try:
            await dial(self.p2p, peer, self.addresses[peer], timeout=RECHECK_DIAL_TIMEOUT)
        except TRANSPORT_ERRORS:
            return False
        logger.info("peer %s answers again (restarted under the same id)", peer)
        return True

    def _revive(self, peer: PeerID) -> None:
        del self.gone[peer]
        self.rechecked.pop(peer, None)
        self.seen.discard(peer)

    def _mark_gone(self, peer: PeerID) -> PeerGoneError:
        self.gone.setdefault(peer, time.time())
        return PeerGoneError(f"peer {peer} is gone: its connection closed (process stopped or machine offline)")

    def is_gone(self, peer: PeerID) -> bool:
        return peer in self.gone

    def hint(self, peer: PeerID, maddrs: list[str]) -> None:
        """Another party (the client, naming a peer it just worked with) reaches ``peer`` at ``maddrs``: dial it there
        from now on; one found gone at other addresses may have restarted on a new port, so it may be called again."""
        if not maddrs or set(self.addresses.get(peer, ())) == set(maddrs):
            return  # the same addresses (in any order): no news of a restart
        self.addresses[peer] = list(maddrs)
        if peer in self.gone:
            self._revive(peer)

    def learn(self, records: Iterable[ServerRecord]) -> None:
        """Take each peer's addresses from its newest record; peers that announced themselves after they were found
        gone (restarted, back online) may be called again."""
        newest: dict[PeerID, ServerRecord] = {}
        for record in records:
            if record.peer_id not in newest or record.announced_at > newest[record.peer_id].announced_at:
                newest[record.peer_id] = record
        for peer, record in newest.items():
            if record.maddrs:
                self.addresses[peer] = record.maddrs
            gone_at = self.gone.get(peer)
            if gone_at is not None and record.announced_at > gone_at:
                self._revive(peer)

    async def _stream(self, stub, parts: list[runtime_pb2.ExpertRequest]) -> Message:
        """Stream a request and decode the reply. A reply stream that closes early (nothing, or a tensor cut short:
        seen rarely under load) is asked for again: every streamed method is idempotent."""
        for attempt in range(1, STREAM_ATTEMPTS + 1):
            replies: AsyncIterator = await stub.rpc_stream(as_aiter(*parts))
            reply = await collect(replies, self.max_payload_bytes)
            try:
                return decode(reply)
            except WireError as e:
                if attempt == STREAM_ATTEMPTS:
                    raise
                logger.warning("a streamed reply was cut short (%s); asking again", e)
        raise AssertionError("unreachable")

    async def shutdown(self) -> None:
        await self.p2p.shutdown()
