"""The remote decoder stack as one autograd op: forward through a chain of peers, backward in reverse, re-routing
around peers that fail, from what the client and the peers keep. By default the peers pass the hidden states on
themselves (a chain: swarm/net/chain.py); ``chain=False`` makes every hop a round trip from the client."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from swarm.client.calls import Attempts, PeerCalls, PeerFailure
from swarm.client.chaindeltas import ChainDeltas
from swarm.client.collects import Collect, Collects
from swarm.client.ledger import Segment, StepLedger
from swarm.client.routing import Hop
from swarm.client.trust import Trust
from swarm.net.chain import MAX_ROUTE_MADDRS, ChainFailure, ChainHop, FailureKind, HopAck, route_timeout
from swarm.net.deltas import Delta
from swarm.net.errors import LeaseLostError, MissingReferenceError, RemoteError
from swarm.net.protocol import (
    PEER_STATE_ERRORS,
    BackwardRequest,
    ErrorKind,
    ForwardRequest,
    HiddenReply,
    InferRequest,
    Method,
    Reply,
)

ChainRequest = ForwardRequest | BackwardRequest | InferRequest

logger = logging.getLogger(__name__)


@dataclass
class HopInput:
    """A hop of a forward pass and, when the client holds it, its input: every hop's for client-driven hops; for a
    chain, the first hop's and that of each hop the client re-entered the chain at (the other peers keep theirs)."""

    hop: Hop
    hidden: torch.Tensor | None


@dataclass(frozen=True)
class BackwardResult:
    """What one hop's backward gave: the gradient of its input (when asked for), which peer ran it, and the hashes
    of the micro-batch's LoRA gradients it holds, per block (what a spot check compares)."""

    grad_inputs: torch.Tensor | None
    peer: PeerID
    hashes: dict[int, str]


@dataclass
class Forwarded:
    """What a training forward leaves for its backward: the hops that ran it, in order, whether their peers passed
    the hidden states on themselves (``chained``), and the rate at which its hops are spot-checked."""

    hops: list[HopInput]
    chained: bool
    check: float


