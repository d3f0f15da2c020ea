"""The remote decoder stack as one autograd op: forward through a chain of peers, backward in reverse,
re-routing around peers that fail, from what the client keeps."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerCalls, PeerFailure
from swarm.client.ledger import Segment, StepLedger
from swarm.client.routing import Hop
from swarm.net.errors import RemoteError
from swarm.net.protocol import BackwardRequest, ErrorKind, ForwardRequest, Method, Reply

logger = logging.getLogger(__name__)


@dataclass
class HopInput:
    """A hop of a forward pass and its input, kept for the backward."""

    hop: Hop
    hidden: torch.Tensor


class RemoteStack:
    """Runs blocks of one adapter through the swarm with retries, and records who holds which gradients.

    ``catch_up`` runs while a hop waits for a server: it brings new peers in (the trainer opens them and syncs
    laggards; a reader looks for a newer committed step), so that they become eligible."""

    def __init__(
        self,
        calls: PeerCalls,
        catch_up: Callable[[], None],
        spot_check: float = 0.0,
        spot_check_tolerance: float = 1e-3,
        chain: bool = True,
    ):
        self.calls, self.catch_up = calls, catch_up
        self.router, self.adapter, self.wire = calls.router, calls.adapter, calls.wire
        self.spot_check, self.spot_check_tolerance = spot_check, spot_check_tolerance
        self.chain = chain
        self.dishonest: list[PeerID] = []
        self.random = random.Random()

    def wait_route(self, start: int, end: int | None = None, prefer: PeerID | None = None) -> list[Hop]:
        """Hops over blocks [start, end) (to the last block when ``end`` is None), waiting up to the patience for
        servers to (re)join."""
        return self.router.wait_route(start, end, prefer=prefer, patience=self.calls.patience, on_wait=self.catch_up)

    def _span_ask(self, hop: Hop, request: ForwardRequest | BackwardRequest, tokens: torch.Tensor) -> Reply:
        """A forward or backward request; ``tokens`` (batch x length) sizes its timeout."""
        units = tokens.shape[0] * tokens.shape[1] * (hop.end - hop.start)
        return self.calls.ask(hop.peer_id, request, units)

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
        left out (sent after all if it no longer holds them). ``input_grad``: whether the input gradient is needed.
        The ledger learns who holds the gradients from the caller, once the hop's result is chosen."""
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
            raise self.calls.peer_failed(hop.peer_id, "backward: the reply lacks the input gradient asked for")
        return reply.grad_inputs.to(grad.dtype) if input_grad else None

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
                self.calls.current.forget(peer)
        chosen = hop.peer_id if hop.peer_id in majority else majority[0]
        return opinions[chosen], chosen

    # --- forward and backward -------------------------------------------------------------------------------

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> tuple[torch.Tensor, list[HopInput]]:
        """Through blocks [0, n); a hop that fails is redone on another replica from the same input."""
        inputs: list[HopInput] = []
        block, attempts = 0, self.calls.attempts(Method.FORWARD)
        while block < self.router.num_blocks:
            hop = self.wait_route(block)[0]
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
        attempts = self.calls.attempts(Method.BACKWARD)
        prefer = None if cached_on is None else cached_on.peer_id
        while True:
            hops = self.wait_route(segment.start, segment.end, prefer)
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
