"""What one block's state holds of a step's reduction: which groups it can sum, whether its reduced gradient was
gathered in chunks, the step's gradient from either, and the check every gradient handed in passes. Shared by the
commit (peers/commits.py) and the reduction's fetching (peers/reduction/held.py)."""

from __future__ import annotations

import torch

from peers.reduction import norms
from peers.state import BlockAdapter
from swarm.net.errors import RequestError
from swarm.net.protocol import Group
from swarm.net.reduction import add_up


def can_sum(state: BlockAdapter, group: Group) -> bool:
    return group in state.partials or all(mb in state.grads for mb in group)


def gathered(state: BlockAdapter, groups: list[Group]) -> bool:
    return state.reduced is not None and state.reduced.groups == tuple(groups)


def missing(states: dict[int, BlockAdapter], step: int, groups: dict[int, list[Group]]) -> dict[int, list[str]]:
    """Micro-batches of the ledger (``groups``: block -> each holder's micro-batches, see ``ledger_groups``) whose
    group the ``states`` (the ledger's blocks held here) can sum neither from gradients held nor from a partial sum
    fetched for it, on blocks still at ``step``."""
    lacking = {
        block: [mb for group in groups[block] if not can_sum(state, group) for mb in group]
        for block, state in states.items()
        if state.step == step and not gathered(state, groups[block])
    }
    return {block: mbs for block, mbs in lacking.items() if mbs}


def reduced(state: BlockAdapter, groups: list[Group]) -> list[torch.Tensor]:
    """A block's gradient of the step: each group's partial sum (fetched from its holder, or summed here from the
    gradients held here, which are its holder's bits: see ``HeldGradients.drop_unlike``; the sum kept as the backwards
    came, where it covers the group: peers/reduction/running.py), added up in the order of ``groups``; or the same
    bits gathered in chunks from the block's reducers."""
    if gathered(state, groups):
        return [g.clone() for g in state.reduced.grads]
    return add_up([state.partials[g] if g in state.partials else state.running.of(state.grads, g) for g in groups])


def check_grads(state: BlockAdapter, block: int, what: str, tensors: list[torch.Tensor]) -> None:
    shapes = [tuple(lp.param.shape) for lp in state.params]
    if [tuple(t.shape) for t in tensors] != shapes or not norms.finite([tensors])[0]:
        raise RequestError(f"gradients for block {block}, micro-batch {what} have wrong shapes or values")
