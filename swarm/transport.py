"""Calling a peer: pick unary or stream, encode, send, decode, and turn refusals into RemoteError."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import as_aiter

from swarm.errors import RemoteError
from swarm.protocol import STREAMED_REPLIES
from swarm.security import SwarmKey
from swarm.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Message,
    PeerDoors,
    WireError,
    collect,
    decode,
    encode,
    raise_if_error,
)

STREAM_ATTEMPTS = 3

logger = logging.getLogger(__name__)


class PeerGoneError(ConnectionError):
    """The peer's connection closed (its process died, or its machine left the network): not merely slow."""


class Transport:
    """A way to call other peers' doors over hivemind P2P: async inside peers, sync for the client.

    It tells a peer that is gone from one that is only slow or frozen. A process that dies takes its TCP
    connections with it within milliseconds, while a frozen one keeps them open; so a peer this transport has
    been connected to and is not any more, or a failed call to a peer that leaves no connection behind, marks the
    peer gone. Calls to a gone peer fail at once (libp2p would spend ~20 s on a dial and a peer-routing search)
    until the peer announces itself again (``revive``).
    """

    def __init__(self, p2p: P2P, swarm_key: SwarmKey | None = None, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES):
        self.p2p, self.swarm_key, self.max_payload_bytes = p2p, swarm_key, max_payload_bytes
        self.seen: set[PeerID] = set()  # peers this transport has had an answer from
        self.gone: dict[PeerID, float] = {}  # peer -> wall-clock time its connection was found closed

    @classmethod
    def for_dht(cls, dht: DHT, swarm_key: SwarmKey | None = None) -> Transport:
        """A transport sharing the P2P daemon of a DHT, driven from synchronous code."""
        return cls(RemoteExpertWorker.run_coroutine(dht.replicate_p2p()), swarm_key)

    def call(self, peer: PeerID, message: Message, timeout: float | None = None) -> Message:
        """Send ``message`` and wait for the reply; a refusal becomes a RemoteError."""
        return RemoteExpertWorker.run_coroutine(self.acall(peer, message, timeout))

    async def acall(self, peer: PeerID, message: Message, timeout: float | None = None) -> Message:
        if peer in self.gone or (peer in self.seen and not await self.connected(peer)):
            raise self._mark_gone(peer)
        try:
            reply = await self._send(peer, message, timeout)
        except (RemoteError, asyncio.CancelledError):
            raise
        except Exception as e:
            if not await self.connected(peer):
                raise self._mark_gone(peer) from e
            raise
        self.seen.add(peer)
        return reply

    async def _send(self, peer: PeerID, message: Message, timeout: float | None) -> Message:
        stub = PeerDoors.get_stub(self.p2p, peer)
        parts = encode(message, self.swarm_key)
        if len(parts) == 1 and message.meta.get("method") not in STREAMED_REPLIES:
            reply = await stub.rpc_call(parts[0], timeout=timeout)
            return raise_if_error(decode([reply]))
        return raise_if_error(await asyncio.wait_for(self._stream(stub, parts), timeout=timeout))

    async def connected(self, peer: PeerID) -> bool:
        """Whether the P2P daemon holds an open connection to ``peer`` right now."""
        try:
            return any(info.peer_id == peer for info in await self.p2p.list_peers())
        except Exception:
            return True  # cannot tell: do not declare anyone gone

    def _mark_gone(self, peer: PeerID) -> PeerGoneError:
        self.gone.setdefault(peer, time.time())
        return PeerGoneError(f"peer {peer} is gone: its connection closed (process stopped or machine offline)")

    def is_gone(self, peer: PeerID) -> bool:
        return peer in self.gone

    def revive(self, announced_at: dict[PeerID, float]) -> None:
        """Peers that announced themselves after they were found gone (restarted, back online) may be called again."""
        for peer, when in announced_at.items():
            gone_at = self.gone.get(peer)
            if gone_at is not None and when > gone_at:
                del self.gone[peer]
                self.seen.discard(peer)

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
