"""The remote decoder stack as one autograd op: forward through a chain of peers, backward in reverse, re-routing
around peers that fail, from what the client and the peers keep. By default the peers pass the hidden states on
themselves (a chain: swarm/net/chain.py); ``chain=False`` makes every hop a round trip from the client."""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.p2p import PeerID

from swarm.client.calls import Attempts, PeerCalls, PeerFailure
from swarm.client.ledger import Segment, StepLedger
from swarm.client.routing import Hop
from swarm.net import rotated
from swarm.net.chain import MAX_ROUTE_MADDRS, ChainFailure, ChainHop, FailureKind, HopAck, route_timeout
from swarm.net.deltas import Delta, DeltaReferences, ReferenceKey
from swarm.net.errors import LeaseLostError, MissingReferenceError, RemoteError
from swarm.net.gradhash import grad_hash
from swarm.net.numerics import tolerance
from swarm.net.protocol import (
    PEER_STATE_ERRORS,
    SUM,
    BackwardRequest,
    ErrorKind,
    ForwardRequest,
    GradsRequest,
    InferRequest,
    Method,
    Reply,
)
from swarm.net.reduction import partial_sum, same_bits

ChainRequest = ForwardRequest | BackwardRequest | InferRequest
T = TypeVar("T")

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


# Spot checks by default, in a public swarm (no swarm key): this share of micro-batches is also computed on other
# replicas, hop by hop, wherever a span has VOTERS replicas (two that agree outvote a third). Its cost per step is
# measured by scripts/bench_step.py --spot-check (BENCHMARKS.md); a private swarm checks nothing unless asked.
PUBLIC_SPOT_CHECK = 0.03
VOTERS = 3


def spot_check_policy(requested: float | None, private: bool) -> tuple[float, int]:
    """(rate, replicas a hop needs to be checked). A rate given is used wherever a hop has another replica; none
    given: PUBLIC_SPOT_CHECK where a vote can decide in a public swarm, nothing in a private one."""
    if requested is not None:
        if not 0.0 <= requested <= 1.0:
            raise ValueError(f"spot_check is a fraction of micro-batches, from 0 to 1; got {requested}")
        return requested, 2
    return (0.0 if private else PUBLIC_SPOT_CHECK), VOTERS


SPOT_CHECK_ROUNDS = 3  # times a spot check asks a replica that did not answer in time


Verdict = Callable[[PeerID, PeerID], bool | None]  # two replicas' results agree, disagree, or cannot be told


def _majority(opinions: dict[PeerID, T], verdict: Verdict) -> list[PeerID]:
    """The largest group of at least two peers whose results agree with one of them (empty if none)."""
    majority: list[PeerID] = []
    for reference in opinions:
        agreeing = [p for p in opinions if p == reference or verdict(reference, p) is True]
        if len(agreeing) >= 2 and len(agreeing) > len(majority):
            majority = agreeing
    return majority


def _outvoted(majority: list[PeerID], opinions: dict, verdict: Verdict) -> list[PeerID]:
    """The peers outside the majority that two of its members disagree with; one that the majority's numerics
    cannot judge is not among them."""
    return [
        peer
        for peer in opinions
        if peer not in majority and sum(verdict(member, peer) is False for member in majority) >= 2
    ]


def _decided(majority: list[PeerID], opinions: dict) -> bool:
    """Everyone asked so far agrees (at least two), or two agree beside a third (outvoted, or out of their reach)."""
    return len(majority) >= 2 and (len(majority) == len(opinions) or len(opinions) >= 3)


