"""The gradients of a step a peer holds for the reduction, read and written on the store's blocks: what it lacks,
its own that another holder's bits replace, what it hands other replicas (micro-batch gradients, partial sums,
chunks of them), the partial sums and reduced gradients it takes in. Run on the compute thread, like the store."""

from __future__ import annotations

from typing import TypeVar

import torch

from peers.adapters import AdapterStore
from peers.reduction import sums
from peers.state import BlockAdapter, GradsByBlock, Reduced
from swarm.net import sketch
from swarm.net.errors import RequestError
from swarm.net.gradhash import grad_hashes
from swarm.net.protocol import SKETCH, SUM, Group
from swarm.net.reduction import chunk_of, from_chunks, partial_chunk, partial_sum

V = TypeVar("V")
KEPT_SKETCHES = 1024  # (micro-batches, chunk, seed) sketched lately, kept for the replicas that ask again


class HeldGradients:
    """A step's gradients in the ``store``'s blocks, as the reduction reads and fills them. Not thread-safe: one
    caller at a time (the compute thread), as the store."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store
        # the sketches handed on lately, by what they are of: every replica that fetches a sum asks for the same
        # ones, and a commit's later round asks again (ROWS x 8 bytes a micro-batch; at most KEPT_SKETCHES kept)
        self._sketched: dict[tuple, torch.Tensor] = {}

    def missing(self, name: str, step: int, groups: dict[int, list[Group]]) -> dict[int, list[str]]:
        """Micro-batches of the ledger (``groups``: block -> each holder's micro-batches, see ``ledger_groups``) whose
        group this peer can sum neither from gradients held here nor from a partial sum fetched for it, on blocks
        still at ``step``."""
        return sums.missing(self.store.ledger_states(name, step, groups), step, groups)

    def drop_unlike(self, name: str, step: int, hashes: dict[int, dict[str, str]]) -> None:
        """Forget gradients held here for micro-batches whose ledger holder is another peer, where they hash otherwise
        (``hashes``: block -> micro-batch -> the holder's hash): this peer computed the micro-batch too (a retried
        backward) on hardware that rounds differently, and every replica must apply the same bits, the holder's."""
        held = [
            (state, mb, want) for _, state, by_mb in self._at_step(name, step, hashes) for mb, want in by_mb.items()
        ]
        held = [(state, mb, want) for state, mb, want in held if mb in state.grads]
        for (state, mb, wanted), found in zip(held, grad_hashes([s.grads[mb] for s, mb, _ in held]), strict=True):
            if found != wanted:
                del state.grads[mb]

    def micro_batch_grads(self, name: str, step: int, wanted: dict[int, list[str]]) -> GradsByBlock:
        """Gradients this peer holds for (block, micro-batch) at ``step`` (applied or not), for a replica that lacks
        them."""
        adapter = self.store.adapter(name)
        found: GradsByBlock = {}
        for block, mbs in wanted.items():
            state = adapter.blocks.get(block)
            if state is not None and state.step == step:
                held = state.grads
            elif state is not None and state.step == step + 1 and state.undo is not None:
                held = state.undo.grads  # this replica applied the step already; others may not have yet
            else:
                continue
            found[block] = {mb: held[mb] for mb in mbs if mb in held}
        behaviour = self.store.behaviour
        return found if behaviour is None else behaviour.served_grads(found)

    def partial_sums(
        self, name: str, step: int, wanted: dict[int, list[str]], chunk: int = 0, chunks: int = 0
    ) -> GradsByBlock:
        """This peer's partial sum of the step on each block: the ``wanted`` micro-batches' gradients held here,
        summed in sorted order (under the key ``SUM``; with ``chunks``, only that chunk of it: see
        swarm/net/reduction.py), and beside it (under ``SKETCH``) the sketch of each of those gradients (or of that
        chunk of them), the signs drawn from the sum as handed on (swarm/net/sketch.py); a block where some are not
        held is left out."""
        held = self.micro_batch_grads(name, step, wanted)
        found: GradsByBlock = {}
        for block, mbs in wanted.items():
            by_mb, group = held.get(block, {}), tuple(sorted(mbs))
            if all(mb in by_mb for mb in mbs):
                summed = [partial_chunk(by_mb, group, chunk, chunks)] if chunks else partial_sum(by_mb, group)
                found[block] = {SUM: summed}
        behaviour = self.store.behaviour
        if behaviour is not None:
            found = behaviour.partial_sums(found)
        for block, by_key in found.items():
            by_key[SKETCH] = [self._sketches(held[block], sorted(wanted[block]), by_key[SUM], chunk, chunks)]
        return found if behaviour is None else behaviour.sketched(found)

    def _sketches(
        self, by_mb: dict[str, list[torch.Tensor]], mbs: list[str], summed: list[torch.Tensor], chunk: int, chunks: int
    ) -> torch.Tensor:
        """The sketch of each micro-batch's gradient (or that chunk of it) with the signs ``summed`` draws; one
        computed lately for the same sum is handed on again (the seed is the sum's hash)."""
        seed = sketch.seed_of(summed)
        key = (tuple(mbs), chunk, chunks, seed)
        if key not in self._sketched:
            vectors = [chunk_of(by_mb[mb], chunk, chunks) if chunks else sketch.flat(by_mb[mb]) for mb in mbs]
            self._sketched[key] = sketch.sketches(vectors, seed)
            while len(self._sketched) > KEPT_SKETCHES:
                del self._sketched[next(iter(self._sketched))]
        return self._sketched[key]

    def blocks_at(self, name: str, step: int, groups: dict[int, list[Group]]) -> list[int]:
        """The ledger's blocks held here still at ``step`` (checked like a commit's: see ``ledger_states``)."""
        states = self.store.ledger_states(name, step, groups)
        return sorted(block for block, state in states.items() if state.step == step)

    def chunk_parts(
        self, name: str, step: int, block: int, groups: list[Group], chunk: int, chunks: int
    ) -> list[torch.Tensor | None]:
        """Per group of a block's ledger, in order, the chunk of its partial sum this peer can make (from gradients
        or a partial sum held here), or None where the group's holder must send it."""
        state = self.store.adapter(name).blocks[block]
        return [
            (
                chunk_of(state.partials[g], chunk, chunks)
                if g in state.partials
                else partial_chunk(state.grads, g, chunk, chunks)
            )
            if sums.can_sum(state, g)
            else None
            for g in groups
        ]

    def gathered(self, name: str, step: int, block: int, groups: list[Group]) -> list[torch.Tensor] | None:
        """The block's reduced gradient of the step for these groups, if it was gathered here."""
        state = self.store.adapter(name).blocks.get(block)
        at_step = state is not None and state.step == step
        return state.reduced.grads if at_step and sums.gathered(state, groups) else None

    def set_gathered(self, name: str, step: int, block: int, groups: list[Group], chunks: list[torch.Tensor]) -> None:
        """Take a block's reduced gradient of the step, gathered in chunks from its reducers; checked like any
        input."""
        state = self.store.adapter(name).blocks.get(block)
        if state is None or state.step != step:
            return
        try:
            grads = from_chunks(chunks, [lp.param for lp in state.params])
        except ValueError as e:
            raise RequestError(f"the reduced gradient of block {block} does not fit its LoRA tensors: {e}") from None
        sums.check_grads(state, block, "(reduced)", grads)
        state.reduced = Reduced(tuple(groups), grads)

    def add_partials(self, name: str, step: int, partials: dict[int, dict[Group, list[torch.Tensor]]]) -> None:
        """Take other holders' partial sums of the step (block -> their micro-batches -> the sum); checked like any
        input."""
        for block, state, by_group in self._at_step(name, step, partials):
            for group, tensors in by_group.items():
                sums.check_grads(state, block, "+".join(group), tensors)
                state.partials[group] = [t.to(lp.param.dtype) for t, lp in zip(tensors, state.params, strict=True)]

    def _at_step(self, name: str, step: int, by_block: dict[int, V]) -> list[tuple[int, BlockAdapter, V]]:
        """The blocks of ``by_block`` whose state here is still at ``step``, each with its state and its value."""
        adapter = self.store.adapter(name)
        at_step = [(block, adapter.blocks.get(block), value) for block, value in by_block.items()]
        return [(block, state, value) for block, state, value in at_step if state is not None and state.step == step]

    def drop_partials(self, name: str, step: int) -> None:
        """Forget the partial sums (and reduced gradients) fetched for ``step``: an audited commit fetches each
        holder's partial sum again."""
        for state in self.store.adapter(name).blocks.values():
            if state.step == step:
                state.partials, state.reduced = {}, None
