"""A request's hop in a chain: its input rebuilt from a delta, its output delta-coded for the next hop or the client
(swarm/net/deltas.py), the request handed on to the route's next hop, and what goes back to the client: the tensor
of the chain's end (or of this hop, where the chain broke) and each hop's ack. The service's forward, backward and
generation handlers run their span, then hand the result here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from peers.peer_client import ChainBroken, PeerClient
from swarm.net import rotated
from swarm.net.chain import ChainFailure, HopAck
from swarm.net.compression import DELTAS
from swarm.net.deltas import CLIENT, Delta, DeltaReferences, ReferenceKey
from swarm.net.errors import ErrorKind, RequestError
from swarm.net.gradnorm import GradNorm
from swarm.net.protocol import BackwardRequest, ForwardRequest, GradReply, InferRequest


class Hops:
    """This peer's hops of chains, made with its id (known once its service is registered), the client it calls the
    next hop with, and the samples' last hidden states it received and passed on (``references``)."""

    def __init__(self, me: Callable[[], str], peers: PeerClient, references: DeltaReferences) -> None:
        self.whoami, self.peers, self.references = me, peers, references

    def received(self, request: ForwardRequest) -> torch.Tensor:
        """A forward's input as sent, or rebuilt from its delta (refused where this peer lacks the reference)."""
        if not isinstance(request.hidden, Delta):
            return request.hidden
        if request.sample is None or request.compression not in DELTAS:
            raise RequestError("hidden states sent as a delta need a sample and a delta compression (hadamard4d3)")
        key = ReferenceKey(adapter=request.adapter, sample=request.sample, boundary=request.start, sent=False)
        return self.references.decode(key, request.hidden).to(rotated.DTYPES[request.hidden.dtype])

    def delta_onward(self, request: ForwardRequest, outputs: torch.Tensor, value_only: bool = False) -> Delta:
        """This span's output for the next hop, as a change from the last one this peer passed that peer for the
        sample (it refuses it if it no longer holds that one; then ``value_only``)."""
        key = _sent_key(request, request.route[0].peer)
        if value_only:
            self.references.forget(key)
        return self.references.encode(key, outputs, DELTAS[request.compression][1])[0]

    def delta_back(self, request: ForwardRequest, outputs: torch.Tensor) -> Delta:
        """The chain's output for the client: a change from the reference it holds (``have``) where this peer holds
        the same one, else the value itself."""
        key = _sent_key(request, CLIENT)
        if request.have is None or self.references.digest_of(key) != request.have:
            self.references.forget(key)
        return self.references.encode(key, outputs, DELTAS[request.compression][1])[0]

    async def chain_on(
        self,
        request: ForwardRequest | BackwardRequest | InferRequest,
        arrived: float,
        spent: float,
        result,
        norms: tuple[GradNorm, ...],
        hashes: tuple[tuple[int, str], ...],
        resend: Callable[[], dict] | None = None,
        **onward,
    ) -> tuple[torch.Tensor | Delta | None, list[HopAck], ChainFailure | None]:
        """In a chain, hand the request on to the route's next hop with this hop's ``result`` (``onward``: the fields
        that change; ``resend``: what to send instead if the next hop lacks the reference of a delta; ``spent``: this
        hop's compute time). Returns what goes back: the tensor of the chain's end (or this hop's, where the chain
        broke), the hops that ran (with ``norms`` and ``hashes``, this hop's gradient norms and the hashes of the
        micro-batch's gradients after a backward), and where it broke."""
        if not request.route:
            return result, [self.ack(request.blocks, arrived, spent, norms, hashes)], None
        hop, rest = request.route[0], request.route[1:]
        onward_request = replace(request, start=hop.start, end=hop.end, route=rest, **onward)
        try:
            try:
                reply = await self.peers.pass_on(hop, onward_request)
            except ChainBroken as e:
                if resend is None or e.failure.kind != ErrorKind.MISSING_REFERENCE:
                    raise
                reply = await self.peers.pass_on(hop, replace(onward_request, **resend()))
        except ChainBroken as e:  # the client goes on from this hop's result
            return result, [self.ack(request.blocks, arrived, spent, norms, hashes)], e.failure
        carried = reply.grad_inputs if isinstance(reply, GradReply) else reply.outputs
        return carried, [self.ack(request.blocks, arrived, spent, norms, hashes), *reply.acks], reply.failure

    def ack(
        self,
        blocks: range,
        arrived: float,
        spent: float,
        norms: tuple[GradNorm, ...],
        hashes: tuple[tuple[int, str], ...],
    ) -> HopAck:
        """This hop ran ``blocks``, in the seconds since the request arrived (the chain after it included), of them
        ``spent`` computing."""
        return HopAck(self.whoami(), blocks.start, blocks.stop, time.monotonic() - arrived, norms, hashes, spent)


def _sent_key(request: ForwardRequest, to: str) -> ReferenceKey:
    """The key of a delta-coded forward's output (it has a sample) as this peer sends it on to ``to``."""
    return ReferenceKey(adapter=request.adapter, sample=request.sample, boundary=request.end, sent=True, peer=to)
