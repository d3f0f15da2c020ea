"""Gradient norms on the wire: what a peer reports of a block's accumulated LoRA gradients, so that the client clips
the step's gradient globally (over every block of every peer) without another round trip.

The norm of a step's gradient is that of each block's *sum* over micro-batches, so a report names the micro-batches
it sums (``covers``, a digest of their ids): the client uses it only when that is exactly the set the commit will
apply on that block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass


def covers_digest(micro_batches: Iterable[str]) -> str:
    """A short digest of a set of micro-batch ids (order and repeats do not matter)."""
    text = "\n".join(sorted(set(micro_batches)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GradNorm:
    """One block's gradient summed over the micro-batches ``covers`` names: its sum of squares and its largest
    absolute value (the 2-norm and the inf-norm, squared and as is). Non-finite values travel as they are: the client
    refuses to apply such a step."""

    block: int
    covers: str
    sum_sq: float
    max_abs: float

    def to_wire(self) -> list:
        return [self.block, self.covers, self.sum_sq, self.max_abs]

    def part(self, norm_type: float) -> float | None:
        """This block's share of the step's norm: ``sum |g|^2`` for the 2-norm, ``max |g|`` for the inf-norm; None
        for another norm type (the client asks for it)."""
        if norm_type == 2.0:
            return self.sum_sq
        if math.isinf(norm_type):
            return self.max_abs
        return None


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_grad_norm(entry: object) -> GradNorm:
    """One ``[block, covers, sum_sq, max_abs]`` entry; raises ValueError."""
    if not isinstance(entry, list) or len(entry) != 4:
        raise ValueError(f"{entry!r} is not [block, covers, sum_sq, max_abs]")
    block, covers, sum_sq, max_abs = entry
    if not (isinstance(block, int) and not isinstance(block, bool) and block >= 0):
        raise ValueError(f"{block!r} is not a block number")
    if not isinstance(covers, str) or not covers or not _number(sum_sq) or not _number(max_abs):
        raise ValueError(f"{entry!r} is not [block, covers, sum_sq, max_abs]")
    return GradNorm(block, covers, float(sum_sq), float(max_abs))


def combine(parts: Iterable[float], norm_type: float) -> float:
    """The step's norm from its blocks' shares (see ``GradNorm.part``; for another p: ``sum |g|^p``)."""
    values = list(parts)
    if math.isinf(norm_type):
        return max(values, default=0.0)
    return math.fsum(values) ** (1.0 / norm_type)
