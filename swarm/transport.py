"""Calling a peer: pick unary or stream, encode, send, decode, and turn refusals into RemoteError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import as_aiter

from swarm.security import SwarmKey
from swarm.wire import DEFAULT_MAX_PAYLOAD_BYTES, Message, PeerDoors, collect, decode, encode, raise_if_error

# Methods whose replies can be large even when the request is small.
STREAMED_REPLIES = frozenset({"state", "grads", "export"})
STREAM_ATTEMPTS = 3


class Transport:
    """A way to call other peers' doors over hivemind P2P: async inside peers, sync for the client."""

    def __init__(self, p2p: P2P, swarm_key: SwarmKey | None = None, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES):
        self.p2p, self.swarm_key, self.max_payload_bytes = p2p, swarm_key, max_payload_bytes

    @classmethod
    def for_dht(cls, dht: DHT, swarm_key: SwarmKey | None = None) -> Transport:
        """A transport sharing the P2P daemon of a DHT, driven from synchronous code."""
        return cls(RemoteExpertWorker.run_coroutine(dht.replicate_p2p()), swarm_key)

    def call(self, peer: PeerID, message: Message, timeout: float | None = None) -> Message:
        """Send ``message`` and wait for the reply; a refusal becomes a RemoteError."""
        return RemoteExpertWorker.run_coroutine(self.acall(peer, message, timeout))

    async def acall(self, peer: PeerID, message: Message, timeout: float | None = None) -> Message:
        stub = PeerDoors.get_stub(self.p2p, peer)
        parts = encode(message, self.swarm_key)
        if len(parts) == 1 and message.meta.get("method") not in STREAMED_REPLIES:
            reply = await stub.rpc_call(parts[0], timeout=timeout)
            return raise_if_error(decode([reply]))
        return raise_if_error(decode(await asyncio.wait_for(self._stream(stub, parts), timeout=timeout)))

    async def _stream(self, stub, parts: list[runtime_pb2.ExpertRequest]) -> list:
        """Stream a request and collect the reply. A stream that closes with no reply at all (seen rarely under
        load) is retried: every streamed method is idempotent."""
        for _ in range(STREAM_ATTEMPTS):
            replies: AsyncIterator = await stub.rpc_stream(as_aiter(*parts))
            reply = await collect(replies, self.max_payload_bytes)
            if reply:
                return reply
        return []

    async def shutdown(self) -> None:
        await self.p2p.shutdown()
