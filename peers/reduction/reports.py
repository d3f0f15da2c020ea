"""What a peer says of the gradients it holds: with a backward's reply, each block's gradient norms (for global
clipping without a round trip, swarm/net/gradnorm.py) and the micro-batch's gradient hashes (checked by the replicas
that fetch them at commit); before a commit, each block's share of the step's norm. The norms are read by the host in
one sync (peers/reduction/norms.py). Runs on the compute thread, like the store."""

from __future__ import annotations

import math

from peers.adapters import AdapterStore
from peers.reduction import norms, sums
from peers.state import BlockAdapter
from swarm.net.errors import MissingGradientsError
from swarm.net.gradhash import grad_hashes
from swarm.net.gradnorm import GradNorm, covers_digest
from swarm.net.protocol import Group


class GradReports:
    """The norms and hashes of the gradients held in the ``store``'s blocks. Not thread-safe: one caller at a time
    (the compute thread), as the store."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store

    def grad_norms(self, name: str, blocks: range, step: int) -> tuple[GradNorm, ...]:
        """What a backward's reply says of its blocks: each one's gradient summed over every micro-batch held here at
        ``step``, as a 2-norm and an inf-norm share, and which micro-batches those are."""
        held = self._holding(name, blocks, step)
        # one holder's sum: the step's, if it holds all; kept as the backwards come (peers/reduction/running.py)
        summed = [state.running.of(state.grads, tuple(state.grads)) for state in held.values()]
        return tuple(
            GradNorm(
                block,
                covers_digest(state.grads),
                math.fsum(two**2 for two, _ in by_tensor),
                max((inf for _, inf in by_tensor), default=0.0),
            )
            for (block, state), by_tensor in zip(held.items(), norms.tensor_norms(summed, (2.0, math.inf)), strict=True)
        )

    def grad_hashes(self, name: str, blocks: range, step: int, micro_batch: str) -> tuple[tuple[int, str], ...]:
        """What a backward's reply says of the micro-batch's gradients held here on each block: their hash (see
        swarm/net/gradhash.py), which the replicas fetching them at commit check."""
        held = {block: s.grads[micro_batch] for block, s in self._holding(name, blocks, step, micro_batch).items()}
        return tuple(zip(held, grad_hashes(list(held.values())), strict=True))

    def _holding(self, name: str, blocks: range, step: int, micro_batch: str | None = None) -> dict[int, BlockAdapter]:
        """The blocks holding gradients at ``step`` here (of ``micro_batch``, if given)."""
        at_step = {block: self.store.adapter(name).blocks.get(block) for block in blocks}
        return {
            block: state
            for block, state in at_step.items()
            if state is not None and state.step == step and (micro_batch in state.grads if micro_batch else state.grads)
        }

    def norm_parts(self, name: str, step: int, groups: dict[int, list[Group]], norm_type: float) -> dict[int, float]:
        """Per block of the ledger held here at ``step``, its share of the step's ``norm_type``-norm (see
        ``NormsRequest``); raises MissingGradientsError when some of the ledger's gradients are not here."""
        states = self.store.ledger_states(name, step, groups)
        missing = sums.missing(states, step, groups)
        if missing:
            raise MissingGradientsError(f"no gradients for {missing} at step {step}", missing)
        at_step = {block: state for block, state in states.items() if state.step == step}
        reduced = [sums.reduced(state, groups[block]) for block, state in at_step.items()]
        parts = {}
        for block, tensor_norms in zip(at_step, norms.tensor_norms(reduced, (norm_type,)), strict=True):
            if math.isinf(norm_type):
                parts[block] = max((n for (n,) in tensor_norms), default=0.0)
            else:
                parts[block] = math.fsum(n**norm_type for (n,) in tensor_norms)
        return parts
