"""An adapter's state moved in and out of the store: exported for another peer (whole, or as the last update of a
block it holds one step behind), imported from a current replica, standby copies and served blocks brought one step
forward by their server's update (checked to give the server's state), blocks declared current where no newer copy
survived, and the LoRA tensors read out as a peft adapter names them. Runs on the compute thread, like the store."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from peers.adapters import AdapterStore
from peers.state import Adapter, BlockAdapter, BlockState, BlockUpdate

logger = logging.getLogger(__name__)


class StateTransfer:
    """The moves of state in and out of the ``store``'s adapters. Not thread-safe: one caller at a time (the compute
    thread), as the store."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store

    def export_state(
        self, name: str, blocks: range, held: dict[int, int] | None = None
    ) -> tuple[dict[int, BlockState], dict[int, BlockUpdate]]:
        """LoRA tensors, AdamW moments and step of each block, served or standby: what another peer needs. For a
        served block that the asking peer ``held`` one step behind, the last update instead (a third of the bytes)."""
        adapter = self.store.adapter(name)
        states: dict[int, BlockState | None] = {}  # None: a served block's, copied below
        updates, whole = {}, []
        for block in blocks:
            served = adapter.blocks.get(block)
            update = served.last_update if served is not None else None
            if update is not None and held is not None and held.get(block) == update.step == served.step - 1:
                updates[block] = replace(update, after=served.digest())  # what the asker's copy must reach
            elif served is not None:
                states[block] = None
                whole.append(served)
            elif block in adapter.standby:
                states[block] = adapter.standby[block]
        copies = iter(BlockState.of_all(whole))  # one copy to the host
        return {block: next(copies) if state is None else state for block, state in states.items()}, updates

    def import_state(self, name: str, states: dict[int, BlockState]) -> dict[int, int]:
        """Replace this peer's state of served blocks by a current replica's (gradients in progress are dropped)."""
        adapter = self.store.adapter(name)
        for block, incoming in states.items():
            if block in adapter.blocks:
                incoming.load_into(adapter.blocks[block])
        self.store.forget_forwards(name)
        return adapter.steps()

    def apply_updates(
        self,
        name: str,
        updates: dict[int, BlockUpdate],
        sources: Mapping[int, object] | None = None,
        own_lineage: bool = False,
    ) -> list[int]:
        """Bring standby copies one step forward with their servers' last updates; returns the blocks updated (a
        copy that is not at the update's step is left as it is: its holder pulls the whole state next time). A copy
        at the step but not in the server's bits (``BlockUpdate.fits``) is dropped, so the next pull brings it whole.
        A served block gets an update only where its caller asked for one (a span taken over from its deterministic
        init, a trainer's sync): it is brought forward the same way, or left as it is; with ``own_lineage``, also
        where its state is not the server's at the step (the server's state was found altered: see
        ``StateSync.sync``). Where the result is not the server's state (``BlockUpdate.reaches``), the server
        altered its adapter outside the step: the result made here is kept, and the server (``sources``: block ->
        who sent the update) named in the log."""
        adapter = self.store.adapter(name)
        done, diverged = [], []
        for block, update in updates.items():
            served = adapter.blocks.get(block)
            if served is not None:
                at_step = served.step == update.step
                advanced = self._advance_served(served, update, own_lineage) if at_step else None
                if advanced is not None:
                    self.store.forget_forwards(name)
            else:
                advanced = self._advance_copy(name, adapter, block, update)
            if advanced is not None:
                done.append(block)
                if not update.reaches(advanced):
                    diverged.append(block)
        for source in {(sources or {}).get(block) for block in diverged}:
            logger.error(
                "adapter %r blocks %s: the state of %s is not its own last update applied to the step before; "
                "refused (this peer applied the update to its own copy). It altered its adapter outside the step: "
                "the replicas' next vote outvotes it",
                name,
                sorted(b for b in diverged if (sources or {}).get(b) == source),
                source or "their server",
            )
        return done

    @staticmethod
    def _advance_copy(name: str, adapter: Adapter, block: int, update: BlockUpdate) -> BlockState | None:
        held = adapter.standby.get(block)
        if held is None or held.step != update.step:
            return None
        if not update.fits(held):
            logger.warning(
                "adapter %r block %d: the standby copy at step %d differs from its server's state; dropped, to be "
                "pulled whole",
                name,
                block,
                held.step,
            )
            del adapter.standby[block]
            return None
        advanced = adapter.standby[block] = update.apply_to(held)
        advanced.before = replace(held, before=None)  # revertible like the server's state
        return advanced

    @staticmethod
    def _advance_served(served: BlockAdapter, update: BlockUpdate, own_lineage: bool) -> BlockState | None:
        """A served block one step forward with another server's update, if it holds that server's bits at the
        step (or ``own_lineage``); it then hands the same update on itself."""
        held = BlockState.of(served, with_before=False)
        if not own_lineage and not update.fits(held):
            return None
        if own_lineage:
            update = replace(update, base=held.digest())
        advanced = update.apply_to(held)
        advanced.before = held  # revertible like the server's state
        advanced.load_into(served)
        served.last_update = replace(update, after="")
        return advanced

    def fast_forward(self, name: str, blocks: range, step: int) -> dict[int, int]:
        """Declare blocks whose newest surviving state is older than ``step`` current at ``step``: the updates
        between are lost. Returns the steps lost per block (reported by the caller, never silent)."""
        adapter = self.store.adapter(name)
        lost = {}
        for block in blocks:
            state = adapter.blocks.get(block)
            if state is not None and state.step < step:
                lost[block] = step - state.step
                logger.warning(
                    "adapter %r block %d: newest surviving state is step %d, the trainer is at %d: %d step(s) lost",
                    name,
                    block,
                    state.step,
                    step,
                    lost[block],
                )
                state.step = step
                state.grads.clear()
                state.last_update = state.undo = None
        self.store.forget_forwards(name)
        return lost

    def lora_state(self, name: str) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors per block, named as inside a peft adapter file (``self_attn.q_proj.lora_A.weight``)."""
        adapter = self.store.adapter(name)
        return {
            block: {lp.name: lp.param.detach().cpu().clone() for lp in state.params}
            for block, state in adapter.blocks.items()
        }
