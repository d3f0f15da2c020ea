"""The reduction as the service calls it: before a commit or a norms request, the partial sums this peer lacks
fetched from their holders (in chunks where a block has enough reducers, peers/reduction/scatter.py; else directly,
one per holder and block) and audited; for a tie-break, the micro-batch gradients themselves, checked against their
hashes; and what this peer hands the others (``GRADS``). ARCHITECTURE.md "One reduction per step"."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import torch

from peers.adapters import AdapterStore
from peers.compute import Compute
from peers.peer_client import PeerClient
from peers.reduction.audit import Auditor, Partials, Verdict, as_reported, bad_gradients, sketches_in
from peers.reduction.held import HeldGradients
from peers.reduction.scatter import ChunkedReduction
from peers.state import GradsByBlock
from peers.stepphase import StepPhases
from swarm.net.errors import RequestError
from swarm.net.protocol import SUM, CommitRequest, GradsRequest, NormsRequest
from swarm.net.reduction import ChunkKey


class Reduction:
    """One peer's part in every step's reduction, made with the peer's collaborators: its store of adapters, the
    compute thread it runs them on, the client it calls other peers with, and the phases it moves blocks through."""

    def __init__(
        self,
        me: Callable[[], str],
        adapters: AdapterStore,
        compute: Compute,
        peers: PeerClient,
        phases: StepPhases,
        audit_rate: float,
        rng: random.Random,
    ) -> None:
        """``me``: this peer's id (known once its service is registered)."""
        self.whoami, self.adapters, self.compute, self.peers, self.phases = me, adapters, compute, peers, phases
        self.held = HeldGradients(adapters)
        self.auditor = Auditor(compute, peers, audit_rate, rng)
        self.chunked = ChunkedReduction(me, self.held, compute, peers, self.auditor, phases)

    async def fetch_missing(self, request: CommitRequest | NormsRequest) -> None:
        """Fetch the partial sums of the ledger's other holders this peer lacks, one per holder and block, all at
        once (ARCHITECTURE.md "One reduction per step"); this peer's own gradients of micro-batches held elsewhere
        (a retried backward) it drops where they hash otherwise, so that a group it can sum itself is the holder's
        bits. A holder whose partial sum fails an audit is refused (``bad_gradients``, naming it)."""
        me = self.whoami()
        name, step = request.adapter, request.step
        self.peers.hint({p: m for p, m in request.holder_maddrs.items() if p != me})
        others = {
            block: {mb: held.grad_hash for mb, held in by_mb.items() if held.holder != me and held.grad_hash}
            for block, by_mb in request.ledger.items()
        }
        await self.compute(self.held.drop_unlike, name, step, others)
        groups = request.groups()
        if request.audit:
            await self.compute(self.held.drop_partials, name, step)
            self.phases.dropped(name, groups, step)
        else:
            bad = await self.chunked.run(request, groups)
            if bad:
                raise bad_gradients(step, bad)
        missing = await self.compute(self.held.missing, name, step, groups)
        wanted_from: dict[str, dict[int, list[str]]] = {}
        for block, mbs in missing.items():
            for group in {group for group in groups[block] if set(group) & set(mbs)}:
                holder = request.ledger[block][group[0]].holder
                if holder != me:
                    wanted_from.setdefault(holder, {})[block] = list(group)
        fetch = self.peers.fetch_grads
        fetched = await asyncio.gather(
            *(fetch(peer, name, step, part, request.fetch_timeout, summed=True) for peer, part in wanted_from.items())
        )
        bad = []
        for (peer, part), sums in zip(wanted_from.items(), fetched, strict=True):
            partials = {block: {tuple(part[block]): by_key[SUM]} for block, by_key in sums.items() if SUM in by_key}
            verdict = await self._checked(request, peer, part, partials, sketches_in(sums)) if partials else None
            if verdict is Verdict.FAILED:
                bad.append(peer)
            if verdict is not Verdict.PASSED:
                continue  # unchecked sums are not taken: their micro-batches stay missing (the client replays them)
            await self.compute(self.held.add_partials, name, step, partials)
            self.phases.fetched(name, partials, step)
        if bad:
            raise bad_gradients(step, bad)

    async def _checked(
        self,
        request: CommitRequest | NormsRequest,
        peer: str,
        part: dict[int, list[str]],
        partials: Partials,
        sketches: dict[int, torch.Tensor],
    ) -> Verdict:
        """A holder's fetched partial sums checked against their sketches (and at times audited), or, in a commit
        the client audits, every one against all its micro-batch gradients."""
        if request.audit:
            return await self.auditor.audit_fully(request, peer, part, partials)
        return await self.auditor.check(request, peer, partials, sketches)

    async def checked_grads(self, request: CommitRequest) -> GradsByBlock:
        """Every micro-batch gradient of the ledger from its holder, all at once, each checked against the hash its
        holder reported; a holder whose gradients do not hash so is refused (``bad_gradients``, naming it)."""
        wanted_from: dict[str, dict[int, list[str]]] = {}
        for block, mbs in request.micro_batches().items():
            for mb in mbs:
                wanted_from.setdefault(request.ledger[block][mb].holder, {}).setdefault(block, []).append(mb)
        name, step, timeout = request.adapter, request.step, request.fetch_timeout
        me = self.whoami()
        self.peers.hint({p: m for p, m in request.holder_maddrs.items() if p != me})
        fetched = await asyncio.gather(
            *(self.peers.fetch_grads(peer, name, step, part, timeout) for peer, part in wanted_from.items())
        )
        good: GradsByBlock = {}
        bad = []
        for (peer, part), grads in zip(wanted_from.items(), fetched, strict=True):
            matching, mismatched = await self.compute(as_reported, request, part, grads)
            for block, by_mb in matching.items():
                good.setdefault(block, {}).update(by_mb)
            if mismatched:
                bad.append(peer)
        if bad:
            raise bad_gradients(step, bad)
        return good

    async def serve(self, request: GradsRequest) -> GradsByBlock:
        """What another replica asks of this peer's gradients of a step: chunks of reduced gradients this peer
        reduces, its partial sums (or chunks of them), or micro-batch gradients."""
        name, step = request.adapter, request.step
        if request.reduced:
            return await self._reduced_chunks(request)
        if request.summed:
            sums = self.held.partial_sums
            return await self.compute(sums, name, step, request.wanted, request.chunk, request.chunks)
        return await self.compute(self.held.micro_batch_grads, name, step, request.wanted)

    async def _reduced_chunks(self, request: GradsRequest) -> GradsByBlock:
        """The asked chunk of each block's reduced gradient that this peer reduces (peers/reduction/scatter.py)."""
        if not request.chunks:
            raise RequestError("a reduced chunk is asked with 'chunks' > 0")
        found: GradsByBlock = {}
        deadline = time.monotonic() + request.wait  # one wait for the whole request, however many blocks it names
        for block, digest in request.reduced.items():
            key = ChunkKey(request.adapter, request.step, block, digest, request.chunk, request.chunks)
            reduced = await self.chunked.serve(key, max(0.0, deadline - time.monotonic()))
            if reduced is not None:
                found[block] = {SUM: [reduced]}
        return found if self.adapters.behaviour is None else self.adapters.behaviour.reduced_chunks(found)
