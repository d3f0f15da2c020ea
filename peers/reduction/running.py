"""One holder's partial sum of a block's step, kept as its backwards come: a backward's reply reports the norm of the
sum over every micro-batch held so far, and re-adding them all after each backward made a step's work quadratic in
its micro-batches. The sum is the same bits as ``swarm.net.reduction.partial_sum`` (onto zeros, one add per
micro-batch in sorted order), so replicas and clients that check it still agree: a micro-batch that sorts after
those summed is added on; one that sorts before them, or a held gradient dropped, replaced or changed in place (its
tensors' version counters), starts it over."""

from __future__ import annotations

import torch

from swarm.net.protocol import Group


class RunningSum:
    """The sum of the gradients of ``members`` (sorted micro-batch ids, each with the very list of tensors added and
    their versions then)."""

    def __init__(self) -> None:
        self.members: list[tuple[str, list[torch.Tensor], list[int]]] = []
        self.total: list[torch.Tensor] = []

    def of(self, by_mb: dict[str, list[torch.Tensor]], group: Group) -> list[torch.Tensor]:
        """The partial sum of ``group``'s gradients in ``by_mb``, extending the one kept; read-only (shared)."""
        wanted = sorted(group)
        kept = len(self.members)
        if kept > len(wanted) or any(
            mb != wanted[i] or by_mb.get(mb) is not grads or _versions(grads) != versions
            for i, (mb, grads, versions) in enumerate(self.members)
        ):
            self.members, self.total = [], []
        for mb in wanted[len(self.members) :]:
            grads = by_mb[mb]
            if not self.total:
                self.total = [torch.zeros_like(g) for g in grads]
            for total, grad in zip(self.total, grads, strict=True):
                total.add_(grad)
            self.members.append((mb, grads, _versions(grads)))
        return self.total


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's count of in-place changes (autograd's): a gradient overwritten where it is held changes it."""
    return [t._version for t in tensors]
