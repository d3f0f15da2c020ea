"""The client's end of a delta-coded chain (swarm/client/chaindeltas.py): what it takes from a chain's answer. A change
from a reference the request did not name is the peer's lie (banned); one from the reference it named but no longer
holds (a micro-batch of the same tokens in flight moved it on) asks again; a value is rebuilt and kept as the
reference of the peer that sent it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerFailure
from swarm.client.chaindeltas import ChainDeltas
from swarm.client.routing import Hop
from swarm.net.compression import WireFormat
from swarm.net.deltas import CLIENT, DeltaBits, DeltaReferences, ReferenceKey
from swarm.net.errors import MissingReferenceError
from swarm.net.protocol import ForwardRequest
from swarm.testing.activations import residual_stream

LAST = PeerID(b"peer-last")
BITS = DeltaBits(4, 3)
TO_CLIENT = ReferenceKey(adapter="a", sample="s", boundary=4, sent=True, peer=CLIENT)  # the last peer's


class Calls:
    def __init__(self):
        self.banned: list[PeerID] = []
        self.router = SimpleNamespace(num_blocks=4)
        self.adapter, self.wire = "a", WireFormat.parse("bfloat16+hadamard4d3")

    def peer_failed(self, peer: PeerID, reason: str) -> PeerFailure:
        self.banned.append(peer)
        return PeerFailure(peer, reason)


def _request(have: bytes | None, sample: str | None = "s") -> ForwardRequest:
    hidden = torch.zeros(1, 2, 8)
    return ForwardRequest(
        adapter="a",
        start=0,
        end=2,
        step=0,
        hidden=hidden,
        micro_batch="mb",
        compression="hadamard4d3",
        sample=sample,
        have=have,
    )


def test_a_chains_answer_as_a_value_a_change_from_the_named_reference_or_a_lie():
    calls = Calls()
    stack = ChainDeltas(calls, DeltaReferences())
    peer_side = DeltaReferences()
    first, second = residual_stream(shape=(1, 8, 256)), residual_stream(seed=2, shape=(1, 8, 256))
    last = Hop(LAST, 2, 4)

    value, sent = peer_side.encode(TO_CLIENT, first, BITS)
    got = stack.incoming(_request(have=None), last, value)
    assert torch.equal(got, sent) and got.dtype == torch.float32
    have = stack.references.digest_of(stack.key("s", 4, LAST))
    assert have is not None

    change, sent = peer_side.encode(TO_CLIENT, second, BITS)
    assert change.base == have
    assert torch.equal(stack.incoming(_request(have=have), last, change), sent)
    assert calls.banned == []

    lie, _ = peer_side.encode(TO_CLIENT, first, BITS)  # a change, from a reference the request does not name
    with pytest.raises(PeerFailure, match="did not name"):
        stack.incoming(_request(have=None), last, lie)
    with pytest.raises(PeerFailure, match="did not name"):
        stack.incoming(_request(have=lie.base, sample=None), last, lie)
    assert calls.banned == [LAST, LAST]

    stack.references.forget(stack.key("s", 4, LAST))  # the named reference moved on meanwhile
    with pytest.raises(MissingReferenceError):
        stack.incoming(_request(have=lie.base), last, lie)
    assert calls.banned == [LAST, LAST], "an honest race is asked again, not banned"
    assert torch.equal(stack.incoming(_request(have=None), last, torch.ones(2)), torch.ones(2)), "plain tensors pass"
