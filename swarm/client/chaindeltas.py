"""The client's end of delta-coded chains (swarm/net/deltas.py): a training micro-batch's hidden states go to the
chain's first peer, and come back from its last, as changes since the same sample's last pass, against a reference
kept per sample, boundary and peer. The hops (swarm/client/remote.py) ask it what to send and what they got."""

from __future__ import annotations

import hashlib

import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerCalls
from swarm.client.routing import Hop
from swarm.net import rotated
from swarm.net.deltas import Delta, DeltaReferences, ReferenceKey
from swarm.net.protocol import ForwardRequest


class ChainDeltas:
    """The references of the samples this client sent and received (``references``; None where the wire sends
    no changes), and the checks on what comes back."""

    def __init__(self, calls: PeerCalls, references: DeltaReferences | None):
        self.calls, self.adapter, self.references = calls, calls.adapter, references

    def sample_of(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> str | None:
        """A training micro-batch's identity for delta-coded hops: a hash of the stack's input (the frozen
        embeddings of its tokens) and mask, so that the same tokens in a later epoch find their references. None:
        no changes on this wire. Evaluations send values: a held-out batch comes back rarely, after many steps,
        when its change is no smaller than itself."""
        if self.references is None:
            return None
        digest = hashlib.blake2b(digest_size=16)
        for tensor in (hidden, mask):
            if tensor is not None:
                digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
                digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def key(self, sample: str, boundary: int, peer: PeerID, sent: bool = False) -> ReferenceKey:
        """Where a sample's reference is kept: by the peer it was sent to (``sent``) or came from, so that each
        replica has its own."""
        return ReferenceKey(adapter=self.adapter, sample=sample, boundary=boundary, sent=sent, peer=peer.to_base58())

    def have(self, sample: str | None, last: Hop) -> bytes | None:
        """The digest of the reference the client holds of what ``last`` answers (named in the request)."""
        if sample is None:
            return None
        return self.references.digest_of(self.key(sample, last.end, last.peer_id))

    def outgoing(self, sample: str | None, boundary: int, hidden: torch.Tensor, to: PeerID) -> torch.Tensor | Delta:
        """What goes to ``to`` for ``hidden``: the value, or its change since the sample's last pass there."""
        if sample is None:
            return hidden
        return self.references.encode(self.key(sample, boundary, to, sent=True), hidden, self.calls.wire.delta_bits)[0]

    def forget(self, sample: str, boundary: int, peer: PeerID, sent: bool = False) -> None:
        """Drop a reference, so that the value goes (``sent``) or is asked for next time."""
        self.references.forget(self.key(sample, boundary, peer, sent))

    def incoming(self, request: ForwardRequest, last: Hop, outputs: torch.Tensor | Delta) -> torch.Tensor:
        """A chain's answer as a tensor: a delta rebuilt from the reference the client holds. A change from a
        reference the request did not name is a lie; one from the reference it named, which the client no longer
        holds, raises MissingReferenceError (the client asks again, for the value)."""
        if not isinstance(outputs, Delta):
            return outputs
        if request.sample is None or (outputs.base is not None and outputs.base != request.have):
            reason = "forward: a delta from a reference the request did not name"
            raise self.calls.peer_failed(last.peer_id, reason)
        value = self.references.decode(self.key(request.sample, last.end, last.peer_id), outputs)
        return value.to(rotated.DTYPES[outputs.dtype])
