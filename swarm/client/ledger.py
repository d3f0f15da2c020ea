"""The step ledger: which peer holds the gradients of which micro-batch on which block, and what to replay."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID

from swarm.net.gradnorm import GradNorm, covers_digest
from swarm.net.protocol import Held


@dataclass
class Segment:
    """Blocks [start, end) of one micro-batch: the input and output gradient the client keeps until commit."""

    start: int
    end: int
    hidden: torch.Tensor
    grad_outputs: torch.Tensor


@dataclass
class StepLedger:
    """Everything the client knows about the step in progress, until it is committed."""

    step: int
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    counter: int = 0
    holders: dict[int, dict[str, PeerID]] = field(default_factory=dict)
    # block -> micro-batch -> the hash of its gradients that the holder reported (swarm/net/gradhash.py)
    hashes: dict[int, dict[str, str]] = field(default_factory=dict)
    segments: dict[str, list[Segment]] = field(default_factory=dict)
    masks: dict[str, torch.Tensor | None] = field(default_factory=dict)
    committing: bool = False  # a commit of these gradients started: some replica may have applied them
    # Gradients of this step were discarded after their commit started: a replica found past the step may hold
    # those, not these, so it must not be taken for having applied this ledger.
    tainted: bool = False
    # block -> covers digest -> the norms a peer reported for the gradients summed over those micro-batches
    norms: dict[int, dict[str, GradNorm]] = field(default_factory=dict)
    grad_scale: float = 1.0  # the clipping factor every replica applies at commit (model.clip_grad_norm_)

    def new_micro_batch(self) -> str:
        """A fresh id ``session:step:counter``; ids of one session sort in the order they were made."""
        if self.grad_scale != 1.0:
            raise ValueError(
                "clip_grad_norm_ was already called for this step: call it after the step's last backward, just "
                "before optimizer.step()"
            )
        self.counter += 1
        return f"{self.session}:{self.step}:{self.counter:09d}"

    def note_norms(self, norms: Iterable[GradNorm]) -> None:
        """Gradient norms a backward's reply carried (see swarm/net/gradnorm.py)."""
        for norm in norms:
            self.norms.setdefault(norm.block, {})[norm.covers] = norm

    def reported_norm(self, block: int) -> GradNorm | None:
        """A reported norm of exactly the gradients the commit will apply on ``block``, if a peer sent one."""
        held = self.holders.get(block)
        return None if not held else self.norms.get(block, {}).get(covers_digest(held))

    def acknowledge(self, micro_batch: str, blocks: range, peer_id: PeerID, hashes: dict[int, str]) -> None:
        """``peer_id`` acknowledged the backward of ``micro_batch`` on ``blocks``: it holds those gradients, which
        hash as ``hashes`` (block -> hash) say."""
        for block in blocks:
            self.holders.setdefault(block, {})[micro_batch] = peer_id
            self.hashes.setdefault(block, {})[micro_batch] = hashes[block]

    def held_by(self, peer_id: PeerID) -> dict[int, list[str]]:
        """The (block, micro-batch) gradients that ``peer_id`` holds for the ledger."""
        held = {block: sorted(mb for mb, p in by_mb.items() if p == peer_id) for block, by_mb in self.holders.items()}
        return {block: mbs for block, mbs in held.items() if mbs}

    def keep(self, micro_batch: str, segment: Segment, mask: torch.Tensor | None) -> None:
        self.segments.setdefault(micro_batch, []).append(segment)
        self.masks[micro_batch] = mask

    def wire_holders(self, blocks: range) -> dict[int, dict[str, Held]]:
        """The ledger as a commit request carries it for ``blocks``: block -> {micro-batch: holder and hash}."""
        return {
            block: {
                mb: Held(peer.to_base58(), self.hashes[block][mb]) for mb, peer in self.holders.get(block, {}).items()
            }
            for block in blocks
        }

    def replay_plan(self, missing: dict[int, list[str]]) -> list[tuple[str, Segment]]:
        """The kept segments that cover the (block, micro-batch) pairs whose gradients were lost."""
        plan = []
        for micro_batch, segments in self.segments.items():
            blocks = {block for block, mbs in missing.items() if micro_batch in mbs}
            plan.extend((micro_batch, s) for s in segments if any(s.start <= b < s.end for b in blocks))
        return plan

    def next(self) -> StepLedger:
        return StepLedger(step=self.step + 1, session=self.session, counter=self.counter)

    def discarded(self) -> StepLedger:
        """The same step with nothing recorded (the gradients already sent are never committed)."""
        tainted = self.tainted or self.committing
        return StepLedger(step=self.step, session=self.session, counter=self.counter, tainted=tainted)

    @property
    def empty(self) -> bool:
        return not any(self.holders.values())
