"""A peer's side of a step, per block, as a state machine: the step's micro-batch gradients held here, other holders'
partial sums fetched, the reduced gradient, applied, acknowledged (the commit's reply, this replica's vote, made),
copied (the peers keeping standby copies told, the checkpoint queued). ``TRANSITIONS`` lists the moves
(docs/ARCHITECTURE.md, "A peer's side of a step", draws it); ``StepPhases`` records where each block's step stands
and refuses a move the table does not list. Nothing of it travels on the wire."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)


class StepPhase(Enum):
    """Where a block's step stands on this peer."""

    HELD = "held"  # the step's micro-batch gradients held here (its backwards ran here, or none did)
    PARTIAL = "partial"  # other holders' partial sums of the step fetched (the direct exchange)
    REDUCED = "reduced"  # the step's reduced gradient: gathered from its reducers' chunks, or summed to apply
    APPLIED = "applied"  # AdamW applied: the block is at the next step, the state before kept to take it back
    ACKNOWLEDGED = "acknowledged"  # the commit's reply made: the digests after the step, this replica's vote
    COPIED = "copied"  # the peers keeping standby copies told, the checkpoint queued


TRANSITIONS: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.HELD: frozenset({StepPhase.PARTIAL, StepPhase.REDUCED}),
    StepPhase.PARTIAL: frozenset({StepPhase.REDUCED, StepPhase.HELD}),
    StepPhase.REDUCED: frozenset({StepPhase.APPLIED, StepPhase.PARTIAL, StepPhase.HELD}),
    StepPhase.APPLIED: frozenset({StepPhase.ACKNOWLEDGED, StepPhase.HELD}),
    StepPhase.ACKNOWLEDGED: frozenset({StepPhase.COPIED, StepPhase.HELD}),
    StepPhase.COPIED: frozenset({StepPhase.HELD}),
}
FIRST = StepPhase.HELD
BEFORE_APPLY = frozenset({StepPhase.HELD, StepPhase.PARTIAL, StepPhase.REDUCED})
AFTER_APPLY = frozenset({StepPhase.APPLIED, StepPhase.ACKNOWLEDGED, StepPhase.COPIED})


class StepPhaseError(RuntimeError):
    """A move ``TRANSITIONS`` does not list: a bug in the peer, not a request's fault."""


@dataclass(frozen=True)
class StepMark:
    """One block's step and the phase it stands in."""

    step: int
    phase: StepPhase = FIRST

    def to(self, phase: StepPhase) -> StepMark:
        """The mark moved to ``phase`` (itself if it stands there)."""
        if phase is self.phase:
            return self
        if phase not in TRANSITIONS[self.phase]:
            raise StepPhaseError(f"step {self.step} cannot go from {self.phase.name} to {phase.name}")
        return StepMark(self.step, phase)


class StepPhases:
    """Each (adapter, block)'s step on this peer, moved by the service as requests go through it. An event before
    the apply for another step than the block's mark begins that step (the block moved on, or its state came from
    elsewhere); an event after the apply moves only a block still in the phase it follows (a step taken back
    before its copies were told stays taken back)."""

    def __init__(self) -> None:
        self.marks: dict[tuple[str, int], StepMark] = {}

    def of(self, adapter: str, block: int) -> StepMark | None:
        return self.marks.get((adapter, block))

    def loaded(self, adapter: str, steps: Mapping[int, int]) -> None:
        """A state came from elsewhere (a sync, a fast-forward): each block begins its step afresh."""
        for block, step in steps.items():
            self.marks[(adapter, block)] = StepMark(step)

    def held(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """A backward of ``step`` kept its gradients here."""
        self._move(adapter, blocks, step, FIRST, frozenset())

    def fetched(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """Other holders' partial sums of these blocks were fetched."""
        self._move(adapter, blocks, step, StepPhase.PARTIAL, BEFORE_APPLY)

    def gathered(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """These blocks' reduced gradients were gathered from their reducers' chunks."""
        self._move(adapter, blocks, step, StepPhase.REDUCED, BEFORE_APPLY)

    def dropped(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """An audited commit forgot the partial sums fetched: each holder's is fetched again, checked."""
        self._move(adapter, blocks, step, FIRST, frozenset({StepPhase.PARTIAL, StepPhase.REDUCED}), begins=False)

    def applied(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """The commit reduced these blocks' gradients and applied them."""
        blocks = list(blocks)
        self._move(adapter, blocks, step, StepPhase.REDUCED, BEFORE_APPLY)
        self._move(adapter, blocks, step, StepPhase.APPLIED, frozenset({StepPhase.REDUCED}))

    def acknowledged(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """The commit's reply, with the digests after the step, was made."""
        self._move(adapter, blocks, step, StepPhase.ACKNOWLEDGED, frozenset({StepPhase.APPLIED}), begins=False)

    def copied(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """The standby holders of these blocks were told of the step, and the checkpoint queued."""
        self._move(adapter, blocks, step, StepPhase.COPIED, frozenset({StepPhase.ACKNOWLEDGED}), begins=False)

    def taken_back(self, adapter: str, blocks: Iterable[int], step: int) -> None:
        """A revert took these blocks back to ``step``: they hold its gradients again, to apply it once more."""
        self._move(adapter, blocks, step, FIRST, AFTER_APPLY, begins=False)

    def _move(
        self,
        adapter: str,
        blocks: Iterable[int],
        step: int,
        to: StepPhase,
        sources: frozenset[StepPhase],
        begins: bool = True,
    ) -> None:
        """Move each block's mark at ``step`` that stands in one of ``sources`` to ``to``; ``begins``: a block
        whose mark is of another step (or that has none) begins ``step`` first."""
        for block in blocks:
            mark = self.marks.get((adapter, block))
            if mark is None or mark.step != step:
                if not begins:
                    continue
                mark = self.marks[(adapter, block)] = StepMark(step)
            if mark.phase in sources and mark.phase is not to:
                self.marks[(adapter, block)] = mark.to(to)
                logger.debug("adapter %r block %d step %d: %s -> %s", adapter, block, step, mark.phase.name, to.name)