class RemoteStack:
    """Runs blocks of one adapter through the swarm with retries, and records who holds which gradients.

    ``catch_up`` runs while a hop waits for a server: it brings new peers in (the trainer opens them and syncs
    laggards; a reader looks for a newer committed step), so that they become eligible. ``unserved`` is told the
    blocks that have no live server at all meanwhile (it asks peers to take them over now)."""

    def __init__(
        self,
        calls: PeerCalls,
        catch_up: Callable[[], None],
        trust: Trust,
        chain: bool = True,
        unserved: Callable[[list[int]], None] | None = None,
        deltas: ChainDeltas | None = None,
    ):
        """``trust``: the spot checks hops go through. ``deltas``: the references a chained forward's hidden states
        are sent as changes against, where the wire does (``WireFormat.delta_bits``)."""
        self.calls, self.catch_up, self.unserved = calls, catch_up, unserved
        self.trust, self.deltas = trust, deltas or ChainDeltas(calls, None)
        self.collects = Collects(calls)  # chains' outputs, straight from their last hop
        self.router, self.adapter, self.wire = calls.router, calls.adapter, calls.wire
        self.chain = chain
        # The dtype of the autocast the client's forwards run under (a Trainer's bf16), sent with every forward and
        # backward so that the peers compute under it too; set by the model at each forward.
        self.autocast: str | None = None

    def wait_route(self, start: int, end: int | None = None, prefer: PeerID | None = None) -> list[Hop]:
        """Hops over blocks [start, end) (to the last block when ``end`` is None), waiting up to the patience for
        servers to (re)join."""
        return self.router.wait_route(
            start, end, prefer=prefer, patience=self.calls.patience, on_wait=self.catch_up, on_missing=self.unserved
        )

    def _span_ask(self, hop: Hop, request: ForwardRequest | BackwardRequest, tokens: torch.Tensor) -> Reply:
        """A forward or backward request; ``tokens`` (batch x length) sizes its timeout."""
        units = tokens.shape[0] * tokens.shape[1] * (hop.end - hop.start)
        return self.calls.ask(hop.peer_id, request, units)

    def _forward_hop(
        self, hop: Hop, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> torch.Tensor:
        wire = self.wire
        request = ForwardRequest(
            adapter=self.adapter,
            start=hop.start,
            end=hop.end,
            step=step,
            hidden=wire.cast(hidden),
            mask=mask,
            micro_batch=micro_batch,
            compression=wire.compression,
            autocast=self.autocast,
        )
        return self.output_of(self._span_ask(hop, request, hidden), hop.peer_id).to(hidden.dtype)

    def output_of(self, reply: HiddenReply, peer: PeerID) -> torch.Tensor:
        """The hidden states a reply without a collect carries (a reply that lacks them is the peer's failure)."""
        if not isinstance(reply.outputs, torch.Tensor):
            raise self.calls.peer_failed(peer, "the reply lacks the hidden states of its output")
        return reply.outputs

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
    ) -> BackwardResult:
        """Backward through one hop. ``cached``: this peer ran the micro-batch's forward, so the hidden states are
        left out (sent after all if it no longer holds them). ``input_grad``: whether the input gradient is needed.
        The ledger learns who holds the gradients from the caller, once the hop's result is chosen."""
        wire = self.wire
        request = BackwardRequest(
            adapter=self.adapter,
            start=hop.start,
            end=hop.end,
            step=ledger.step,
            micro_batch=micro_batch,
            grad=wire.cast(grad),
            hidden=None if cached else wire.cast(hidden),
            mask=mask,
            input_grad=input_grad,
            compression=wire.backward_compression,
            autocast=self.autocast,
        )
        try:
            reply = self._span_ask(hop, request, grad)
        except RemoteError as e:
            if not cached or e.kind != ErrorKind.MISSING_FORWARD:
                raise
            return self._backward_hop(hop, hidden, grad, mask, ledger, micro_batch, False, input_grad)
        if len(reply.acks) != 1:
            raise self.calls.peer_failed(hop.peer_id, "backward: the reply does not acknowledge exactly its hop")
        hashes = self._ack_hashes(reply.acks[0], hop)
        ledger.note_norms(reply.acks[0].norms)
        if input_grad and reply.grad_inputs is None:
            raise self.calls.peer_failed(hop.peer_id, "backward: the reply lacks the input gradient asked for")
        return BackwardResult(reply.grad_inputs.to(grad.dtype) if input_grad else None, hop.peer_id, hashes)

    def _ack_hashes(self, ack: HopAck, hop: Hop) -> dict[int, str]:
        """The gradient hashes a backward's ack reports, one for each block of its hop (else the hop failed: without
        them, nobody could check the gradients it hands on at commit)."""
        hashes = dict(ack.hashes)
        if sorted(hashes) != list(hop.blocks):
            raise self.calls.peer_failed(hop.peer_id, "backward: the ack lacks the hash of some block's gradients")
        return hashes

    # --- forward and backward -------------------------------------------------------------------------------

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> tuple[torch.Tensor, Forwarded]:
        """Through blocks [0, n): along a chain of peers, or hop by hop from the client (``chain=False``, and the
        micro-batches drawn for a spot check, whose every hop is then checked: the same share of hops as
        client-driven checks)."""
        rate = self.trust.rate()
        if self.chain and not self.trust.drawn(rate):
            sample = None if micro_batch is None else self.deltas.sample_of(hidden, mask)  # an eval's: seldom again
            return self.forward_chain(hidden, mask, step, micro_batch, sample)
        rate = 1.0 if self.chain else rate
        outputs, inputs = self._forward_hops(hidden, mask, step, micro_batch, rate)
        return outputs, Forwarded(inputs, chained=False, check=rate)

    def backward(
        self,
        forwarded: Forwarded,
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        input_grad: bool = True,
    ) -> torch.Tensor | None:
        """Backward through every hop of a forward, last first; the gradient of the stack's input only if
        ``input_grad``. The client keeps what a replay needs until the step commits: each hop's input and output
        gradient, or for a chain the stack's input and output gradient."""
        if not forwarded.chained:
            return self._backward_hops(forwarded, grad, mask, ledger, micro_batch, input_grad)
        first = forwarded.hops[0]
        ledger.keep(micro_batch, Segment(first.hop.start, forwarded.hops[-1].hop.end, first.hidden, grad), mask)
        return self.backward_chain(forwarded, grad, mask, ledger, micro_batch, input_grad)

    def _forward_hops(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None, rate: float
    ) -> tuple[torch.Tensor, list[HopInput]]:
        """Client-driven: a hop that fails is redone on another replica from the same input."""
        inputs: list[HopInput] = []
        block, attempts = 0, self.calls.attempts(Method.FORWARD)
        while block < self.router.num_blocks:
            hop = self.wait_route(block)[0]
            try:
                outputs = self._forward_hop(hop, hidden, mask, step, micro_batch)
                outputs, chosen = self.trust.check(
                    hop,
                    outputs,
                    lambda peer, h=hop, x=hidden: self._forward_hop(Hop(peer, h.start, h.end), x, mask, step, None),
                    rate,
                    autocast=self.autocast,
                )
                hop = Hop(chosen, hop.start, hop.end)
            except PeerFailure as e:
                attempts.failed(e, hop)
                continue
            attempts.succeeded(step)
            inputs.append(HopInput(hop, hidden))
            hidden, block = outputs, hop.end
        return hidden, inputs

    def _backward_hops(
        self,
        forwarded: Forwarded,
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        input_grad: bool,
    ) -> torch.Tensor | None:
        inputs = forwarded.hops
        for index in reversed(range(len(inputs))):
            item = inputs[index]
            segment = Segment(item.hop.start, item.hop.end, item.hidden, grad)
            grad = self.backward_segment(
                segment,
                mask,
                ledger,
                micro_batch,
                cached_on=item.hop,
                input_grad=input_grad or index > 0,
                rate=forwarded.check,
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
        rate: float | None = None,
    ) -> torch.Tensor | None:
        """Backward through blocks [start, end) from their input and output gradient, on whichever peers are live,
        hop by hop from the client. ``cached_on``: the hop that ran this segment's forward (it is tried first,
        without resending the input). ``rate``: of spot checks (default: the stack's).

        Backwards are idempotent per (micro-batch, block) on the peers, so redoing part of a segment is safe.
        """
        rate = self.trust.rate() if rate is None else rate
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
                    wanted = input_grad or index > 0 or rate > 0  # spot checks compare input gradients
                    ran = self._backward_hop(hop, hidden, grad_out, mask, ledger, micro_batch, hop == cached_on, wanted)
                    ran, chosen = self.trust.check(
                        hop,
                        ran,
                        lambda peer, h=hop, x=hidden, g=grad_out: self._backward_hop(
                            Hop(peer, h.start, h.end), x, g, mask, ledger, micro_batch
                        ),
                        rate,
                        lambda a, b, tol, h=hop: self.trust.backwards_agree(a, b, tol, h, ledger.step, micro_batch),
                        self.autocast,
                    )
                    ledger.acknowledge(micro_batch, hop.blocks, chosen, ran.hashes)
                    grad = ran.grad_inputs
            except PeerFailure as e:
                prefer = None
                attempts.failed(e, Hop(e.peer, segment.start, segment.end))
                continue
            attempts.succeeded(ledger.step)
            return grad

    # --- chains -----------------------------------------------------------------------------------------------

    def route_of(self, hops: list[Hop], method: str, tokens: torch.Tensor) -> list[ChainHop]:
        """Hops as a chained request names them: each with its own timeout and the addresses the client knows."""
        addresses = self.calls.transport.addresses
        return [
            ChainHop(
                hop.peer_id.to_base58(),
                hop.start,
                hop.end,
                self.router.timeout(hop.peer_id, method, self._units(hop, tokens)),
                tuple(addresses.get(hop.peer_id, ())[:MAX_ROUTE_MADDRS]),
            )
            for hop in hops
        ]

    @staticmethod
    def _units(hop: Hop, tokens: torch.Tensor) -> float:
        return tokens.shape[0] * tokens.shape[1] * (hop.end - hop.start)

    def chain_ask(self, hops: list[Hop], request: ChainRequest, tokens: torch.Tensor) -> tuple[Reply, list[Hop]]:
        """Send a chained request (``hops``: the hop it goes to, then its route) and check the reply: the hops that
        ran must be the route's first ones, in order, and the chain must have run to its end unless it says where
        it broke. Returns the reply and the hops that ran; each hop's own time is learned from the acks."""
        first, started = hops[0], time.monotonic()
        units = self._units(first, tokens)
        reply = self.calls.ask(first.peer_id, request, units, floor=route_timeout(request.route), measured=False)
        acks = reply.acks
        expected = hops if reply.failure is None else hops[: len(acks)]
        ran = [Hop(PeerID.from_base58(a.peer), a.start, a.end) for a in acks]
        if not acks or ran != expected or (reply.failure is not None and len(acks) >= len(hops)):
            raise self.calls.peer_failed(first.peer_id, f"{request.method}: the chain's acks do not match its route")
        if reply.failure is not None and reply.failure.peer != hops[len(acks)].peer_id.to_base58():
            raise self.calls.peer_failed(first.peer_id, f"{request.method}: the chain names the wrong hop as failed")
        for index, ack in enumerate(acks):  # a hop's own time: its answer's, less the chain's after it
            spent = time.monotonic() - started if index == 0 else ack.seconds  # the first's: the client's link too
            after = acks[index + 1].seconds if index + 1 < len(acks) else 0.0
            own = max(spent - after, 0.0)
            hop_units = self._units(ran[index], tokens)
            self.router.succeeded(ran[index].peer_id, request.method, hop_units, own, ack.compute)
        return reply, ran

    def chain_failed(self, failure: ChainFailure, attempts: Attempts, at: Hop) -> PeerID | None:
        """Where a chain broke: ban a hop that failed for its own reasons (the work goes elsewhere); a hop the one
        before could not connect to, but the client still can, may be out of that peer's reach only: the client
        calls it itself next (returned: the peer to prefer). A refusal of the request itself raises, as it would
        from the client's own call."""
        peer = PeerID.from_base58(failure.peer)
        reason = f"{failure.kind}: {failure.error}"
        if failure.kind == ErrorKind.FENCED:
            raise LeaseLostError(failure.error)
        if failure.kind == FailureKind.UNREACHABLE and self.calls.likely_reachable(peer):
            attempts.failed(PeerFailure(peer, f"unreachable from the hop before it: {failure.error}"), at)
            return peer
        if failure.kind in (FailureKind.TIMEOUT, FailureKind.UNREACHABLE) or failure.kind in PEER_STATE_ERRORS:
            attempts.failed(self.calls.peer_failed(peer, reason), at)
            return None
        raise RemoteError(failure.kind, f"{failure.peer}: {failure.error}", {})

    def forward_chain(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        step: int,
        micro_batch: str | None,
        sample: str | None = None,
    ) -> tuple[torch.Tensor, Forwarded]:
        """The hidden states go to the first span with the route after it; each peer passes its output on, and the
        last hands its output to the client's collect (the acks come back along the chain). Where the chain breaks,
        the client goes on from the output of the last hop that ran, on a new route (through the failed peer itself
        when the hop before could only not reach it); where the chain ran but its collect failed, the last hop is
        lost: the client sends the same input again, on a route without it. With a ``sample``, hidden states travel
        as changes since its last pass (swarm.net.deltas)."""
        inputs: list[HopInput] = []
        block, prefer, attempts = 0, None, self.calls.attempts(Method.FORWARD)
        while block < self.router.num_blocks:
            hops = self.wait_route(block, prefer=prefer)
            prefer, first, last = None, hops[0], hops[-1]
            collect = None if len(hops) == 1 else self._collect(hops, hidden)
            try:
                request = self._chain_forward_request(hops, hidden, mask, step, micro_batch, sample, collect)
                reply, ran = self.chain_ask(hops, request, hidden)
                outputs = self.deltas.incoming(request, ran[-1], self._chain_output(reply, ran, collect))
            except PeerFailure as e:
                attempts.failed(e, first)
                continue
            except RemoteError as e:
                if sample is None or e.kind != ErrorKind.MISSING_REFERENCE:
                    raise
                self.deltas.forget(sample, block, first.peer_id, sent=True)  # send the value
                continue
            except MissingReferenceError:  # a micro-batch of the same tokens in flight moved the reference on
                self.deltas.forget(sample, last.end, last.peer_id)  # ask for the value
                continue
            finally:
                if collect is not None:
                    collect.abandon()  # a no-op once its output came
            inputs.append(HopInput(ran[0], hidden))
            inputs.extend(HopInput(hop, None) for hop in ran[1:])
            hidden, block = outputs.to(hidden.dtype), ran[-1].end
            if reply.failure is not None:
                prefer = self.chain_failed(reply.failure, attempts, hops[len(ran)])
        attempts.succeeded(step)
        return hidden, Forwarded(inputs, chained=True, check=0.0)

    def _chain_forward_request(
        self,
        hops: list[Hop],
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        step: int,
        micro_batch: str | None,
        sample: str | None,
        collect: Collect | None,
    ) -> ForwardRequest:
        """A forward to the chain's first span (``hops[0]``) with the rest as its route; its output to ``collect``
        (a chain of one hop answers with it: its reply crosses the same link)."""
        first, last, wire = hops[0], hops[-1], self.wire
        return ForwardRequest(
            adapter=self.adapter,
            start=first.start,
            end=first.end,
            step=step,
            hidden=self.deltas.outgoing(sample, first.start, wire.cast(hidden), first.peer_id),
            mask=mask,
            micro_batch=micro_batch,
            compression=wire.compression,
            route=self.route_of(hops[1:], Method.FORWARD, hidden),
            autocast=self.autocast,
            sample=sample,
            have=self.deltas.have(sample, last),
            deliver=None if collect is None else collect.delivery,
        )

    def _collect(self, hops: list[Hop], hidden: torch.Tensor) -> Collect:
        """The collect of a chain's output from its last hop, waiting (and the hop holding the output) at most the
        chain's timeout."""
        wait = route_timeout(self.route_of(hops, Method.FORWARD, hidden))
        size = math.ceil(hidden.numel() * self.wire.value_bytes(hidden.dtype))
        return self.collects.start(hops[-1].peer_id, wait, size)

    def _chain_output(self, reply: HiddenReply, ran: list[Hop], collect: Collect | None) -> torch.Tensor | Delta:
        """The output of the last hop that ran: the reply's, or the collect's (its failure: the last hop's)."""
        outputs = reply.outputs if collect is None else collect.outputs(reply)
        if outputs is None:
            raise self.calls.peer_failed(ran[0].peer_id, "forward: a broken chain's reply lacks its output")
        return outputs

    def backward_chain(
        self,
        forwarded: Forwarded,
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        input_grad: bool,
    ) -> torch.Tensor | None:
        """The gradient goes to the last span with the spans before it as the route; each peer runs its backward
        from the input it kept and hands the gradient of that input on; the acks say who holds which gradients.
        Where the chain breaks at a peer that died (with the inputs it kept), the rest runs hop by hop from the
        nearest input the client holds."""
        pending = list(forwarded.hops)  # hops whose backward has not run, in the forward's order
        attempts = self.calls.attempts(Method.BACKWARD)
        while True:
            hops = [item.hop for item in reversed(pending)]
            last = hops[0]
            request = self._chain_backward_request(hops, grad, mask, ledger.step, micro_batch, input_grad)
            try:
                reply, ran = self.chain_ask(hops, request, grad)
                hashes = [self._ack_hashes(ack, hop) for hop, ack in zip(ran, reply.acks, strict=True)]
            except PeerFailure as e:
                attempts.failed(e, last)
                break
            except RemoteError as e:
                if e.kind != ErrorKind.MISSING_FORWARD:
                    raise
                break  # that peer no longer holds the forward (it restarted): the client sends the input
            for hop, ack, hop_hashes in zip(ran, reply.acks, hashes, strict=True):
                ledger.acknowledge(micro_batch, hop.blocks, hop.peer_id, hop_hashes)
                ledger.note_norms(ack.norms)
            del pending[len(pending) - len(ran) :]
            if reply.failure is None:
                attempts.succeeded(ledger.step)
                if input_grad and reply.grad_inputs is None:
                    raise self.calls.peer_failed(ran[-1].peer_id, "backward: the reply lacks the input gradient")
                return reply.grad_inputs.to(grad.dtype) if input_grad else None
            if reply.grad_inputs is None:
                raise self.calls.peer_failed(ran[-1].peer_id, "backward: a broken chain's reply lacks its gradient")
            grad = reply.grad_inputs.to(grad.dtype)
            lost_input = reply.failure.kind == ErrorKind.MISSING_FORWARD
            if lost_input or self.chain_failed(reply.failure, attempts, hops[len(ran)]) is None:
                break
        grad = self._backward_rest(pending, grad, mask, ledger, micro_batch, input_grad)
        attempts.succeeded(ledger.step)
        return grad

    def _chain_backward_request(
        self,
        hops: list[Hop],
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        step: int,
        micro_batch: str,
        input_grad: bool,
    ) -> BackwardRequest:
        """A backward to the chain's last span (``hops[0]``), with the spans before it as the route: each peer runs
        its backward from the input it kept."""
        last = hops[0]
        return BackwardRequest(
            adapter=self.adapter,
            start=last.start,
            end=last.end,
            step=step,
            micro_batch=micro_batch,
            grad=self.wire.cast(grad),
            hidden=None,
            mask=mask,
            input_grad=input_grad,
            compression=self.wire.backward_compression,
            route=self.route_of(hops[1:], Method.BACKWARD, grad),
            autocast=self.autocast,
        )

    def _backward_rest(
        self,
        pending: list[HopInput],
        grad: torch.Tensor,
        mask: torch.Tensor | None,
        ledger: StepLedger,
        micro_batch: str,
        input_grad: bool,
    ) -> torch.Tensor | None:
        """The backward of the hops a broken chain left, hop by hop: from the input the client holds nearest before
        them (the stack's, or where it re-entered the forward chain), forward again to where the gradient stands."""
        held = max(index for index, item in enumerate(pending) if item.hidden is not None)
        segment = Segment(pending[held].hop.start, pending[-1].hop.end, pending[held].hidden, grad)
        grad = self.backward_segment(segment, mask, ledger, micro_batch, input_grad=input_grad or held > 0)
        if held == 0:
            return grad
        return self.backward_chain(
            Forwarded(pending[:held], chained=True, check=0.0), grad, mask, ledger, micro_batch, input_grad
        )


class RemoteStackFunction(torch.autograd.Function):
    """Autograd glue: the peers compute, this op only moves hidden states and their gradients."""

    @staticmethod
    def forward(ctx, hidden, mask, stack: RemoteStack, ledger: StepLedger, micro_batch: str, input_grad: bool):
        outputs, forwarded = stack.forward(hidden.detach(), mask, ledger.step, micro_batch)
        ctx.stack, ctx.ledger, ctx.micro_batch, ctx.mask, ctx.forwarded = stack, ledger, micro_batch, mask, forwarded
        ctx.input_grad = input_grad
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs):
        grad_inputs = ctx.stack.backward(
            ctx.forwarded, grad_outputs.contiguous(), ctx.mask, ctx.ledger, ctx.micro_batch, ctx.input_grad
        )
        return grad_inputs, None, None, None, None, None
