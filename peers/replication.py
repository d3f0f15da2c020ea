"""Redundant adapter state: standby copies of blocks a peer does not serve, and the state of blocks it takes over.

Each round a peer pulls, from live peers, the newest adapter + AdamW state of the blocks it keeps on standby (the
blocks with the fewest holders), so that the state of every block outlives any one peer. When it starts serving
a block it takes the newest state it can find: a live server's, another peer's standby copy, or its own copy
(standby or checkpoint); what is older than the trainer's step is reported as steps lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from peers.adapters import AdapterStore
from peers.balancer import choose_standby
from peers.compute import Compute
from peers.peer_client import PeerClient
from peers.state import BlockState, BlockUpdate
from peers.transfer import StateTransfer
from swarm.blocks import spans_text
from swarm.net.errors import PEER_ERRORS, RequestError
from swarm.net.protocol import lora_and_seed
from swarm.net.view import SwarmView

logger = logging.getLogger(__name__)


@dataclass
class StandbyPolicy:
    """How many blocks to keep on standby (None: as many as this peer serves) and how often to refresh them."""

    blocks: int | None = None
    every: int = 1


class Replicator:
    """Moves adapter state between peers on behalf of one peer's adapter store (all access to it on its compute
    thread)."""

    def __init__(
        self,
        adapters: AdapterStore,
        compute: Compute,
        peers: PeerClient,
        me: PeerID,
        policy: StandbyPolicy,
        on_refreshed: Callable[[str], Awaitable[None]],
    ):
        self.adapters, self.compute, self.peers, self.me, self.policy = adapters, compute, peers, me, policy
        self.transfer = StateTransfer(adapters)  # copies brought forward by their servers' updates
        self.on_refreshed = on_refreshed  # a copy changed: checkpoint it
        self.standby: list[int] = []
        # adapter -> block -> the step its trainer last asked this peer to hold a copy at (see on_committed)
        self.pinned: dict[str, dict[int, int]] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def refresh_standby(self, view: SwarmView, serving: range) -> list[str]:
        """Pull newer state of this peer's standby blocks; returns the adapters whose copies changed."""
        count = len(serving) if self.policy.blocks is None else self.policy.blocks
        num_blocks = self.adapters.spec.num_blocks
        self.standby = choose_standby(view.holders(self.me), serving, num_blocks, count)
        changed = []
        async with self._lock:
            for name, meta in view.adapters().items():
                if await self._refresh_adapter(view, name, meta):
                    changed.append(name)
        return changed

    async def _refresh_adapter(self, view: SwarmView, name: str, meta: dict) -> bool:
        held = await self.compute(self._standby_steps, name)
        pins = self.pinned.get(name, {})
        for block in list(pins):
            newest = view.newest(name, block, self.me)
            if newest is not None and _lapsed(pins, block, newest[0]):
                del pins[block]
        wanted = {}
        for block in self.standby:
            newest = view.newest(name, block, self.me)
            if newest is not None and (block not in held or newest[0] - held[block] >= self.policy.every):
                wanted[block] = newest
        return await self._pull(name, meta, wanted, keep=set(self.standby) | set(pins))

    async def hold(self, name: str, meta: dict, step: int, sources: list[tuple[range, PeerID]]) -> dict[int, int]:
        """The trainer's request: hold copies of these blocks at ``step`` (at least), pulled from ``sources``, before
        it acknowledges the step. Pinned: kept whatever this peer's own standby choice. Returns the steps held."""
        blocks = [block for span, _ in sources for block in span]
        self.pinned.setdefault(name, {}).update(dict.fromkeys(blocks, step))
        async with self._lock:
            held = await self.compute(self._held, name)
            todo = [(span, peer) for span, peer in sources if any(held.get(b, -1) < step for b in span)]
            fetched = await asyncio.gather(*(self._fetch(name, peer, span) for span, peer in todo))
            states = {b: state for part, _ in fetched for b, state in part.items() if state.step >= step}
            updates = {b: update for _, part in fetched for b, update in part.items() if update.step + 1 >= step}
            if states or updates:
                sources = {block: peer for span, peer in todo for block in span}
                await self._store(name, meta, states, updates, keep=None, trainer_step=step, sources=sources)
                held = await self.compute(self._held, name)
        if states or updates:
            task = asyncio.ensure_future(self.on_refreshed(name))  # checkpoint in the background
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return {block: held[block] for block in blocks if block in held}

    def _held(self, name: str) -> dict[int, int]:
        """Steps of every block of the adapter this peer holds, served or standby (on the compute thread)."""
        adapter = self.adapters.by_name.get(name)
        return {**adapter.standby_steps(), **adapter.steps()} if adapter is not None else {}

    def _makeable(self, name: str, blocks: Iterable[int]) -> dict[int, int]:
        """Blocks of ``blocks`` whose layer this peer serves, of an adapter it holds nothing of yet: their
        deterministic init, at step 0, is made here when the adapter is (on the compute thread)."""
        if name in self.adapters.by_name:
            return {}
        return {block: 0 for block in blocks if block in self.adapters.served}

    def _standby_steps(self, name: str) -> dict[int, int]:
        """Steps of the standby copies this peer holds of the adapter (on the compute thread)."""
        adapter = self.adapters.by_name.get(name)
        return adapter.standby_steps() if adapter is not None else {}

    async def on_committed(self, name: str, meta: dict, steps: dict[int, int], source: PeerID) -> None:
        """A server committed a step (``steps``: its blocks' new steps): pull the blocks kept here on standby,
        unless this peer's copy is fewer than ``every`` steps behind (or another replica's notice brought it). Not
        the blocks the trainer pinned at the step before: it has them copied once the replicas' vote is in, and
        until then the copy at the step before may have to break a tie between two replicas
        (``Commits.tiebreak``). A pin the trainer did not renew at that step has lapsed (the block has enough
        replicas again): the copy follows the commits again, where it stayed behind for good before."""
        async with self._lock:
            held = await self.compute(self._standby_steps, name)
            pins = self.pinned.get(name, {})
            for block, step in steps.items():
                if _lapsed(pins, block, step):
                    del pins[block]
            wanted = {
                block: (step, source)
                for block, step in steps.items()
                if block in self.standby
                and block not in pins
                and step - held.get(block, -self.policy.every) >= self.policy.every
            }
            if wanted:
                await self._pull(name, meta, wanted, keep=None)
                await self.on_refreshed(name)

    async def take_state(self, view: SwarmView, blocks: range) -> None:
        """Before serving ``blocks``: hold the newest state of each (adapter, block) the swarm still has. Where this
        peer holds a block one step behind its newest holder (a copy, its own served state, or the deterministic
        init it makes itself of a block whose layer it loaded), it takes the holder's last update and applies it
        itself rather than the holder's state: a span's first server cannot seed the replicas that join one step
        after it with a state its own update does not give (``BlockUpdate.reaches``)."""
        for name, meta in view.adapters().items():
            held = await self.compute(self._held, name)
            wanted = {}
            for block in blocks:
                newest = view.newest(name, block, self.me)
                if newest is not None and newest[0] > held.get(block, -1):
                    wanted[block] = newest
            made = await self.compute(self._makeable, name, wanted)
            standby = await self.compute(self._standby_steps, name)
            await self._pull(name, meta, wanted, keep=None, held={**made, **standby})
            await self.compute(self.adapters.ensure_adapter, name, *lora_and_seed(meta))
            took = await self.compute(self._held, name)
            trainer = view.trainer_step(name)
            for block in blocks:
                step = took.get(block)
                if step is None:
                    logger.warning(
                        "adapter %r block %d: no surviving state anywhere; starting from the init", name, block
                    )
                elif trainer is not None and step < trainer:
                    # not a loss yet: the trainer syncs this peer from a current replica, or declares the loss
                    logger.warning(
                        "adapter %r block %d: the newest state found is step %d, the trainer's is %d: %d step(s) "
                        "behind until the trainer syncs it from a current replica (lost only if none survives)",
                        name,
                        block,
                        step,
                        trainer,
                        trainer - step,
                    )
                else:
                    logger.info("adapter %r block %d: taking over at step %d, no step lost", name, block, step)

    async def _pull(
        self,
        name: str,
        meta: dict,
        wanted: dict[int, tuple[int, PeerID]],
        keep: set[int] | None,
        held: dict[int, int] | None = None,
    ) -> bool:
        """Fetch ``wanted`` blocks (block -> (step, holder)), one request per holder, into the standby store (and,
        given ``held``, the served blocks it names: see ``take_state``)."""
        by_peer: dict[PeerID, list[int]] = {}
        for block, (_, peer) in wanted.items():
            by_peer.setdefault(peer, []).append(block)
        states, updates, sources = {}, {}, {}
        for peer, blocks in by_peer.items():
            part_states, part_updates = await self._fetch(name, peer, range(min(blocks), max(blocks) + 1), held)
            states.update({block: state for block, state in part_states.items() if block in blocks})
            updates.update({block: update for block, update in part_updates.items() if block in blocks})
            sources.update(dict.fromkeys(blocks, peer))
        if states or updates or keep is not None:
            await self._store(name, meta, states, updates, keep, sources=sources)
        if states or updates:
            logger.debug("adapter %r: standby copies of blocks %s refreshed", name, sorted({*states, *updates}))
        return bool(states or updates)

    async def _fetch(
        self, name: str, peer: PeerID, span: range, held: dict[int, int] | None = None
    ) -> tuple[dict[int, BlockState], dict[int, BlockUpdate]]:
        """The state of ``span`` from ``peer``; for blocks this peer keeps a standby copy of one step behind (or
        ``held``, block -> step, says it holds so), the peer's last update instead (a third of the bytes). Nothing,
        logged, if the peer does not answer. ``peer`` tells this one of its next commits of ``span``, so that the
        copy follows them."""
        if held is None:
            held = await self.compute(self._standby_steps, name)
        try:
            return await self.peers.fetch_state_or_updates(
                peer, name, span, {b: held[b] for b in span if b in held}, watcher=self.me
            )
        except (*PEER_ERRORS, RequestError) as e:  # gone, refused, or a malformed export
            logger.warning("could not copy adapter %r blocks %s from %s: %s", name, spans_text(span), peer, e)
            return {}, {}

    async def _store(
        self,
        name: str,
        meta: dict,
        states: dict[int, BlockState],
        updates: dict[int, BlockUpdate],
        keep: set[int] | None,
        trainer_step: int | None = None,
        sources: dict[int, PeerID] | None = None,
    ) -> None:
        def store() -> None:
            self.adapters.keep_standby(name, meta, states, keep, trainer_step)
            if updates:
                self.transfer.apply_updates(name, updates, sources)

        await self.compute(store)


def _lapsed(pins: dict[int, int], block: int, step: int) -> bool:
    """Whether the trainer's pin of ``block`` is over, now that a replica is at ``step``: it pinned the copy at the
    step it had just committed, and pins it again at the next step only while the block lacks replicas."""
    return block in pins and step > pins[block] + 1
