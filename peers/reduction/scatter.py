"""A block committed on three or more replicas reduces its step's gradient in chunks (a reduce-scatter, then an
all-gather): the k-th of the replicas the client names (``reducers``, sorted) reduces chunk k, fetching only that
chunk of each holder's partial sum, and every replica gathers the reduced chunks from their reducers. Each peer
moves 2(R-1)/R of the block's gradient each way instead of the direct exchange's R-1 (1.33 G instead of 2 G at
R = 3), in two rounds instead of one; the bits are the direct exchange's (a sum is elementwise). Anything that
fails (a reducer gone, slow, or caught by an audit) leaves the block to the direct exchange
(peers/reduction/exchange.py ``Reduction.fetch_missing``). ARCHITECTURE.md "One reduction per step"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from peers.compute import Compute
from peers.peer_client import PeerClient
from peers.reduction.audit import AUDIT_RATE, Auditor, Verdict, sketches_in
from peers.reduction.held import HeldGradients
from peers.stepphase import StepPhases
from swarm.net.errors import RequestError
from swarm.net.protocol import SUM, CommitRequest, Group, NormsRequest
from swarm.net.reduction import MIN_REDUCERS, ChunkKey, add_chunks, chunk_of, groups_digest, same_bits

logger = logging.getLogger(__name__)

MAX_WAITING = 4096  # chunks asked for before this peer reduced them, at most (asks beyond it are answered "none")
KEPT_STEPS = 2  # a reducer keeps its chunks for replicas that commit late, this many steps back
# the share of requests in which a gathering replica checks one reducer's chunk against its parts (R - 1 chunks of
# partial sums), at the peer's default audit rate (scaled with it)
REDUCER_CHECK_RATE = 0.05


class Chunk(NamedTuple):
    """One chunk of one block's reduction, as a commit or norms request asks for it."""

    request: CommitRequest | NormsRequest
    block: int
    groups: list[Group]
    chunk: int
    chunks: int

    def key(self) -> ChunkKey:
        return ChunkKey(
            self.request.adapter, self.request.step, self.block, groups_digest(self.groups), self.chunk, self.chunks
        )


class ChunkBoard:
    """The chunks this peer reduced, posted for the block's other replicas, who may ask before it is done."""

    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, asyncio.Future] = {}
        self._newest: dict[str, int] = {}

    def __len__(self) -> int:
        """Chunks posted and asks waiting, held now."""
        return len(self._chunks)

    def _future(self, key: ChunkKey, create: bool) -> asyncio.Future | None:
        future = self._chunks.get(key)
        if future is None and (create or len(self._chunks) < MAX_WAITING):
            future = self._chunks[key] = asyncio.get_running_loop().create_future()
        return future

    def post(self, key: ChunkKey, chunk: torch.Tensor | None) -> None:
        """This peer's reduced chunk (None: it could not reduce it); chunks of steps long past are forgotten."""
        future = self._future(key, create=True)
        if not future.done():
            future.set_result(chunk)
        newest = self._newest[key.adapter] = max(self._newest.get(key.adapter, key.step), key.step)
        for old in [k for k in self._chunks if k.adapter == key.adapter and k.step < newest - KEPT_STEPS]:
            self._chunks.pop(old).cancel()

    async def take(self, key: ChunkKey, wait: float) -> torch.Tensor | None:
        """The chunk once it is posted, waiting at most ``wait`` seconds; None if it is not by then."""
        future = self._future(key, create=False)
        if future is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait)
        except (TimeoutError, asyncio.CancelledError):
            return None


