"""Whom the client trusts: spot checks that redo a hop on other replicas and ban a peer two agreeing replicas
outvote, the peers banned so far, and the checks that a holder hands gradients and partial sums on as it reported
them. The hops (swarm/client/remote.py) and the commit (swarm/client/commit.py) ask it; it asks peers through the
adapter's calls."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import TypeVar

import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerCalls, PeerFailure
from swarm.client.routing import Hop
from swarm.net import sketch
from swarm.net.errors import RemoteError
from swarm.net.gradhash import grad_hash
from swarm.net.numerics import tolerance
from swarm.net.protocol import SKETCH, SUM, GradsRequest
from swarm.net.reduction import partial_sum, same_bits

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Spot checks by default, in a public swarm (no swarm key): this share of micro-batches is also computed on other
# replicas, hop by hop, wherever a span has VOTERS replicas (two that agree outvote a third). Its cost per step is
# measured by scripts/bench_step.py --spot-check (BENCHMARKS.md); a private swarm checks nothing unless asked.
PUBLIC_SPOT_CHECK = 0.03
VOTERS = 3
SPOT_CHECK_ROUNDS = 3  # times a spot check asks a replica that did not answer in time

Verdict = Callable[[PeerID, PeerID], bool | None]  # two replicas' results agree, disagree, or cannot be told


def spot_check_policy(requested: float | None, private: bool) -> tuple[float, int]:
    """(rate, replicas a hop needs to be checked). A rate given is used wherever a hop has another replica; none
    given: PUBLIC_SPOT_CHECK where a vote can decide in a public swarm, nothing in a private one."""
    if requested is not None:
        if not 0.0 <= requested <= 1.0:
            raise ValueError(f"spot_check is a fraction of micro-batches, from 0 to 1; got {requested}")
        return requested, 2
    return (0.0 if private else PUBLIC_SPOT_CHECK), VOTERS


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


def agree(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Within ``tolerance``, relative to the larger of the two largest magnitudes (swarm/net/numerics.py)."""
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-6)
    return a.shape == b.shape and (a - b).abs().max().item() <= tolerance * scale


