"""Checking what other holders hand on: fetched micro-batch gradients against the hashes their holder reported with
its backwards, and (at ``AUDIT_RATE``) a fetched partial sum, or a chunk of one, against the sum of those gradients,
to the bit. A holder caught is refused (``bad_gradients``, naming it) and the client bans it."""

from __future__ import annotations

import logging
import random

import torch

from peers.compute import Compute
from peers.peer_client import PeerClient
from peers.state import GradsByBlock
from swarm.net.errors import BadGradientsError
from swarm.net.gradhash import grad_hash
from swarm.net.protocol import CommitRequest, Group, NormsRequest
from swarm.net.reduction import chunk_of, partial_sum, same_bits

logger = logging.getLogger(__name__)

# The share of fetched partial sums a peer audits: the micro-batch gradients behind one block's sum are fetched too,
# checked against their reported hashes and added up again. An audit costs the holder's share of the step's gradients
# for that block, once; a holder caught lying is refused and named (``bad_gradients``), and the client bans it.
AUDIT_RATE = 0.05


class Auditor:
    """Audits of other holders' partial sums, drawn at ``rate`` from ``rng`` (which the chunked reduction shares, so
    that one stream of draws decides every audit of a request)."""

    def __init__(self, compute: Compute, peers: PeerClient, rate: float, rng: random.Random) -> None:
        self.compute, self.peers, self.rate, self.random = compute, peers, rate, rng

    async def audit(
        self,
        request: CommitRequest | NormsRequest,
        peer: str,
        part: dict[int, list[str]],
        partials: dict[int, dict[Group, list[torch.Tensor]]],
        always: bool = False,
        chunk: tuple[int, int] | None = None,
    ) -> bool:
        """With probability ``rate`` (``always``: every block): fetch the micro-batch gradients behind a block's
        partial sum (or that ``chunk`` of it: index, count) from its holder, check them against the hashes its acks
        reported, and check that they add up to the partial sum, to the bit. A holder that sends a partial sum other
        than the sum of what it reported fails."""
        if not always and self.random.random() >= self.rate:
            return True
        blocks = sorted(partials) if always else [self.random.choice(sorted(partials))]
        return all([await self._audit_block(request, peer, part, partials, block, chunk) for block in blocks])

    async def _audit_block(
        self,
        request: CommitRequest | NormsRequest,
        peer: str,
        part: dict[int, list[str]],
        partials: dict[int, dict[Group, list[torch.Tensor]]],
        block: int,
        chunk: tuple[int, int] | None,
    ) -> bool:
        wanted = {block: part[block]}
        grads = await self.peers.fetch_grads(peer, request.adapter, request.step, wanted, request.fetch_timeout)
        if not grads:
            return True  # gone meanwhile (or silent): not proven wrong; its micro-batches are replayed if need be
        matching, mismatched = await self.compute(as_reported, request, wanted, grads)
        if mismatched or set(matching.get(block, {})) != set(part[block]):
            logger.warning("audit of %s's partial sum of block %d: its gradients are not as it reported", peer, block)
            return False
        ((group, summed),) = partials[block].items()
        recomputed = await self.compute(partial_sum, matching[block], group)
        if chunk is not None:
            recomputed = [chunk_of(recomputed, *chunk)]
        if same_bits(recomputed, summed):
            return True
        logger.warning("audit of %s's partial sum of block %d: not the sum of its reported gradients", peer, block)
        return False


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
