"""Replicas vote at every commit: each reports its block's state digest after the step, and a replica outvoted by at
least two that agree is dishonest. Pure: digests in, verdict out (the commit acts on it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)

MAJORITY = 2  # agreeing replicas it takes to outvote another


@dataclass(frozen=True)
class Verdict(Generic[P]):
    """One block's vote: the replicas holding the winning state, and those outvoted. ``undecided``: no state is
    held by ``MAJORITY`` replicas more than by any other (two that disagree, or a tie): a tie-breaker must vote."""

    majority: tuple[P, ...]
    outvoted: tuple[P, ...]
    undecided: bool

    @property
    def unanimous(self) -> bool:
        return not self.outvoted and not self.undecided


def tally(digests: Mapping[P, str]) -> Verdict[P]:
    """The vote of one block's replicas (peer -> its digest after the step). A single replica is unanimous."""
    counts = Counter(digests.values())
    ranked = counts.most_common()
    if len(ranked) <= 1:
        return Verdict(tuple(digests), (), False)
    (winner, votes), (_, runner_up) = ranked[0], ranked[1]
    if votes < MAJORITY or votes == runner_up:
        return Verdict((), (), True)
    majority = tuple(p for p, d in digests.items() if d == winner)
    return Verdict(majority, tuple(p for p, d in digests.items() if d != winner), False)
