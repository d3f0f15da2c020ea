"""Lanes: a large message sent as several unary calls in parallel, one chunk each, and its reply spread back over
the same calls. libp2p opens every call on a new stream whose flow-control window (yamux: 256 KiB) the sender
fills in one round trip; a 1 MB request on one stream waits four round trips, on four lanes one."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from swarm.net.errors import DECODE_ERRORS, WireError

LANE_BYTES = 192 * 1024  # a chunk per lane, under the stream window with room for framing
MAX_LANES = 64
LANE_WAIT = 60.0  # how long a peer waits, from a message's first lane, for the others before it gives up on it


def chunk_bytes(payload: int) -> int:
    """Chunk size for a payload: one lane per LANE_BYTES, at most MAX_LANES lanes."""
    return max(LANE_BYTES, -(-payload // MAX_LANES))


def pack(parts: list[runtime_pb2.ExpertRequest], lanes: int, message_id: str = "") -> list[runtime_pb2.ExpertRequest]:
    """Spread a message's parts (header first, see ``swarm.net.wire.encode``) over ``lanes`` lane protobufs, in order:
    lane i carries the header (lane 0) and its share of the chunks."""
    if lanes < 1:
        raise ValueError("need at least one lane")
    header, chunks = parts[:1], parts[1:]
    shares = [header if i == 0 else [] for i in range(lanes)]
    for index, chunk in enumerate(chunks):
        shares[index * lanes // max(len(chunks), 1)].append(chunk)
    return [
        runtime_pb2.ExpertRequest(
            uid=message_id,
            metadata=MSGPackSerializer.dumps(
                {"lane": i, "lanes": lanes, "parts": [part.SerializeToString() for part in share]}
            ),
        )
        for i, share in enumerate(shares)
    ]


def lane_of(lane: runtime_pb2.ExpertRequest) -> tuple[int, int, list[runtime_pb2.ExpertRequest]]:
    """(index, count, parts) of one lane; WireError if it is not a lane."""
    try:
        head = MSGPackSerializer.loads(lane.metadata)
        index, count, raw = head["lane"], head["lanes"], head["parts"]
        if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count <= MAX_LANES):
            raise ValueError(f"lane {index!r} of {count!r}")
        return index, count, [runtime_pb2.ExpertRequest.FromString(part) for part in raw]
    except DECODE_ERRORS as e:
        raise WireError(f"not a valid lane: {type(e).__name__}: {e}") from None


def unpack(lanes: list[runtime_pb2.ExpertRequest]) -> list[runtime_pb2.ExpertRequest]:
    """The parts of a message from all of its lanes (any order). A lane that says it is the only one carries a
    whole message by itself (a reply of one part, e.g. a refusal, is answered whole on every lane)."""
    by_index: dict[int, list[runtime_pb2.ExpertRequest]] = {}
    for lane in lanes:
        index, count, parts = lane_of(lane)
        if count == 1:
            return parts
        if count != len(lanes) or index in by_index:
            raise WireError("lanes of a message disagree on their number or repeat")
        by_index[index] = parts
    return [part for index in sorted(by_index) for part in by_index[index]]


@dataclass
class Arrivals:
    """The lanes of one incoming message received so far, and (once all are in) the reply's parts."""

    count: int
    started: float = field(default_factory=time.monotonic)
    parts: dict[int, list[runtime_pb2.ExpertRequest]] = field(default_factory=dict)
    size: int = 0
    reply: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    answered: int = 0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.count

    def arrived(self, index: int, parts: list[runtime_pb2.ExpertRequest]) -> None:
        self.parts[index] = parts
        if self.complete:
            self.all_in.set()

    async def replied(self, lane_wait: float) -> list[runtime_pb2.ExpertRequest]:
        """The reply's parts. Only the wait for the other lanes is bounded here (TimeoutError after ``lane_wait``
        from the first lane): once all are in, the message's own handling takes what it takes (a backward chained
        through busy peers may take minutes; its caller's timeout bounds it)."""
        gathered = asyncio.ensure_future(self.all_in.wait())
        try:
            remaining = max(0.0, self.started + lane_wait - time.monotonic())
            done, _ = await asyncio.wait({gathered, self.reply}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gathered.cancel()
        if not done:
            raise asyncio.TimeoutError
        return await asyncio.shield(self.reply)

    def ordered(self) -> list[runtime_pb2.ExpertRequest]:
        return [part for index in sorted(self.parts) for part in self.parts[index]]