class ChunkedReduction:
    """One peer's part in chunked reductions: reduce its chunks, gather the others'."""

    def __init__(
        self,
        me: Callable[[], str],
        held: HeldGradients,
        compute: Compute,
        peers: PeerClient,
        auditor: Auditor,
        phases: StepPhases,
    ) -> None:
        """``auditor``: the audits of the direct exchange, whose rate and random draws these share."""
        self.whoami, self.held, self.compute, self.peers = me, held, compute, peers
        self.auditor, self.audit_rate, self.random = auditor, auditor.rate, auditor.random
        self.check_rate = REDUCER_CHECK_RATE * auditor.rate / AUDIT_RATE  # a reducer's chunk is checked at this rate
        self.phases = phases  # a gathered block's step is reduced
        self.board = ChunkBoard()
        self.distrusted: set[str] = set()  # reducers whose chunk failed an audit here: their blocks go direct
        self.gathered = 0  # block gradients gathered in chunks (the rest went the direct way)

    @property
    def me(self) -> str:
        """This peer's id (known once its service is registered)."""
        return self.whoami()

    async def run(self, request: CommitRequest | NormsRequest, groups: dict[int, list[Group]]) -> list[str]:
        """Reduce this peer's chunks of the ledger's blocks with enough reducers and, at the same time, gather
        every chunk of those whose gradient this peer lacks (but from no reducer it distrusts: those blocks go the
        direct way). Returns the holders whose partial sum failed an audit."""
        name, step = request.adapter, request.step
        at_step = await self.compute(self.held.blocks_at, name, step, groups)
        plan = {block: request.reducers.get(block, []) for block in at_step}
        plan = {block: rs for block, rs in plan.items() if len(rs) >= MIN_REDUCERS}
        if not plan:
            return []
        trusted = [block for block, rs in plan.items() if not self.distrusted.intersection(rs)]
        lacking = await self.compute(self.held.missing, name, step, {block: groups[block] for block in trusted})
        reducing = [block for block, rs in plan.items() if self.me in rs]
        audited = self._audited(request, reducing)
        checked = self.random.choice(sorted(lacking)) if lacking and self.random.random() < self.check_rate else None
        bad: list[str] = []
        await asyncio.gather(
            *(
                self._reduce(
                    Chunk(request, block, groups[block], plan[block].index(self.me), len(plan[block])), bad, audited
                )
                for block in reducing
            ),
            *(self._gather(request, block, groups[block], plan[block], block == checked) for block in lacking),
        )
        return bad

    def _audited(self, request: CommitRequest | NormsRequest, blocks: list[int]) -> dict[str, int]:
        """The holders whose part this peer audits in this request, each on one block drawn at random: each other
        holder with probability ``audit_rate``, as the direct exchange audits the partial sums it fetches (an audit
        fetches one micro-batch gradient behind one block's part: peers/reduction/audit.py)."""
        by_holder: dict[str, list[int]] = {}
        for block in blocks:
            for holder in sorted({held.holder for held in request.ledger[block].values()} - {self.me}):
                by_holder.setdefault(holder, []).append(block)
        return {
            holder: self.random.choice(held)
            for holder, held in sorted(by_holder.items())
            if self.random.random() < self.audit_rate
        }

    async def _reduce(self, job: Chunk, bad: list[str], audited: dict[str, int]) -> None:
        """Reduce the chunk: this peer's parts, and the others' fetched from their holders (those ``audited`` on this
        block audited); posted, or None posted if some part could not be had."""
        request, block, groups, chunk, n = job
        reduced = None
        try:
            gathered = await self.compute(self.held.gathered, request.adapter, request.step, block, groups)
            if gathered is not None:
                reduced = await self.compute(chunk_of, gathered, chunk, n)
            else:
                parts = await self.parts(job, bad, audited)
                reduced = None if parts is None else await self.compute(add_chunks, parts)
        finally:
            self.board.post(job.key(), reduced)

    async def parts(self, job: Chunk, bad: list[str], audited: dict[str, int]) -> list[torch.Tensor] | None:
        """The chunk of each group's partial sum, in order: made here where this peer can, else fetched from the
        group's holder and checked against its sketches, audited if ``audited`` names the holder with this block (a
        holder that fails is added to ``bad``). None if some holder did not answer or failed."""
        request, block, groups, chunk, n = job
        name, step = request.adapter, request.step
        parts = await self.compute(self.held.chunk_parts, name, step, block, groups, chunk, n)
        lacking = [i for i, part in enumerate(parts) if part is None]
        holders = [request.ledger[block][groups[i][0]].holder for i in lacking]
        fetched = await asyncio.gather(
            *(
                self.peers.fetch_grads(
                    holder, name, step, {block: list(groups[i])}, request.fetch_timeout, True, chunk, n
                )
                for i, holder in zip(lacking, holders, strict=True)
            )
        )
        for i, holder, got in zip(lacking, holders, fetched, strict=True):
            sums = got.get(block, {}).get(SUM)
            if sums is None or len(sums) != 1:
                return None
            partials = {block: {groups[i]: sums}}
            audit = audited.get(holder) == block
            verdict = await self.auditor.check(request, holder, partials, sketches_in(got), audit, (chunk, n))
            if verdict is Verdict.FAILED:
                bad.append(holder)
            if verdict is not Verdict.PASSED:
                return None
            parts[i] = sums[0]
        return parts

    async def _gather(
        self, request: CommitRequest | NormsRequest, block: int, groups: list[Group], rs: list[str], check: bool
    ) -> None:
        """Every chunk of the block from its reducer (this peer's own from the board); the whole reduced gradient
        kept for the commit. With ``check`` (one block a request, at ``check_rate``), one chunk of another
        reducer's is audited: its parts fetched from their holders and added up here; a reducer whose chunk is not
        their sum is distrusted by this peer (its blocks go the direct way) and named in the log. Any chunk
        missing: nothing kept (the direct exchange)."""
        n = len(rs)
        wait, timeout = request.fetch_timeout, 2 * request.fetch_timeout

        async def one(chunk: int, reducer: str) -> torch.Tensor | None:
            key = Chunk(request, block, groups, chunk, n).key()
            if reducer == self.me:
                return await self.board.take(key, wait)
            return await self.peers.fetch_chunk(reducer, key, wait, timeout)

        chunks = await asyncio.gather(*(one(chunk, reducer) for chunk, reducer in enumerate(rs)))
        if any(chunk is None for chunk in chunks):
            return
        others = [chunk for chunk, reducer in enumerate(rs) if reducer != self.me]
        if others and check:
            chunk = self.random.choice(others)
            parts = await self.parts(Chunk(request, block, groups, chunk, n), [], {})
            if parts is not None and not same_bits([await self.compute(add_chunks, parts)], [chunks[chunk]]):
                logger.warning(
                    "audit of %s's reduced chunk %d/%d of block %d (step %d): not the sum of its parts; reducing its "
                    "blocks without it from now on",
                    rs[chunk],
                    chunk,
                    n,
                    block,
                    request.step,
                )
                self.distrusted.add(rs[chunk])
                return
        try:
            await self.compute(self.held.set_gathered, request.adapter, request.step, block, groups, chunks)
        except RequestError as e:  # a chunk of the wrong size or with non-finite values: this block goes direct
            logger.warning("the reduced chunks of block %d (step %d) from %s: %s", block, request.step, rs, e)
            return
        self.phases.gathered(request.adapter, [block], request.step)
        self.gathered += 1

    async def serve(self, key: ChunkKey, wait: float) -> torch.Tensor | None:
        """A reduced chunk this peer reduces, for another replica (waited for while it is being reduced)."""
        return await self.board.take(key, wait)