class Trust:
    """Spot checks at ``spot_check`` of the micro-batches wherever a hop has ``min_voters`` replicas (itself
    included), and the peers caught lying (``dishonest``), never routed to or committed on again."""

    def __init__(self, calls: PeerCalls, spot_check: float = 0.0, min_voters: int = 2):
        self.calls, self.router, self.adapter = calls, calls.router, calls.adapter
        self.spot_check, self.min_voters = spot_check, min_voters
        self.dishonest: list[PeerID] = []
        self.random = random.Random()

    def ban_dishonest(self, peer: PeerID, reason: str) -> None:
        """``peer`` was caught (a spot check, the commit's vote, gradients that do not match their hash): never route
        to it or commit on it again, nor count it as a replica."""
        if peer in self.dishonest:
            return
        self.router.distrust(peer, reason)
        self.dishonest.append(peer)
        self.calls.current.forget(peer)

    def rate(self) -> float:
        """The spot-check rate now: none while no block has enough replicas to be checked (a checked micro-batch,
        and the input gradients a check compares, would only cost)."""
        if self.spot_check <= 0:
            return 0.0
        blocks = range(self.router.num_blocks)
        return self.spot_check if any(len(self.router.replicas(b)) >= self.min_voters for b in blocks) else 0.0

    def drawn(self, rate: float) -> bool:
        """Whether this micro-batch (or hop) is one of the ``rate`` checked."""
        return rate > 0 and self.random.random() < rate

    def tolerance(self, a: PeerID, b: PeerID, hop: Hop, autocast: str | None) -> float | None:
        """How far two replicas' honest results of ``hop`` may differ, from the numerics their records announce;
        None where that cannot be told (numerics too coarse, or a record gone)."""
        announced = {r.peer_id: r.numerics for r in self.router.replicas(hop.start, eligible_only=False)}
        if a not in announced or b not in announced:
            return None
        return tolerance(announced[a], announced[b], hop.blocks, autocast)

    def check(
        self,
        hop: Hop,
        result: T,
        redo: Callable[[PeerID], T],
        rate: float,
        same: Callable[[T, T, float], bool] = agree,
        autocast: str | None = None,
    ) -> tuple[T, PeerID]:
        """With probability ``rate``, redo the hop on other replicas; a peer outvoted by two that agree is banned for
        good. Replicas of the hop's numerics class are asked first (they are compared tightly); a result the others'
        numerics cannot judge is never outvoted. Returns the result to use and the peer that produced it.
        ``same``: whether two results agree within a tolerance (by default: tensors)."""
        if not self.drawn(rate):
            return result, hop.peer_id
        others = self._checkers(hop)
        if len(others) + 1 < self.min_voters:
            return result, hop.peer_id
        opinions: dict[PeerID, T] = {hop.peer_id: result}

        def verdict(a: PeerID, b: PeerID) -> bool | None:
            tolerance = self.tolerance(a, b, hop, autocast)
            return None if tolerance is None else same(opinions[a], opinions[b], tolerance)

        majority = self._ask(others, opinions, redo, verdict)
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

    def _checkers(self, hop: Hop) -> list[PeerID]:
        """The other replicas of the hop, those of its numerics class first, each class in random order: checking
        stops once the replicas asked agree, so a fixed order (the records') would never ask a dishonest peer
        listed last, unless it computed the hop itself."""
        others = [
            r
            for r in self.router.replicas(hop.start)
            if r.peer_id != hop.peer_id and r.start <= hop.start and hop.end <= r.end
        ]
        self.random.shuffle(others)
        own = {r.peer_id: r.numerics.key for r in self.router.replicas(hop.start, eligible_only=False)}.get(hop.peer_id)
        others.sort(key=lambda r: r.numerics.key != own)
        return [r.peer_id for r in others]

    @staticmethod
    def _ask(asking: list[PeerID], opinions: dict[PeerID, T], redo: Callable[[PeerID], T], verdict: Verdict) -> list:
        """Ask replicas in turn, each that did not answer in time again (up to SPOT_CHECK_ROUNDS), until a majority
        decides; fills ``opinions`` and returns the majority (empty if none)."""
        majority: list[PeerID] = []
        for _ in range(SPOT_CHECK_ROUNDS):
            unanswered = []
            for peer in asking:
                try:
                    opinions[peer] = redo(peer)
                except PeerFailure:
                    unanswered.append(peer)
                    continue
                majority = _majority(opinions, verdict)
                if _decided(majority, opinions):
                    return majority
            if not unanswered:
                break
            asking = unanswered
        return majority

    def backwards_agree(self, a, b, tolerance: float, hop: Hop, step: int, micro_batch: str) -> bool:
        """Two replicas' backwards of a hop (``BackwardResult``s) agree: their input gradients within ``tolerance``,
        and their LoRA gradients bit for bit (equal hashes) or, where the hashes differ (other kernels or numerics),
        within it as each holder hands them on (checked against the hashes it reported)."""
        if a.grad_inputs is None or b.grad_inputs is None or not agree(a.grad_inputs, b.grad_inputs, tolerance):
            return False
        if a.hashes == b.hashes:
            return True
        grads_a = self._reported_grads(a, hop, step, micro_batch)
        grads_b = self._reported_grads(b, hop, step, micro_batch)
        if grads_a is None or grads_b is None or len(grads_a) != len(grads_b):
            return False
        pairs = zip(grads_a, grads_b, strict=True)
        return all(x.shape == y.shape and (x.numel() == 0 or agree(x, y, tolerance)) for x, y in pairs)

    def _reported_grads(self, result, hop: Hop, step: int, micro_batch: str) -> list[torch.Tensor] | None:
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
        ``reported_grads``) and, per block, a partial sum that is theirs to the bit (swarm/net/reduction.py) with
        their sketches beside it (swarm/net/sketch.py). Raises PeerFailure or RemoteError when it does not answer."""
        grads = self.reported_grads(peer, step, wanted, hashes)
        if grads is None:
            return False
        sums = self.calls.ask(peer, GradsRequest(adapter=self.adapter, step=step, wanted=wanted, summed=True)).grads
        for block, mbs in wanted.items():
            summed, sketches = sums.get(block, {}).get(SUM, []), sums.get(block, {}).get(SKETCH, [])
            if not same_bits(summed, partial_sum(grads[block], tuple(mbs))) or len(sketches) != 1:
                return False
            vectors = [sketch.flat(grads[block][mb]) for mb in sorted(mbs)]
            if not sketch.are_sketches(sketches[0], vectors, summed):
                return False
        return True

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
