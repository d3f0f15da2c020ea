"""Calling a peer from synchronous code: pick unary or stream, encode, send, decode, raise refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import as_aiter

from peers.service import PeerService
from swarm.wire import DEFAULT_MAX_PAYLOAD_BYTES, Message, collect, decode, encode, raise_if_error

# Methods whose replies can be large even when the request is small.
STREAMED_REPLIES = frozenset({"state"})


class Transport:
    """The client's (or a peer's) way to call other peers' ``PeerService`` over hivemind P2P."""

    def __init__(self, dht: DHT, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES):
        self.p2p: P2P = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())
        self.max_payload_bytes = max_payload_bytes

    def call(self, peer: PeerID, message: Message, timeout: float | None = None) -> Message:
        """Send ``message`` and wait for the reply; a refusal becomes a RemoteError."""
        return RemoteExpertWorker.run_coroutine(self.acall(peer, message, timeout))

    async def acall(self, peer: PeerID, message: Message, timeout: float | None = None) -> Message:
        stub = PeerService.get_stub(self.p2p, peer)
        parts = encode(message)
        if len(parts) == 1 and message.meta.get("method") not in STREAMED_REPLIES:
            reply = await stub.rpc_call(parts[0], timeout=timeout)
            return raise_if_error(decode([reply]))
        return raise_if_error(decode(await self._stream(stub, parts, timeout)))

    async def _stream(self, stub, parts: list[runtime_pb2.ExpertRequest], timeout: float | None) -> list:
        async def exchange() -> list:
            replies: AsyncIterator = await stub.rpc_stream(as_aiter(*parts))
            return await collect(replies, self.max_payload_bytes)

        return await asyncio.wait_for(exchange(), timeout=timeout)
