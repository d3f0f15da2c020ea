"""How a step's gradients add up, the same bits on every replica, standby holder and client that checks them: each
holder sums its own micro-batches' gradients in sorted order (its partial sum, the only gradient it sends), and the
partial sums are added in the order of the ledger's groups (``protocol.ledger_groups``). Every sum is one ``add``
per tensor onto zeros: correctly rounded on every device (see peers/update.py)."""

from __future__ import annotations

import torch

from swarm.net.protocol import Group


def add_up(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The elementwise sum of lists of tensors, in the order given."""
    summed = [torch.zeros_like(t) for t in parts[0]]
    for part in parts:
        for total, tensor in zip(summed, part, strict=True):
            total.add_(tensor)
    return summed


def partial_sum(by_mb: dict[str, list[torch.Tensor]], group: Group) -> list[torch.Tensor]:
    """One holder's partial sum: the gradients of its micro-batches (``group``) in sorted order."""
    return add_up([by_mb[mb] for mb in sorted(group)])


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))
