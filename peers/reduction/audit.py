"""Checking what other holders hand on. Every partial sum (or chunk of one) fetched is checked against the sketches
of its micro-batches handed with it (swarm/net/sketch.py: the sum of the sketches is the sum's sketch); at
``AUDIT_RATE`` one of its micro-batch gradients, drawn at random, is fetched too and must hash as its holder
reported it with its backward and project to its reported sketch. An audit costs one micro-batch gradient of one
block, however many micro-batches the holder ran. A holder caught is refused (``bad_gradients``, naming it) and the
client bans it. A client-driven audited commit (after replicas disagreed) still checks every partial sum against all
its micro-batch gradients, to the bit (``audit_fully``)."""

from __future__ import annotations

import logging
import random
from enum import Enum

import torch

from peers.compute import Compute
from peers.peer_client import PeerClient
from peers.state import GradsByBlock
from swarm.net import sketch
from swarm.net.errors import BadGradientsError
from swarm.net.gradhash import grad_hash
from swarm.net.protocol import SKETCH, CommitRequest, Group, NormsRequest
from swarm.net.reduction import chunk_of, partial_sum, same_bits

logger = logging.getLogger(__name__)

# The share of fetched partial sums (one block of each holder's request) whose sketches a peer audits: one
# micro-batch gradient behind the sum is fetched, drawn at random, checked against its reported hash and projected
# again. A holder that lied on k of its m micro-batches' sketches (as it must, to hand on a wrong sum) is caught by
# one audit with probability k / m.
AUDIT_RATE = 0.25

Partials = dict[int, dict[Group, list[torch.Tensor]]]  # block -> the holder's micro-batches -> its partial sum


class Verdict(Enum):
    """What a check of a holder's partial sums found."""

    PASSED = "passed"
    FAILED = "failed"  # shown wrong: the holder is refused (``bad_gradients``) and the client judges it
    # its micro-batch gradients could not be had (gone, silent, or refusing): the sums are not taken, their
    # micro-batches stay missing and the client replays them elsewhere; a liar cannot pass by staying silent
    UNCHECKED = "unchecked"


class Auditor:
    """Checks of other holders' partial sums; audits drawn at ``rate`` from ``rng`` (which the chunked reduction
    shares, so that one stream of draws decides every audit of a request)."""

    def __init__(self, compute: Compute, peers: PeerClient, rate: float, rng: random.Random) -> None:
        self.compute, self.peers, self.rate, self.random = compute, peers, rate, rng

    async def check(
        self,
        request: CommitRequest | NormsRequest,
        peer: str,
        partials: Partials,
        sketches: dict[int, torch.Tensor],
        audit: bool | None = None,
        chunk: tuple[int, int] | None = None,
    ) -> Verdict:
        """Whether ``peer``'s partial sums (or that ``chunk`` of them: index, count) agree with the sketches of
        their micro-batches (block -> a row per micro-batch, in sorted order); then, with probability ``rate``
        (``audit``: always or never), one micro-batch of one block is audited (``audit_sketch``)."""
        agree = await self.compute(sketches_agree, partials, sketches)
        if agree is not None:
            logger.warning("%s's partial sum of block %d is not the sum of its micro-batches' sketches", peer, agree)
            return Verdict.FAILED
        if not (self.random.random() < self.rate if audit is None else audit):
            return Verdict.PASSED
        block = self.random.choice(sorted(partials))
        ((group, summed),) = partials[block].items()
        index = self.random.randrange(len(group))
        return await self.audit_sketch(request, peer, block, group[index], summed, sketches[block][index], chunk)

    async def audit_sketch(
        self,
        request: CommitRequest | NormsRequest,
        peer: str,
        block: int,
        mb: str,
        summed: list[torch.Tensor],
        reported: torch.Tensor,
        chunk: tuple[int, int] | None,
    ) -> Verdict:
        """Fetch micro-batch ``mb``'s gradient of ``block`` from its holder: it must hash as the holder reported
        with its backward, and its projection (of ``chunk`` of it) with the signs of ``summed`` must be the
        ``reported`` sketch."""
        wanted = {block: [mb]}
        grads = await self.peers.fetch_grads(peer, request.adapter, request.step, wanted, request.fetch_timeout)
        if not grads.get(block):
            logger.warning("audit of %s's partial sum of block %d: its gradient did not come; not taken", peer, block)
            return Verdict.UNCHECKED
        matching, mismatched = await self.compute(as_reported, request, wanted, grads)
        if mismatched or mb not in matching.get(block, {}):
            logger.warning("audit of %s's partial sum of block %d: its gradients are not as it reported", peer, block)
            return Verdict.FAILED
        if await self.compute(projects_to, matching[block][mb], summed, reported, chunk):
            return Verdict.PASSED
        logger.warning("audit of %s's partial sum of block %d: a micro-batch's sketch is not its own", peer, block)
        return Verdict.FAILED

    async def audit_fully(
        self, request: CommitRequest | NormsRequest, peer: str, part: dict[int, list[str]], partials: Partials
    ) -> Verdict:
        """Every block: fetch the micro-batch gradients behind its partial sum from its holder, check them against
        the hashes its acks reported, and check that they add up to the partial sum, to the bit."""
        verdicts = [await self._audit_block(request, peer, part, partials, block) for block in sorted(partials)]
        return min(verdicts, key=[Verdict.FAILED, Verdict.UNCHECKED, Verdict.PASSED].index)

    async def _audit_block(
        self,
        request: CommitRequest | NormsRequest,
        peer: str,
        part: dict[int, list[str]],
        partials: Partials,
        block: int,
    ) -> Verdict:
        wanted = {block: part[block]}
        grads = await self.peers.fetch_grads(peer, request.adapter, request.step, wanted, request.fetch_timeout)
        if not grads.get(block):
            logger.warning("audit of %s's partial sum of block %d: none of its gradients came; not taken", peer, block)
            return Verdict.UNCHECKED
        matching, mismatched = await self.compute(as_reported, request, wanted, grads)
        if mismatched or set(matching.get(block, {})) != set(part[block]):
            logger.warning("audit of %s's partial sum of block %d: its gradients are not as it reported", peer, block)
            return Verdict.FAILED
        ((group, summed),) = partials[block].items()
        recomputed = await self.compute(partial_sum, matching[block], group)
        if same_bits(recomputed, summed):
            return Verdict.PASSED
        logger.warning("audit of %s's partial sum of block %d: not the sum of its reported gradients", peer, block)
        return Verdict.FAILED


