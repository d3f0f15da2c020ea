"""A step committed on the adapters' store: per block the ledger's reduced gradients, scaled by the step's clipping
factor, and one AdamW update (peers/update.py), the same bits on every replica; a commit taken back while other
replicas could not complete it; and a tie between two replicas broken on this peer's standby copies. Runs on the
compute thread, like the store."""

from __future__ import annotations

import logging

from peers.adapters import AdapterStore
from peers.reduction import norms, sums
from peers.reduction.running import RunningSum
from peers.state import BlockState, BlockUpdate, GradsByBlock, Undo, state_digests
from peers.update import steps_done
from swarm.net import hostsync
from swarm.net.errors import MissingGradientsError, RequestError, StaleStepError
from swarm.net.protocol import Group, OptimizerHParams
from swarm.net.reduction import add_up, partial_sum

logger = logging.getLogger(__name__)


class Commits:
    """Steps applied to, taken back from and tried on the ``store``'s blocks. Not thread-safe: one caller at a time
    (the compute thread), as the store."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store

    def apply(
        self,
        name: str,
        step: int,
        groups: dict[int, list[Group]],
        hparams: OptimizerHParams,
        grad_scale: float = 1.0,
    ) -> dict[int, int]:
        """Apply step ``step``: per block, the ledger's gradients reduced (each holder's micro-batches summed in
        sorted order, then those partial sums in the order of ``groups``: see ``ledger_groups``), scaled by the step's
        global clipping factor, then one AdamW update. Idempotent: blocks already past ``step`` are left alone."""
        adapter = self.store.adapter(name)
        states = self.store.ledger_states(name, step, groups)
        missing = sums.missing(states, step, groups)
        if missing:
            raise MissingGradientsError(f"no gradients for {missing} at step {step}", missing)
        at_step = {block: state for block, state in states.items() if state.step == step}
        summed = {block: sums.reduced(state, groups[block]) for block, state in at_step.items()}
        for block, finite in zip(summed, norms.finite(list(summed.values())), strict=True):
            if not finite:
                raise RequestError(f"step {step} has non-finite gradients on block {block}; refusing to apply them")
        if grad_scale != 1.0:
            for grad in (g for grads in summed.values() for g in grads):
                grad.mul_(grad_scale)
        befores = BlockState.of_all(list(at_step.values()), with_before=False)
        bases = state_digests([(before.step, before.entries()) for before in befores])
        params = {block: [lp.param for lp in state.params] for block, state in at_step.items()}
        done = steps_done([(state.optimizer, params[block]) for block, state in at_step.items()])
        for (block, state), before, steps in zip(at_step.items(), befores, done, strict=True):
            state.undo = Undo(before, state.grads, state.last_update, state.partials)
            state.optimizer.step(params[block], summed[block], hparams, steps)
        host = iter(hostsync.to_host([g for grads in summed.values() for g in grads]))
        for state, base in zip(at_step.values(), bases, strict=True):
            grads = {lp.name: next(host) for lp in state.params}
            state.last_update = BlockUpdate(step, grads, hparams, base)
            state.grads, state.partials, state.reduced, state.running = {}, {}, None, RunningSum()
            state.step += 1
        moved = set(at_step)
        self.store.forget_forwards(name)
        if self.store.behaviour is not None:
            self.store.behaviour.updated([state for block, state in adapter.blocks.items() if block in moved])
        return adapter.steps()

    def revert(self, name: str, step: int) -> dict[int, int]:
        """Take blocks that applied ``step`` back to it (a commit that other replicas could not complete yet)."""
        adapter = self.store.adapter(name)
        for block, state in adapter.blocks.items():
            if state.step == step + 1 and state.take_back():
                logger.info("adapter %r block %d: step %d taken back, to be redone", name, block, step)
        self.store.forget_forwards(name)
        return adapter.steps()

    def tiebreak(
        self,
        name: str,
        step: int,
        groups: dict[int, list[Group]],
        grads: GradsByBlock,
        hparams: OptimizerHParams,
        grad_scale: float,
    ) -> dict[int, str]:
        """Two replicas disagree on ``step``: apply it, as ``apply`` would, to this peer's standby copies at ``step``
        (the ledger's gradients given, fetched from their holders), and return the digests. Nothing is kept."""
        adapter = self.store.adapter(name)
        digests = {}
        for block, block_groups in groups.items():
            held = adapter.standby.get(block)
            if held is None or held.step != step:
                raise StaleStepError(f"no standby copy of adapter {name!r} block {block} at step {step} here")
            by_mb = grads.get(block, {})
            missing = sorted({mb for group in block_groups for mb in group} - set(by_mb))
            if missing:
                raise MissingGradientsError(f"no gradients for {missing} at step {step}", {block: missing})
            names = list(held.tensors)
            dtypes = [held.tensors[n]["param"].dtype for n in names]
            by_mb = {mb: [g.to(d) for g, d in zip(tensors, dtypes, strict=True)] for mb, tensors in by_mb.items()}
            summed = add_up([partial_sum(by_mb, group) for group in block_groups])
            if grad_scale != 1.0:
                for grad in summed:
                    grad.mul_(grad_scale)
            update = BlockUpdate(step, dict(zip(names, summed, strict=True)), hparams)
            digests[block] = update.apply_to(held).digest()
        return digests
