"""One round of a commit: every replica left to ask is asked at once to fetch the partial sums it lacks and apply the
step; each ends the round in one ``Phase``. Also which gradients died with their holder before anyone is asked."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from hivemind.p2p import PeerID

from swarm.client.calls import PeerCalls, PeerFailure
from swarm.client.ledger import StepLedger
from swarm.net.errors import RemoteError
from swarm.net.protocol import (
    CommitReply,
    CommitRequest,
    ErrorKind,
    OptimizerHParams,
    ReplyError,
    bad_holders,
    commit_floor,
    missing_gradients,
)
from swarm.net.reduction import MIN_REDUCERS

logger = logging.getLogger(__name__)


def mbs_text(missing: dict[int, list[str]]) -> str:
    """Lost gradients per block, counted, for a log line or an error."""
    return ", ".join(f"block {block}: {len(mbs)} micro-batch(es)" for block, mbs in sorted(missing.items()))


def held_by_departed(
    ledger: StepLedger, pending: dict[PeerID, range], applied: dict[PeerID, range]
) -> dict[int, list[str]]:
    """Gradients, on the blocks ``pending`` replicas still have to commit, whose holder is neither one of them nor a
    replica that applied the step (and still serves them): it died. Replay them without asking anyone."""
    blocks = {b for span in pending.values() for b in span}
    lost: dict[int, list[str]] = {}
    for block, by_mb in ledger.holders.items():
        gone = [mb for mb, holder in by_mb.items() if holder not in pending and holder not in applied]
        if gone and block in blocks:
            lost[block] = sorted(gone)
    return lost


class Phase(Enum):
    """Where one replica stands after a round of commit requests (docs/ARCHITECTURE.md, "The commit's states")."""

    APPLIED = "applied"  # it applied the step; its reply carries its digests: its vote
    LACKING = "lacking"  # it could get some partial sums from nobody live: it applied nothing
    ACCUSING = "accusing"  # a holder handed it a partial sum that is not the sum of what the holder reported
    SILENT = "silent"  # no answer (dead, frozen, cut off) or a garbled one: banned for a while


@dataclass(frozen=True)
class Outcome:
    """One replica's answer to one commit request."""

    phase: Phase
    reply: CommitReply | None = None
    lacking: dict[int, list[str]] = field(default_factory=dict)
    accused: tuple[PeerID, ...] = ()


@dataclass
class CommitRound:
    """Each replica's outcome of one round of commit requests, asked all at once."""

    outcomes: dict[PeerID, Outcome]

    def of(self, phase: Phase) -> list[PeerID]:
        return [peer for peer, outcome in self.outcomes.items() if outcome.phase is phase]

    @property
    def votes(self) -> dict[PeerID, CommitReply]:
        return {peer: o.reply for peer, o in self.outcomes.items() if o.phase is Phase.APPLIED and o.reply is not None}

    @property
    def missing(self) -> dict[int, list[str]]:
        """The (block, micro-batch) gradients some replica could get from nobody live: to replay."""
        lacking: dict[int, set[str]] = {}
        for outcome in self.outcomes.values():
            for block, mbs in outcome.lacking.items():
                lacking.setdefault(block, set()).update(mbs)
        return {block: sorted(mbs) for block, mbs in lacking.items()}

    @property
    def accused(self) -> list[tuple[PeerID, PeerID]]:
        """(accuser, holder) pairs, for ``judge_accused``."""
        return [(peer, holder) for peer, o in self.outcomes.items() for holder in o.accused]

    def summary(self) -> str:
        parts = [f"{len(self.of(Phase.APPLIED))} applied"]
        if silent := self.of(Phase.SILENT):
            parts.append("no answer from " + ", ".join(str(p) for p in silent))
        if self.missing:
            parts.append(f"gradients nobody live could hand on {mbs_text(self.missing)}")
        if self.accused:
            parts.append("accused " + ", ".join(f"{h} (by {a})" for a, h in self.accused))
        return ", ".join(parts)


def ask_round(
    calls: PeerCalls,
    each: Callable[[Callable[[PeerID], Outcome], list[PeerID]], list[Outcome]],
    peers: dict[PeerID, range],
    ledger: StepLedger,
    hparams: OptimizerHParams,
    audit: bool,
) -> CommitRound:
    """Ask every replica of ``peers`` (peer -> the span it commits) to commit, all at once through ``each``
    (``ReplicaSet.each``); ``audit``: every partial sum checked (see ``commit``)."""

    def attempt(peer: PeerID) -> Outcome:
        holders = ledger.wire_holders(peers[peer])
        request = CommitRequest(
            adapter=calls.adapter,
            step=ledger.step,
            ledger=holders,
            hparams=hparams,
            grad_scale=ledger.grad_scale,
            audit=audit,
            holder_maddrs=calls.holder_maddrs(holders),
            reducers=reducers(peers, peers[peer]),
        )
        try:
            return Outcome(Phase.APPLIED, reply=calls.ask(peer, request, floor=commit_floor(request.reducers)))
        except PeerFailure:
            return Outcome(Phase.SILENT)
        except RemoteError as e:
            if e.kind not in (ErrorKind.MISSING_GRADIENTS, ErrorKind.BAD_GRADIENTS):
                raise
            try:
                if e.kind == ErrorKind.BAD_GRADIENTS:
                    return Outcome(Phase.ACCUSING, accused=tuple(bad_holders(e)))
                return Outcome(Phase.LACKING, lacking=missing_gradients(e))
            except ReplyError as bad:  # a garbled refusal: the peer failed, like one that does not answer
                logger.warning("peer %s: %s", peer, bad)
                return Outcome(Phase.SILENT)

    return CommitRound(dict(zip(peers, each(attempt, list(peers)), strict=True)))


def reducers(spans: dict[PeerID, range], blocks: range) -> dict[int, list[str]]:
    """Per block of ``blocks`` committed on at least ``MIN_REDUCERS`` of the replicas asked (``spans``), those
    replicas, sorted: they reduce its gradient in chunks (peers/reduction/scatter.py); fewer exchange partial sums
    directly."""
    found = {}
    for block in blocks:
        serving = sorted(peer.to_base58() for peer, span in spans.items() if block in span)
        if len(serving) >= MIN_REDUCERS:
            found[block] = serving
    return found
