"""The remote decoder stack as one autograd op: forward through a chain of peers, backward in reverse,
re-routing around peers that fail, from what the client keeps."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarm.client.ledger import Segment, StepLedger
from swarm.client.routing import Hop, Router
from swarm.net.compression import WireFormat
from swarm.net.errors import TRANSPORT_ERRORS, LeaseLostError, RemoteError, SwarmUnavailableError
from swarm.net.protocol import PEER_STATE_ERRORS, ErrorKind, Method, SpanRequest
from swarm.net.transport import Transport
from swarm.net.wire import Message

logger = logging.getLogger(__name__)


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

    def call(
        self,
        peer: PeerID,
        meta: dict,
        tensors: list[torch.Tensor],
        units: float = 1.0,
        floor: float = 0.0,
        compression: int = runtime_pb2.CompressionType.NONE,
    ) -> Message:
        """One request; failures of the peer become PeerFailure (after a ban), refusals of the request raise."""
        method = meta["method"]
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

    def _tensors(self, hidden: torch.Tensor, mask: torch.Tensor | None, *extra: torch.Tensor) -> list[torch.Tensor]:
        """A span request's tensors, floating ones in the wire's dtype."""
        return [self.wire.cast(t) for t in (hidden, *extra)] + ([mask] if mask is not None else [])

    def _span_call(self, hop: Hop, request: SpanRequest, tensors: list[torch.Tensor], dtype: torch.dtype) -> Message:
        """A forward or backward request in the wire's format; the answer back in the client's ``dtype``."""
        units = tensors[0].shape[0] * tensors[0].shape[1] * (hop.end - hop.start)
        reply = self.call(hop.peer_id, request.to_meta(), tensors, units, compression=self.wire.compression_type)
        return Message(reply.meta, [t.to(dtype) for t in reply.tensors])

    def _forward_hop(
        self, hop: Hop, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> torch.Tensor:
        request = SpanRequest(
            Method.FORWARD,
            self.adapter,
            hop.start,
            hop.end,
            step,
            mask is not None,
            micro_batch,
            compression=self.wire.compression,
        )
        return self._span_call(hop, request, self._tensors(hidden, mask), hidden.dtype).tensors[0]

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
        request = SpanRequest(
            Method.BACKWARD,
            self.adapter,
            hop.start,
            hop.end,
            ledger.step,
            mask is not None,
            micro_batch,
            has_hidden=not cached,
            input_grad=input_grad,
            compression=self.wire.compression,
        )
        tensors = self._tensors(grad, mask) if cached else self._tensors(hidden, mask, grad)
        try:
            reply = self._span_call(hop, request, tensors, grad.dtype)
        except RemoteError as e:
            if not cached or e.kind != ErrorKind.MISSING_FORWARD:
                raise
            return self._backward_hop(hop, hidden, grad, mask, ledger, micro_batch, False, input_grad)
        ledger.acknowledge(micro_batch, hop.blocks, hop.peer_id)
        return reply.tensors[0] if input_grad else None

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

    def attempts(self, during: str) -> Attempts:
        """The retry of one piece of work (a hop, a segment, a token) over whichever replicas are live."""
        return Attempts(self, during)

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> tuple[torch.Tensor, list[HopInput]]:
        """Through blocks [0, n); a hop that fails is redone on another replica from the same input."""
        inputs: list[HopInput] = []
        block, attempts = 0, self.attempts("forward")
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
                attempts.failed(e, hop)
                continue
            attempts.succeeded(step)
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
        attempts = self.attempts("backward")
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
                prefer = None
                attempts.failed(e, Hop(e.peer, segment.start, segment.end))
                continue
            attempts.succeeded(ledger.step)
            return grad


class Attempts:
    """One piece of work tried on one replica after another. The first failure starts the patience clock; work
    that keeps failing on every server (each one answering with an internal error, say) is given up after
    ``patience`` rather than retried forever; success records the recovery. What counts as a peer's fault, and its
    ban with backoff, is ``RemoteStack.call``'s to say."""

    def __init__(self, stack: RemoteStack, during: str):
        self.stack, self.during = stack, during
        self.last_failed: PeerID | None = None
        self.since: float | None = None

    def failed(self, error: PeerFailure, hop: Hop) -> None:
        """Note a failure on ``hop``; raise SwarmUnavailableError once the work has failed for ``patience``."""
        self.last_failed, self.since = error.peer, self.since or time.monotonic()
        if time.monotonic() - self.since > self.stack.patience:
            raise SwarmUnavailableError(
                f"blocks {hop.start}:{hop.end} have failed on every server tried for {self.stack.patience:.0f}s; "
                f"the last error: {error}. See that peer's log, or raise the client's patience"
            ) from error

    def succeeded(self, step: int) -> None:
        """The work went through: a recovery, if it had failed; the next piece starts with a clean slate."""
        self.stack.recovered(self.last_failed, self.during, step, self.since)
        self.last_failed = self.since = None


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
