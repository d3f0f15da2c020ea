"""The service's handlers that move an adapter's state between peers: ``export`` (this peer's state, or the last
update of blocks the asker holds one step behind), ``sync`` (a current replica's state pulled so that this peer can
serve its blocks again, its updates checked against the state they must give), ``fast_forward`` (the newest
surviving state declared current) and ``state`` (the LoRA tensors, for the client's peft export). The store's side of
each is peers/transfer.py, run on the compute thread."""

from __future__ import annotations

import logging

from hivemind.p2p import PeerID

from peers.adapters import AdapterStore
from peers.compute import Compute
from peers.peer_client import PeerClient
from peers.pullers import RecentPullers
from peers.state import BlockState, BlockUpdate, pack_states
from peers.stepphase import StepPhases
from peers.transfer import StateTransfer
from swarm.net.errors import PEER_ERRORS, RequestError, SourceUnavailableError
from swarm.net.protocol import (
    ExportReply,
    ExportRequest,
    FastForwardReply,
    FastForwardRequest,
    StateReply,
    StateRequest,
    StepsReply,
    SyncRequest,
)

logger = logging.getLogger(__name__)


class StateSync:
    """Adapter state in and out of this peer on request, made with the peer's store, the compute thread it runs on,
    the client it pulls state with, the peers told of its commits (``pullers``) and where each block's step stands
    (``phases``)."""

    def __init__(
        self,
        adapters: AdapterStore,
        compute: Compute,
        peers: PeerClient,
        pullers: RecentPullers,
        phases: StepPhases,
    ) -> None:
        self.adapters, self.compute, self.peers, self.pullers, self.phases = adapters, compute, peers, pullers, phases
        self.transfer = StateTransfer(adapters)

    async def export(self, request: ExportRequest) -> ExportReply:
        """State of blocks; with ``held`` (block -> the step of the asker's copy), the last update of served blocks
        held one step behind instead of their whole state. A ``watcher`` is told of the next commits here."""
        states, updates = await self.compute(self.transfer.export_state, request.adapter, request.blocks, request.held)
        if request.watcher is not None:
            self.pullers.note(request.watcher, request.blocks)
        index, flat = pack_states(states)
        update_index, update_flat = pack_states({block: u.as_state() for block, u in updates.items()})
        return ExportReply(
            index=index,
            update_index=update_index,
            hparams={block: u.hparams for block, u in updates.items()},
            bases={block: u.base for block, u in updates.items() if u.base},
            afters={block: u.after for block, u in updates.items() if u.after},
            states=flat,
            updates=update_flat,
        )

    async def sync(self, request: SyncRequest) -> StepsReply:
        """Pull the adapter state of some blocks from a current replica, so this peer can serve them again. Blocks
        held here one step behind take the replica's last update instead, applied here and checked against the
        replica's state (``StateTransfer.apply_updates``): a replica cannot hand on what it altered outside a step
        (a liar that served a span first would otherwise seed every replica that joins it). Blocks further behind,
        or whose state here is not the replica's at the step before, take its state."""
        name, blocks, source = request.adapter, request.blocks, request.source
        served = await self.compute(lambda: self.adapters.adapter(name).steps())
        states, updates = await self._fetch_from(source, name, blocks, {b: served[b] for b in blocks if b in served})
        advanced = await self.compute(self.transfer.apply_updates, name, updates, dict.fromkeys(updates, source))
        unfit = [block for block in updates if block not in advanced]
        if unfit:  # the state here is not the source's at the step before: take its state, if its update gives it
            more, _ = await self._fetch_from(source, name, range(min(unfit), max(unfit) + 1), None)
            explained = [block for block in unfit if block in more and updates[block].explains(more[block])]
            states.update({block: more[block] for block in explained})
            altered = {block: updates[block] for block in unfit if block not in states}
            if altered:
                logger.error(
                    "adapter %r blocks %s: the state of %s is not its own last update applied to its state before; "
                    "refused, and its update applied to this peer's own state instead. It altered its adapter outside "
                    "the step: the replicas' next vote outvotes it",
                    name,
                    sorted(altered),
                    source,
                )
                await self.compute(self.transfer.apply_updates, name, altered, None, True)
        steps = await self.compute(self.transfer.import_state, name, states)
        self.phases.loaded(name, {block: steps[block] for block in blocks if block in steps})
        logger.info("synced adapter %r blocks %s from %s: steps %s", name, list(blocks), source, steps)
        return StepsReply(steps)

    async def _fetch_from(
        self, source: PeerID, name: str, blocks: range, held: dict[int, int] | None
    ) -> tuple[dict[int, BlockState], dict[int, BlockUpdate]]:
        try:
            return await self.peers.fetch_state_or_updates(source, name, blocks, held)
        except (*PEER_ERRORS, RequestError) as e:  # the source's failure (or bad reply): the client picks another
            raise SourceUnavailableError(
                f"could not pull blocks {blocks.start}:{blocks.stop} from {source}: {e}", source.to_base58()
            ) from None

    async def fast_forward(self, request: FastForwardRequest) -> FastForwardReply:
        """No current copy of these blocks survived anywhere: the trainer declares the newest one current."""
        name = request.adapter
        lost = await self.compute(self.transfer.fast_forward, name, request.blocks, request.step)
        steps = self.adapters.adapter(name).steps()
        self.phases.loaded(name, {block: steps[block] for block in request.blocks if block in steps})
        return FastForwardReply(steps, lost)

    async def state(self, request: StateRequest) -> StateReply:
        return StateReply(await self.compute(self.transfer.lora_state, request.adapter))
