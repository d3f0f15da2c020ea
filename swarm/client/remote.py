"""The remote decoder stack as one autograd op: forward through a chain of peers, backward in reverse,
re-routing around peers that fail, from what the client keeps."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from swarm.client.ledger import Segment, StepLedger
from swarm.client.routing import Hop, Router
from swarm.net.compression import WireFormat
from swarm.net.errors import LeaseLostError, RemoteError, SwarmUnavailableError
from swarm.net.message import Message
from swarm.net.protocol import (
    PEER_STATE_ERRORS,
    BackwardRequest,
    ErrorKind,
    ForwardRequest,
    Method,
    Reply,
    ReplyError,
    Request,
    method_of,
    read_reply,
)
from swarm.net.transport import Transport
from swarm.net.wire import WireError

logger = logging.getLogger(__name__)

# Failures of the peer or of the way to it (a dead or frozen peer, a broken stream, a garbled reply). Anything else
# raised while calling is a bug on this side, and surfaces instead of getting healthy peers banned.
TRANSPORT_ERRORS = (
    OSError,  # ConnectionError (PeerGoneError), TimeoutError
    asyncio.TimeoutError,
    asyncio.IncompleteReadError,
    EOFError,
    P2PDaemonError,
    P2PHandlerError,
    WireError,
)


class PeerFailure(Exception):
    """A peer failed or refused for its own reasons; the peer is banned and the work goes elsewhere."""

    def __init__(self, peer: PeerID, reason: str):
        super().__init__(f"{peer}: {reason}")
        self.peer = peer


@dataclass
class HopInput:
    """A hop of a forward pass and its input, kept for the backward."""

    hop: Hop
    hidden: torch.Tensor


@dataclass
class Recovery:
    """A failure the client routed around: who, during what, and how long the retry took."""

    peer: PeerID
    during: str
    step: int
    seconds: float


class RemoteStack:
    """Runs blocks of one adapter through the swarm with retries, and records who holds which gradients."""

    def __init__(
        self,
        transport: Transport,
        router: Router,
        adapter: str,
        patience: float,
        spot_check: float = 0.0,
        spot_check_tolerance: float = 1e-3,
        wire: WireFormat | None = None,
    ):
        self.transport, self.router, self.adapter, self.patience = transport, router, adapter, patience
        self.wire = wire or WireFormat()
        self.spot_check, self.spot_check_tolerance = spot_check, spot_check_tolerance
        self.on_peer_state: list = []  # callbacks(peer) run when a peer turns out stale or fresh
        self.recoveries: list[Recovery] = []
        self.dishonest: list[PeerID] = []
        self.random = random.Random()

    # --- calls ----------------------------------------------------------------------------------------------

    def ask(self, peer: PeerID, request: Request, units: float = 1.0, floor: float = 0.0) -> Reply:
        """One typed request, its typed reply; failures of the peer (a reply that breaks its schema too) become
        PeerFailure after a ban, refusals of the request raise."""
        message = request.to_message()
        tensors, compression = message.tensors, message.compression
        reply = self.call(peer, message.meta, tensors, units=units, floor=floor, compression=compression)
        try:
            return read_reply(request, reply)
        except ReplyError as e:
            raise self._peer_failed(peer, str(e)) from e

    def call(
        self,
        peer: PeerID,
        meta: dict,
        tensors: list[torch.Tensor],
        units: float = 1.0,
        floor: float = 0.0,
        compression: int = runtime_pb2.CompressionType.NONE,
    ) -> Message:
        """One encoded request (what :meth:`ask` sends; tests and the chaos driver watch requests here); failures of
        the peer become PeerFailure (after a ban), refusals of the request raise."""
        method = str(method_of(meta))
        started = time.monotonic()
        timeout = floor + self.router.timeout(peer, method, units)
        try:
            reply = self.transport.call(peer, Message(meta, tensors, compression), timeout)
        except RemoteError as e:
            if e.kind == ErrorKind.FENCED:
                raise LeaseLostError(str(e)) from None
            if e.kind not in PEER_STATE_ERRORS:
                raise
            raise self._peer_failed(peer, str(e)) from e
        except TRANSPORT_ERRORS as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise self._peer_failed(peer, f"{method}: {reason}") from e
        self.router.succeeded(peer, method, units, time.monotonic() - started)
        return reply

    def _peer_failed(self, peer: PeerID, reason: str) -> PeerFailure:
        """Ban the peer for a while and tell those who track peers' state; the work goes elsewhere."""
        self.router.ban(peer, reason)
        for callback in self.on_peer_state:
            callback(peer)
        return PeerFailure(peer, reason)

    def _span_ask(self, hop: Hop, request: ForwardRequest | BackwardRequest, tokens: torch.Tensor) -> Reply:
        """A forward or backward request; ``tokens`` (batch x length) sizes its timeout."""
        units = tokens.shape[0] * tokens.shape[1] * (hop.end - hop.start)
        return self.ask(hop.peer_id, request, units)

    def _forward_hop(
        self, hop: Hop, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> torch.Tensor:
        wire = self.wire
        request = ForwardRequest(
            self.adapter, hop.start, hop.end, step, wire.cast(hidden), mask, micro_batch, wire.compression
        )
        return self._span_ask(hop, request, hidden).outputs.to(hidden.dtype)

    def _backward_hop(
        self,
        hop: Hop,
        hidden: torch.Tensor,
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        cached: bool = False,
        input_grad: bool = True,
    ) -> torch.Tensor | None:
        """Backward through one hop. ``cached``: this peer ran the micro-batch's forward, so the hidden states are
        left out (sent after all if it no longer holds them). ``input_grad``: whether the input gradient is needed."""
        wire = self.wire
        request = BackwardRequest(
            self.adapter,
            hop.start,
            hop.end,
            ledger.step,
            micro_batch,
            wire.cast(grad),
            None if cached else wire.cast(hidden),
            mask,
            input_grad,
            wire.compression,
        )
        try:
            reply = self._span_ask(hop, request, grad)
        except RemoteError as e:
            if not cached or e.kind != ErrorKind.MISSING_FORWARD:
                raise
            return self._backward_hop(hop, hidden, grad, mask, ledger, micro_batch, False, input_grad)
        if input_grad and reply.grad_inputs is None:
            raise self._peer_failed(hop.peer_id, "backward: the reply lacks the input gradient asked for")
        ledger.acknowledge(micro_batch, hop.blocks, hop.peer_id)
        return reply.grad_inputs.to(grad.dtype) if input_grad else None

    def recovered(self, failed: PeerID | None, during: str, step: int, since: float | None) -> None:
        if failed is None or since is None:
            return
        seconds = time.monotonic() - since
        self.recoveries.append(Recovery(failed, during, step, seconds))
        logger.warning(
            "recovered from the failure of peer %s during %s (step %d) in %.2fs", failed, during, step, seconds
        )

    # --- spot checks ------------------------------------------------------------------------------------------

    def _agree(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        scale = max(a.abs().max().item(), b.abs().max().item(), 1e-6)
        return a.shape == b.shape and (a - b).abs().max().item() <= self.spot_check_tolerance * scale

    def _spot_check(
        self, hop: Hop, result: torch.Tensor, redo: Callable[[PeerID], torch.Tensor]
    ) -> tuple[torch.Tensor, PeerID]:
        """With probability ``spot_check``, redo the hop on other replicas; a peer outvoted by two that agree
        is banned for good. Returns the result to use and the peer that produced it."""
        if self.spot_check <= 0 or self.random.random() >= self.spot_check:
            return result, hop.peer_id
        opinions: dict[PeerID, torch.Tensor] = {hop.peer_id: result}
        others = [
            r.peer_id
            for r in self.router.replicas(hop.start)
            if r.peer_id != hop.peer_id and r.start <= hop.start and hop.end <= r.end
        ]
        # In random order: checking stops once the replicas asked agree, so a fixed order (the records') would
        # never ask a dishonest peer listed last, unless it computed the hop itself.
        self.random.shuffle(others)
        majority: list[PeerID] = []
        for peer in others:
            try:
                opinions[peer] = redo(peer)
            except PeerFailure:
                continue
            for value in opinions.values():
                agreeing = [p for p, v in opinions.items() if self._agree(value, v)]
                if len(agreeing) >= 2 and len(agreeing) > len(majority):
                    majority = agreeing
            if len(majority) >= 2 and len(majority) == len(opinions):
                break  # everyone asked so far agrees
            if len(majority) >= 2 and len(opinions) >= 3:
                break
        if len(majority) < 2:
            if len(opinions) > 1:
                logger.warning("replicas of blocks %d:%d disagree and no majority exists", hop.start, hop.end)
            return result, hop.peer_id
        for peer in opinions:
            if peer not in majority:
                self.router.distrust(peer, f"its blocks {hop.start}:{hop.end} results disagree with its replicas'")
                self.dishonest.append(peer)
                for callback in self.on_peer_state:
                    callback(peer)
        chosen = hop.peer_id if hop.peer_id in majority else majority[0]
        return opinions[chosen], chosen

    # --- forward and backward -------------------------------------------------------------------------------

    def give_up_after_patience(self, since: float, hop: Hop, error: PeerFailure) -> None:
        """A hop that keeps failing on every server it is tried on (e.g. each one answers with an internal error)
        is given up after ``patience`` seconds, rather than retried forever."""
        if time.monotonic() - since > self.patience:
            raise SwarmUnavailableError(
                f"blocks {hop.start}:{hop.end} have failed on every server tried for {self.patience:.0f}s; the last "
                f"error: {error}. See that peer's log, or raise the client's patience"
            ) from error

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> tuple[torch.Tensor, list[HopInput]]:
        """Through blocks [0, n); a hop that fails is redone on another replica from the same input."""
        inputs: list[HopInput] = []
        block, failed, since = 0, None, None
        while block < self.router.num_blocks:
            hop = self.router.wait_route(block, patience=self.patience)[0]
            try:
                outputs = self._forward_hop(hop, hidden, mask, step, micro_batch)
                outputs, chosen = self._spot_check(
                    hop,
                    outputs,
                    lambda peer, h=hop, x=hidden: self._forward_hop(Hop(peer, h.start, h.end), x, mask, step, None),
                )
                hop = Hop(chosen, hop.start, hop.end)
            except PeerFailure as e:
                failed, since = e.peer, since or time.monotonic()
                self.give_up_after_patience(since, hop, e)
                continue
            self.recovered(failed, Method.FORWARD, step, since)
            failed, since = None, None
            inputs.append(HopInput(hop, hidden))
            hidden, block = outputs, hop.end
        return hidden, inputs

    def backward(
        self,
        inputs: list[HopInput],
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        input_grad: bool = True,
    ) -> torch.Tensor | None:
        """Backward through every hop of a forward, last first; the gradient of the stack's input only if
        ``input_grad``."""
        for index in reversed(range(len(inputs))):
            item = inputs[index]
            segment = Segment(item.hop.start, item.hop.end, item.hidden, grad)
            grad = self.backward_segment(
                segment, mask, ledger, micro_batch, cached_on=item.hop, input_grad=input_grad or index > 0
            )
            ledger.keep(micro_batch, segment, mask)
        return grad

    def backward_segment(
        self,
        segment: Segment,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        cached_on: Hop | None = None,
        input_grad: bool = True,
    ) -> torch.Tensor | None:
        """Backward through blocks [start, end) from their input and output gradient, on whichever peers are live.
        ``cached_on``: the hop that ran this segment's forward (it is tried first, without resending the input).

        Backwards are idempotent per (micro-batch, block) on the peers, so redoing part of a segment is safe.
        """
        failed, since = None, None
        prefer = None if cached_on is None else cached_on.peer_id
        while True:
            hops = self.router.wait_route(segment.start, segment.end, prefer=prefer, patience=self.patience)
            try:
                hiddens = [segment.hidden]
                for hop in hops[:-1]:
                    hiddens.append(self._forward_hop(hop, hiddens[-1], mask, ledger.step, None))
                grad = segment.grad_outputs
                for index in reversed(range(len(hops))):
                    hop, hidden, grad_out = hops[index], hiddens[index], grad
                    wanted = input_grad or index > 0 or self.spot_check > 0  # spot checks compare input gradients
                    grad = self._backward_hop(
                        hop, hidden, grad_out, mask, ledger, micro_batch, hop == cached_on, wanted
                    )
                    grad, chosen = self._spot_check(
                        hop,
                        grad,
                        lambda peer, h=hop, x=hidden, g=grad_out: self._backward_hop(
                            Hop(peer, h.start, h.end), x, g, mask, ledger, micro_batch
                        ),
                    )
                    ledger.acknowledge(micro_batch, hop.blocks, chosen)
            except PeerFailure as e:
                failed, since, prefer = e.peer, since or time.monotonic(), None
                self.give_up_after_patience(since, Hop(e.peer, segment.start, segment.end), e)
                continue
            self.recovered(failed, Method.BACKWARD, ledger.step, since)
            return grad


class RemoteStackFunction(torch.autograd.Function):
    """Autograd glue: the peers compute, this op only moves hidden states and their gradients."""

    @staticmethod
    def forward(ctx, hidden, mask, stack: RemoteStack, ledger: StepLedger, micro_batch: str, input_grad: bool):
        outputs, inputs = stack.forward(hidden.detach(), mask, ledger.step, micro_batch)
        ctx.stack, ctx.ledger, ctx.micro_batch, ctx.mask, ctx.inputs = stack, ledger, micro_batch, mask, inputs
        ctx.input_grad = input_grad
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs):
        grad_inputs = ctx.stack.backward(
            ctx.inputs, grad_outputs.contiguous(), ctx.mask, ctx.ledger, ctx.micro_batch, ctx.input_grad
        )
        return grad_inputs, None, None, None, None, None