class RemoteStack:
    """Runs blocks of one adapter through the swarm with retries, and records who holds which gradients.

    ``catch_up`` runs while a hop waits for a server: it brings new peers in (the trainer opens them and syncs
    laggards; a reader looks for a newer committed step), so that they become eligible. ``unserved`` is told the
    blocks that have no live server at all meanwhile (it asks peers to take them over now)."""

    def __init__(
        self,
        calls: PeerCalls,
        catch_up: Callable[[], None],
        spot_check: float = 0.0,
        chain: bool = True,
        min_voters: int = 2,
        unserved: Callable[[list[int]], None] | None = None,
        references: DeltaReferences | None = None,
    ):
        """``references``: the samples' last hidden states sent and received, given where the wire sends a chained
        forward's hidden states as changes (``WireFormat.delta_bits``); None: it does not."""
        self.calls, self.catch_up, self.unserved = calls, catch_up, unserved
        self.references = references
        self.router, self.adapter, self.wire = calls.router, calls.adapter, calls.wire
        self.spot_check = spot_check
        self.chain, self.min_voters = chain, min_voters  # min_voters: replicas of a hop (itself included) to check it
        self.dishonest: list[PeerID] = []
        self.random = random.Random()
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

    def ban_dishonest(self, peer: PeerID, reason: str) -> None:
        """``peer`` was caught (a spot check, the commit's vote, gradients that do not match their hash): never route
        to it or commit on it again, nor count it as a replica."""
        if peer in self.dishonest:
            return
        self.router.distrust(peer, reason)
        self.dishonest.append(peer)
        self.calls.current.forget(peer)

    # --- spot checks ------------------------------------------------------------------------------------------

    @staticmethod
    def _agree(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
        """Within ``tolerance``, relative to the larger of the two largest magnitudes (swarm/net/numerics.py)."""
        scale = max(a.abs().max().item(), b.abs().max().item(), 1e-6)
        return a.shape == b.shape and (a - b).abs().max().item() <= tolerance * scale

    def _tolerance(self, a: PeerID, b: PeerID, hop: Hop) -> float | None:
        """How far two replicas' honest results of ``hop`` may differ, from the numerics their records announce;
        None where that cannot be told (numerics too coarse, or a record gone)."""
        announced = {r.peer_id: r.numerics for r in self.router.replicas(hop.start, eligible_only=False)}
        if a not in announced or b not in announced:
            return None
        return tolerance(announced[a], announced[b], hop.blocks, self.autocast)

    def _check_rate(self) -> float:
        """The spot-check rate now: none while no block has enough replicas to be checked (a checked micro-batch,
        and the input gradients a check compares, would only cost)."""
        if self.spot_check <= 0:
            return 0.0
        blocks = range(self.router.num_blocks)
        return self.spot_check if any(len(self.router.replicas(b)) >= self.min_voters for b in blocks) else 0.0

    def _backwards_agree(
        self, a: BackwardResult, b: BackwardResult, tolerance: float, hop: Hop, step: int, micro_batch: str
    ) -> bool:
        """Two replicas' backwards of a hop agree: their input gradients within ``tolerance``, and their LoRA
        gradients bit for bit (equal hashes) or, where the hashes differ (other kernels or numerics), within it as
        each holder hands them on (checked against the hashes it reported)."""
        if a.grad_inputs is None or b.grad_inputs is None or not self._agree(a.grad_inputs, b.grad_inputs, tolerance):
            return False
        if a.hashes == b.hashes:
            return True
        grads_a = self._reported_grads(a, hop, step, micro_batch)
        grads_b = self._reported_grads(b, hop, step, micro_batch)
        if grads_a is None or grads_b is None or len(grads_a) != len(grads_b):
            return False
        pairs = zip(grads_a, grads_b, strict=True)
        return all(x.shape == y.shape and (x.numel() == 0 or self._agree(x, y, tolerance)) for x, y in pairs)

    def _reported_grads(
        self, result: BackwardResult, hop: Hop, step: int, micro_batch: str
    ) -> list[torch.Tensor] | None:
        """The LoRA gradients of ``micro_batch`` that ``result``'s peer holds on the hop's blocks (in block order),
        if it hands them on as they hash in its ack; None if it does not (or does not answer)."""
        wanted = {block: [micro_batch] for block in hop.blocks}
        hashes = {block: {micro_batch: result.hashes[block]} for block in hop.blocks}
        try:
            grads = self.reported_grads(result.peer, step, wanted, hashes)
        except (PeerFailure, RemoteError) as e:
            logger.warning("spot check: could not fetch gradients from %s: %s", result.peer, e)
            return None
        return None if grads is None else [t.float() for block in hop.blocks for t in grads[block][micro_batch]]

    def reported_sums(
        self, peer: PeerID, step: int, wanted: dict[int, list[str]], hashes: dict[int, dict[str, str]]
    ) -> bool:
        """Whether ``peer`` hands on the ``wanted`` micro-batch gradients as it reported them (see
        ``reported_grads``) and, per block, a partial sum that is theirs to the bit (swarm/net/reduction.py). Raises
        PeerFailure or RemoteError when it does not answer."""
        grads = self.reported_grads(peer, step, wanted, hashes)
        if grads is None:
            return False
        sums = self.calls.ask(peer, GradsRequest(adapter=self.adapter, step=step, wanted=wanted, summed=True)).grads
        return all(
            same_bits(sums.get(block, {}).get(SUM, []), partial_sum(grads[block], tuple(mbs)))
            for block, mbs in wanted.items()
        )

    def reported_grads(
        self, peer: PeerID, step: int, wanted: dict[int, list[str]], hashes: dict[int, dict[str, str]]
    ) -> dict[int, dict[str, list[torch.Tensor]]] | None:
        """The ``wanted`` micro-batch gradients as ``peer`` hands them on (peer to peer, at commit), if every one
        hashes as ``hashes`` (block -> micro-batch -> hash) say it reported; None if some do not or are missing.
        Raises PeerFailure or RemoteError when it does not answer."""
        grads = self.calls.ask(peer, GradsRequest(adapter=self.adapter, step=step, wanted=wanted)).grads
        for block, mbs in wanted.items():
            for mb in mbs:
                held = grads.get(block, {}).get(mb)
                if held is None or grad_hash(held) != hashes[block][mb]:
                    return None
        return grads

    def _spot_check(
        self,
        hop: Hop,
        result: T,
        redo: Callable[[PeerID], T],
        rate: float,
        agree: Callable[[T, T, float], bool] | None = None,
    ) -> tuple[T, PeerID]:
        """With probability ``rate``, redo the hop on other replicas; a peer outvoted by two that agree is banned for
        good. Replicas of the hop's numerics class are asked first (they are compared tightly); a result the others'
        numerics cannot judge is never outvoted. Returns the result to use and the peer that produced it.
        ``agree``: whether two results agree within a tolerance (by default: tensors)."""
        if rate <= 0 or self.random.random() >= rate:
            return result, hop.peer_id
        agree = agree or self._agree
        opinions: dict[PeerID, T] = {hop.peer_id: result}
        others = [
            r
            for r in self.router.replicas(hop.start)
            if r.peer_id != hop.peer_id and r.start <= hop.start and hop.end <= r.end
        ]
        if len(others) + 1 < self.min_voters:
            return result, hop.peer_id
        # In random order within each class: checking stops once the replicas asked agree, so a fixed order (the
        # records') would never ask a dishonest peer listed last, unless it computed the hop itself.
        self.random.shuffle(others)
        own = {r.peer_id: r.numerics.key for r in self.router.replicas(hop.start, eligible_only=False)}.get(hop.peer_id)
        others.sort(key=lambda r: r.numerics.key != own)

        def verdict(a: PeerID, b: PeerID) -> bool | None:
            tolerance = self._tolerance(a, b, hop)
            return None if tolerance is None else agree(opinions[a], opinions[b], tolerance)

        majority: list[PeerID] = []
        asking = [r.peer_id for r in others]
        for _ in range(SPOT_CHECK_ROUNDS):  # a replica too slow to answer in time is asked again
            unanswered = []
            for peer in asking:
                try:
                    opinions[peer] = redo(peer)
                except PeerFailure:
                    unanswered.append(peer)
                    continue
                majority = _majority(opinions, verdict)
                if _decided(majority, opinions):
                    break
            if _decided(majority, opinions) or not unanswered:
                break
            asking = unanswered
        if len(majority) < 2:
            if len(opinions) > 1 and len(others) + 1 >= VOTERS:
                # No two agree, and the rest did not answer or cannot be judged: accepting any could take a liar's.
                raise self.calls.peer_failed(
                    hop.peer_id, f"blocks {hop.start}:{hop.end}: a spot check could not decide"
                )
            if len(opinions) > 1:
                logger.warning("replicas of blocks %d:%d disagree and no majority exists", hop.start, hop.end)
            return result, hop.peer_id
        for peer in _outvoted(majority, opinions, verdict):
            self.ban_dishonest(peer, f"its blocks {hop.start}:{hop.end} results disagree with its replicas'")
        chosen = hop.peer_id if hop.peer_id in majority else majority[0]
        return opinions[chosen], chosen

    # --- forward and backward -------------------------------------------------------------------------------

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, step: int, micro_batch: str | None
    ) -> tuple[torch.Tensor, Forwarded]:
        """Through blocks [0, n): along a chain of peers, or hop by hop from the client (``chain=False``, and the
        micro-batches drawn for a spot check, whose every hop is then checked: the same share of hops as
        client-driven checks)."""
        rate = self._check_rate()
        checked = rate > 0 and self.random.random() < rate
        if self.chain and not checked:
            sample = None if micro_batch is None else self._sample_of(hidden, mask)  # an eval's sample: seldom again
            return self._forward_chain(hidden, mask, step, micro_batch, sample)
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
        return self._backward_chain(forwarded, grad, mask, ledger, micro_batch, input_grad)

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
                outputs, chosen = self._spot_check(
                    hop,
                    outputs,
                    lambda peer, h=hop, x=hidden: self._forward_hop(Hop(peer, h.start, h.end), x, mask, step, None),
                    rate,
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
        rate = self._check_rate() if rate is None else rate
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
                    ran, chosen = self._spot_check(
                        hop,
                        ran,
                        lambda peer, h=hop, x=hidden, g=grad_out: self._backward_hop(
                            Hop(peer, h.start, h.end), x, g, mask, ledger, micro_batch
                        ),
                        rate,
                        lambda a, b, tol, h=hop: self._backwards_agree(a, b, tol, h, ledger.step, micro_batch),
                    )
                    ledger.acknowledge(micro_batch, hop.blocks, chosen, ran.hashes)
                    grad = ran.grad_inputs
            except PeerFailure as e:
                prefer = None
                attempts.failed(e, Hop(e.peer, segment.start, segment.end))
                continue
            attempts.succeeded(ledger.step)
            return grad

    def replay(self, micro_batch: str, segment: Segment, mask: torch.Tensor | None, ledger: StepLedger) -> None:
        """Recompute a micro-batch's gradients on a segment the client kept, because some of them died with a peer:
        along a chain when it is the whole stack (the client's link carries its input, output and gradient once),
        else hop by hop. Peers that still hold their gradients keep them: a backward counts once per block."""
        if not self.chain or segment.start != 0 or segment.end != self.router.num_blocks:
            self.backward_segment(segment, mask, ledger, micro_batch, input_grad=False)
            return
        _, forwarded = self._forward_chain(segment.hidden, mask, ledger.step, micro_batch)
        self._backward_chain(forwarded, segment.grad_outputs, mask, ledger, micro_batch, input_grad=False)

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

    def _sample_of(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> str | None:
        """A training micro-batch's identity for delta-coded hops: a hash of the stack's input (the frozen
        embeddings of its tokens) and mask, so that the same tokens in a later epoch find their references. None:
        no deltas. Evaluations send values: a held-out batch comes back rarely, after many steps, when its change
        is no smaller than itself."""
        if self.references is None:
            return None
        digest = hashlib.blake2b(digest_size=16)
        for tensor in (hidden, mask):
            if tensor is not None:
                digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
                digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def _forward_chain(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        step: int,
        micro_batch: str | None,
        sample: str | None = None,
    ) -> tuple[torch.Tensor, Forwarded]:
        """The hidden states go to the first span with the route after it; each peer passes its output on, the last
        answers. Where the chain breaks, the client goes on from the output of the last hop that ran, on a new
        route (through the failed peer itself when the hop before could only not reach it). With a ``sample``,
        hidden states travel as changes since its last pass (swarm.net.deltas)."""
        wire, inputs = self.wire, []
        block, prefer, attempts = 0, None, self.calls.attempts(Method.FORWARD)
        while block < self.router.num_blocks:
            hops = self.wait_route(block, prefer=prefer)
            prefer, first = None, hops[0]
            route = self.route_of(hops[1:], Method.FORWARD, hidden)
            last = hops[-1]
            have = None if sample is None else self.references.digest_of(self._key(sample, last.end, last.peer_id))
            request = ForwardRequest(
                adapter=self.adapter,
                start=first.start,
                end=first.end,
                step=step,
                hidden=self._outgoing(sample, block, wire.cast(hidden), first.peer_id),
                mask=mask,
                micro_batch=micro_batch,
                compression=wire.compression,
                route=route,
                autocast=self.autocast,
                sample=sample,
                have=have,
            )
            try:
                reply, ran = self.chain_ask(hops, request, hidden)
                outputs = self._incoming(request, ran[-1], reply.outputs)
            except PeerFailure as e:
                attempts.failed(e, first)
                continue
            except RemoteError as e:
                if sample is None or e.kind != ErrorKind.MISSING_REFERENCE:
                    raise
                self.references.forget(self._key(sample, block, first.peer_id, sent=True))  # send the value
                continue
            except MissingReferenceError:  # a micro-batch of the same tokens in flight moved the reference on
                self.references.forget(self._key(sample, last.end, last.peer_id))  # ask for the value
                continue
            inputs.append(HopInput(ran[0], hidden))
            inputs.extend(HopInput(hop, None) for hop in ran[1:])
            hidden, block = outputs.to(hidden.dtype), ran[-1].end
            if reply.failure is not None:
                prefer = self.chain_failed(reply.failure, attempts, hops[len(ran)])
        attempts.succeeded(step)
        return hidden, Forwarded(inputs, chained=True, check=0.0)

    def _key(self, sample: str, boundary: int, peer: PeerID, sent: bool = False) -> ReferenceKey:
        """Where a sample's reference is kept: by the peer it was sent to (``sent``) or came from, so that each
        replica has its own."""
        return ReferenceKey(adapter=self.adapter, sample=sample, boundary=boundary, sent=sent, peer=peer.to_base58())

    def _outgoing(self, sample: str | None, boundary: int, hidden: torch.Tensor, to: PeerID) -> torch.Tensor | Delta:
        if sample is None:
            return hidden
        return self.references.encode(self._key(sample, boundary, to, sent=True), hidden, self.wire.delta_bits)[0]

    def _incoming(self, request: ForwardRequest, last: Hop, outputs: torch.Tensor | Delta) -> torch.Tensor:
        """A chain's answer as a tensor: a delta rebuilt from the reference the client holds. A change from a
        reference the request did not name is a lie; one from the reference it named, which the client no longer
        holds, raises MissingReferenceError (the client asks again, for the value)."""
        if not isinstance(outputs, Delta):
            return outputs
        if request.sample is None or (outputs.base is not None and outputs.base != request.have):
            reason = "forward: a delta from a reference the request did not name"
            raise self.calls.peer_failed(last.peer_id, reason)
        value = self.references.decode(self._key(request.sample, last.end, last.peer_id), outputs)
        return value.to(rotated.DTYPES[outputs.dtype])

    def _backward_chain(
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
            route = self.route_of(hops[1:], Method.BACKWARD, grad)
            last = hops[0]
            request = BackwardRequest(
                adapter=self.adapter,
                start=last.start,
                end=last.end,
                step=ledger.step,
                micro_batch=micro_batch,
                grad=self.wire.cast(grad),
                hidden=None,
                mask=mask,
                input_grad=input_grad,
                compression=self.wire.backward_compression,
                route=route,
                autocast=self.autocast,
            )
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
        return self._backward_chain(
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