def sketches_in(sums: GradsByBlock) -> dict[int, torch.Tensor]:
    """The sketches a holder handed beside its partial sums (block -> a row per micro-batch); a block whose reply
    has none, or more than one tensor there, is left out (and so fails its check)."""
    return {block: by_key[SKETCH][0] for block, by_key in sums.items() if len(by_key.get(SKETCH, ())) == 1}


def sketches_agree(partials: Partials, sketches: dict[int, torch.Tensor]) -> int | None:
    """The first block whose partial sum is not the sum of its micro-batches' sketches (or has none, or a row per
    micro-batch missing), or None. On the compute thread: it reads the tensors."""
    for block, by_group in sorted(partials.items()):
        ((group, summed),) = by_group.items()
        reported = sketches.get(block)
        if reported is None or tuple(reported.shape) != (len(group), sketch.ROWS):
            return block
        vector = sketch.flat(summed)
        own = sketch.sketches([vector], sketch.seed_of(summed))[0]
        if not sketch.sum_agrees(own, reported.to(own), summed[0].dtype):
            return block
    return None


def projects_to(
    grads: list[torch.Tensor], summed: list[torch.Tensor], reported: torch.Tensor, chunk: tuple[int, int] | None
) -> bool:
    """Whether one micro-batch's gradient (``chunk`` of it) projects, with the signs of ``summed``, to
    ``reported``."""
    vector = chunk_of(grads, *chunk) if chunk is not None else sketch.flat(grads)
    return sketch.are_sketches(reported.unsqueeze(0), [vector], summed)


def as_reported(
    request: CommitRequest | NormsRequest, wanted: dict[int, list[str]], grads: GradsByBlock
) -> tuple[GradsByBlock, bool]:
    """The fetched gradients that were asked for (``wanted``) and hash as the ledger says their holder reported
    (every one, when the ledger has no hash for it), and whether any did not. On the compute thread: hashing reads
    the tensors."""
    good: GradsByBlock = {}
    mismatched = False
    for block, by_mb in grads.items():
        for mb, tensors in by_mb.items():
            if mb not in wanted.get(block, ()):
                continue
            expected = request.ledger[block][mb].grad_hash
            if expected is None or grad_hash(tensors) == expected:
                good.setdefault(block, {})[mb] = tensors
            else:
                mismatched = True
    return good, mismatched


def bad_gradients(step: int, bad: list[str]) -> BadGradientsError:
    logger.warning("gradients of step %d from %s do not match the hashes they reported", step, bad)
    return BadGradientsError(
        f"the gradients of step {step} fetched from {', '.join(bad)} do not match the hashes those peers reported "
        "with their backwards; nothing was applied: replay their micro-batches elsewhere",
        bad,
    )
