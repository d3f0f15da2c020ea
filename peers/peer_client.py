"""The calls a peer makes to other peers: the next hop of a chain, a replica's gradients at commit, a span's state (or
last updates) for a sync, a standby copy or a takeover, and the notice of a commit to the peers keeping copies."""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.p2p import PeerID

from peers.behaviour import Behaviour
from peers.state import BlockState, BlockUpdate, GradsByBlock, unpack_states
from swarm.net.chain import ChainFailure, ChainHop, FailureKind, route_timeout
from swarm.net.errors import PEER_ERRORS, TRANSPORT_ERRORS, RemoteError, ReplyError
from swarm.net.protocol import (
    SUM,
    SYNC_TIMEOUT,
    BackwardRequest,
    CommittedRequest,
    ExportRequest,
    ForwardRequest,
    GradsRequest,
    InferRequest,
    Reply,
)
from swarm.net.reduction import ChunkKey
from swarm.net.transport import Transport


class ChainBroken(Exception):
    """The next hop of a chain did not answer, or refused: the caller answers with its own result and this."""

    def __init__(self, failure: ChainFailure):
        super().__init__(f"{failure.peer}: {failure.kind}: {failure.error}")
        self.failure = failure


logger = logging.getLogger(__name__)


class PeerClient:
    """One peer's calls to the others, over its transport; ``behaviour``: what it does to the gradients it fetches
    (peers/behaviour.py)."""

    def __init__(self, transport: Transport, behaviour: Behaviour | None = None):
        self.transport, self.behaviour = transport, behaviour

    async def pass_on(self, hop: ChainHop, request: ForwardRequest | BackwardRequest | InferRequest) -> Reply:
        """Hand a chained request to its next hop (which passes it on along the request's route) and wait for the
        chain's answer; a hop that refuses, does not answer in time, or cannot be reached raises ChainBroken. The
        client's addresses for the hop are used when this peer has none (a peer behind NAT is then reached through
        its relay)."""
        peer = PeerID.from_base58(hop.peer)
        if hop.maddrs and peer not in self.transport.addresses:
            self.transport.addresses[peer] = list(hop.maddrs)
        timeout = route_timeout([hop, *request.route])
        try:
            return await self.transport.aask(peer, request, timeout, watch=True)
        except RemoteError as e:
            raise ChainBroken(ChainFailure(hop.peer, e.kind, str(e))) from None
        except (asyncio.TimeoutError, TimeoutError) as e:
            reason = str(e) or f"no answer in {timeout:.1f}s"  # frozen (PeerFrozenError), or slower than its timeout
            raise ChainBroken(ChainFailure(hop.peer, FailureKind.TIMEOUT, reason)) from e
        except TRANSPORT_ERRORS as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise ChainBroken(ChainFailure(hop.peer, FailureKind.UNREACHABLE, reason)) from None

    def hint(self, maddrs_by_peer: dict[str, list[str]]) -> None:
        """Take the client's addresses of the peers a request names (a ledger's holders): see ``Transport.hint``."""
        for peer, maddrs in maddrs_by_peer.items():
            self.transport.hint(PeerID.from_base58(peer), maddrs)

    async def fetch_grads(
        self,
        peer: str,
        name: str,
        step: int,
        wanted: dict[int, list[str]],
        timeout: float,
        summed: bool = False,
        chunk: int = 0,
        chunks: int = 0,
    ) -> GradsByBlock:
        """A replica's gradients of the step (``summed``: its partial sum of each block, or one chunk of it with
        ``chunks``: see ``GradsRequest``); a dead or silent replica just yields nothing (the client replays)."""
        request = GradsRequest(adapter=name, step=step, wanted=wanted, summed=summed, chunk=chunk, chunks=chunks)
        try:
            reply = await self.transport.aask(PeerID.from_base58(peer), request, timeout)
        except PEER_ERRORS as e:
            logger.warning("could not fetch gradients from %s: %s", peer, e)
            return {}
        return reply.grads if self.behaviour is None else self.behaviour.fetched_grads(reply.grads)

    async def fetch_chunk(self, reducer: str, key: ChunkKey, wait: float, timeout: float) -> torch.Tensor | None:
        """One chunk of a block's reduced gradient from its reducer (peers/reduction/scatter.py), which waits up to
        ``wait`` seconds while it is still reducing it; None if it has none, fails or is silent."""
        request = GradsRequest(
            adapter=key.adapter,
            step=key.step,
            wanted={},
            summed=True,
            chunk=key.chunk,
            chunks=key.chunks,
            reduced={key.block: key.groups},
            wait=wait,
        )
        try:
            reply = await self.transport.aask(PeerID.from_base58(reducer), request, timeout)
        except PEER_ERRORS as e:
            logger.warning("could not fetch a reduced chunk from %s: %s", reducer, e)
            return None
        sums = reply.grads.get(key.block, {}).get(SUM)
        return sums[0] if sums is not None and len(sums) == 1 else None

    async def fetch_state(self, peer: PeerID, name: str, blocks: range) -> dict[int, BlockState]:
        """The state of ``blocks`` (served or standby) as another peer holds it."""
        states, _ = await self.fetch_state_or_updates(peer, name, blocks, held=None)
        return states

    async def fetch_state_or_updates(
        self,
        peer: PeerID,
        name: str,
        blocks: range,
        held: dict[int, int] | None,
        watcher: PeerID | None = None,
    ) -> tuple[dict[int, BlockState], dict[int, BlockUpdate]]:
        """The state of ``blocks`` as another peer holds it, or, for blocks this peer ``held`` one step behind a
        server, that server's last update (to apply with ``BlockUpdate.apply_to``). A source that stops answering
        altogether (frozen, cut off) is given up within seconds (``PeerFrozenError``), not at ``SYNC_TIMEOUT``: a
        trainer's step waits on the copies made this way. With ``watcher`` (this peer), the source tells it of its
        next commits of these blocks (``peers/pullers.py``)."""
        request = ExportRequest(adapter=name, start=blocks.start, end=blocks.stop, held=held, watcher=watcher)
        reply = await self.transport.aask(peer, request, timeout=SYNC_TIMEOUT, watch=True)
        try:
            states = unpack_states(reply.index, reply.states)
            packed = unpack_states(reply.update_index, reply.updates)
            updates = {
                b: BlockUpdate.from_state(u, reply.hparams[b], reply.bases.get(b, ""), reply.afters.get(b, ""))
                for b, u in packed.items()
            }
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise ReplyError(f"malformed state export from {peer}: {e}") from None
        return states, updates

    async def notify_committed(self, peer: PeerID, notice: CommittedRequest) -> None:
        """Tell a peer keeping standby copies that a step was committed here (best effort: it also looks itself)."""
        try:
            await self.transport.aask(peer, notice, timeout=5.0)
        except PEER_ERRORS as e:
            logger.debug("could not notify %s of a commit: %s", peer, e)
