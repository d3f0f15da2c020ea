"""The step ledger: which peer acknowledged the backward of which micro-batch on which blocks."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from hivemind.p2p import PeerID


@dataclass
class StepLedger:
    """Everything the client knows about the step in progress, until it is committed."""

    step: int
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    counter: int = 0
    acks: dict[int, dict[str, PeerID]] = field(default_factory=lambda: defaultdict(dict))

    def new_micro_batch(self) -> str:
        """A fresh id; ids of one session sort in the order the micro-batches were made."""
        self.counter += 1
        return f"{self.session}:{self.step}:{self.counter:09d}"

    def acknowledge(self, micro_batch: str, blocks: range, peer_id: PeerID) -> None:
        for block in blocks:
            self.acks[block][micro_batch] = peer_id

    def micro_batches(self, blocks: range) -> dict[int, list[str]]:
        """Per block, the micro-batches that must be summed at commit, in canonical order."""
        return {block: sorted(self.acks.get(block, {})) for block in blocks}

    def next(self) -> StepLedger:
        return StepLedger(step=self.step + 1, session=self.session)

    @property
    def empty(self) -> bool:
        return not any(self.acks.values())
