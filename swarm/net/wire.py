"""Messages between client and peers: msgpack metadata plus hivemind-serialized tensors, unary or streamed."""

from __future__ import annotations

import hmac
from typing import AsyncIterator  # noqa: UP035 -- hivemind's servicer reads typing's alias to spot streams

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.net.compression import deserialize, serialize
from swarm.net.errors import DECODE_ERRORS, WireError
from swarm.net.message import Message, payload_bytes
from swarm.net.protocol import AUTH
from swarm.net.security import SwarmKey

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30


def is_unary(message: Message) -> bool:
    return payload_bytes(message.tensors) <= MAX_UNARY_PAYLOAD_SIZE


def encode(
    message: Message, key: SwarmKey | None = None, chunk_bytes: int | None = None
) -> list[runtime_pb2.ExpertRequest]:
    """One protobuf for small messages; for large ones (or with ``chunk_bytes``), a header and the tensors in
    chunks of at most ``chunk_bytes`` (default: half the P2P message limit), meta on the header.

    With a swarm key, the metadata carries ``AUTH``: an HMAC over the metadata and every tensor buffer.
    """
    serialized = [serialize(t, message.compression) for t in message.tensors]
    if chunk_bytes is None and is_unary(message):
        parts = [runtime_pb2.ExpertRequest(tensors=serialized)]
    else:
        parts = [runtime_pb2.ExpertRequest(uid=str(len(serialized)))]
        for index, tensor in enumerate(serialized):
            for chunk in split_for_streaming(tensor, chunk_bytes or DEFAULT_MAX_MSG_SIZE // 2):
                parts.append(runtime_pb2.ExpertRequest(uid=str(index), tensors=[chunk]))
    meta = dict(message.meta)
    if key is not None:
        meta[AUTH] = _mac(key, meta, parts)
    parts[0].metadata = MSGPackSerializer.dumps(meta)
    return parts


def _mac(key: SwarmKey, meta: dict, parts: list[runtime_pb2.ExpertRequest]) -> bytes:
    unsigned = {k: v for k, v in meta.items() if k != AUTH}
    buffers = [t.buffer for part in parts for t in part.tensors]
    return key.mac(MSGPackSerializer.dumps(unsigned), *buffers)


def verify(key: SwarmKey, message: Message, parts: list[runtime_pb2.ExpertRequest]) -> None:
    """Raise unless the message was made by a holder of ``key``."""
    auth = message.meta.get(AUTH)
    if not isinstance(auth, bytes) or not hmac.compare_digest(auth, _mac(key, message.meta, parts)):
        raise WireError("unauthorized: this peer belongs to a private swarm; pass its swarm key (--swarm-key)")


def decode(parts: list[runtime_pb2.ExpertRequest]) -> Message:
    """Inverse of :func:`encode`; raises WireError on anything malformed."""
    if not parts:
        raise WireError("empty message")
    try:
        meta = MSGPackSerializer.loads(parts[0].metadata) if parts[0].metadata else {}
    except DECODE_ERRORS as e:
        raise WireError(f"metadata is not valid msgpack: {e}") from None
    if not isinstance(meta, dict):
        raise WireError("metadata must be a msgpack map")
    try:
        if len(parts) == 1:
            tensors = [deserialize(t) for t in parts[0].tensors]
        else:
            tensors = _combine_chunks(parts)
    except WireError:
        raise
    except DECODE_ERRORS as e:
        raise WireError(f"tensors could not be decoded: {type(e).__name__}: {e}") from None
    return Message(meta=meta, tensors=tensors)


def _combine_chunks(parts: list) -> list[torch.Tensor]:
    try:
        count = int(parts[0].uid)
    except ValueError:
        raise WireError("first streamed part must give the tensor count") from None
    chunks: list[list] = [[] for _ in range(count)]
    for part in parts[1:]:
        if not part.uid.isdigit() or int(part.uid) >= count or len(part.tensors) != 1:
            raise WireError("streamed part has a bad tensor index")
        chunks[int(part.uid)].append(part.tensors[0])
    if any(not c for c in chunks):
        raise WireError("streamed message is missing a tensor")
    return [deserialize(combine_from_streaming(c)) for c in chunks]


async def collect(stream: AsyncIterator, max_bytes: int) -> list:
    """Read a streamed message, refusing it once it grows past ``max_bytes``.

    Past the limit the rest is read and dropped (up to 4x the limit) so the sender gets the refusal, not a reset.
    """
    parts, size = [], 0
    async for part in stream:
        size += part.ByteSize()
        if size > 4 * max_bytes:
            break
        if size <= max_bytes:
            parts.append(part)
    if size > max_bytes:
        raise WireError(f"message exceeds the {max_bytes}-byte limit; send smaller micro-batches")
    return parts


class PeerDoors(ServicerBase):
    """The two RPC doors every peer opens (implemented by ``peers.service.PeerService``); callers build stubs here.

    ``rpc_call`` carries a whole message in one protobuf; ``rpc_stream`` carries large messages in chunks;
    ``rpc_lane`` carries one chunk of a large message sent over parallel calls (``swarm.net.lanes``).
    """

    async def rpc_call(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertRequest:
        raise NotImplementedError

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        raise NotImplementedError

    async def rpc_lane(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertRequest:
        raise NotImplementedError
