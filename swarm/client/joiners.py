"""Replicas that joined since the last vote are compared with those they join before a step routes through any.

A replica's state is voted on at every commit it applies, after the step. One that serves a span alone commits
unopposed: a liar first and only server of its span alters its state after a step and nobody sees it (its
activations and gradients stay honest). Honest replicas that join it later do not take its state (peers/transfer.py
checks a pulled state against its server's own update), so the next step would run through two states; the vote
after that step bans the liar, too late: the step's micro-batches ran through its altered blocks and every block's
gradients of the step are off. So at each step's start the client compares the digests of the current replicas of
every block a joiner serves, and bans the outvoted as the vote does, before any micro-batch is routed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from swarm.client.calls import PeerFailure
from swarm.client.commit import ReplicaSet
from swarm.client.trust import Trust
from swarm.client.votes import tally
from swarm.net.errors import RemoteError
from swarm.net.protocol import DigestRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Judgement:
    """The current replicas after a comparison (all judged now), and the blocks whose replicas disagree with no
    majority (two that differ, nobody to break the tie yet)."""

    judged: set[PeerID]
    undecided: list[int] = field(default_factory=list)


def judge_joiners(trust: Trust, replicas: ReplicaSet, step: int, judged: Iterable[PeerID]) -> Judgement:
    """Compare the current replicas at ``step`` of every block that a replica not in ``judged`` (it was not in the
    last vote) serves, and ban those outvoted."""
    current = replicas.peers(step)
    joined = {p: span for p, span in current.items() if p not in set(judged)}
    blocks = {b for span in joined.values() for b in span}
    undecided: list[int] = []
    if blocks:
        voters = [p for p, span in current.items() if blocks.intersection(span)]
        digests = _digests(trust, replicas, {p: current[p] for p in voters})
        for block in sorted(blocks):  # where this client declared a survivor current, the others take its state
            opinions = {p: held[block] for p, held in digests.items() if block in held}
            for peer, digest in replicas.realign(block, step, opinions).items():
                digests[peer] = {**digests[peer], block: digest}
        outvoted, undecided = _outvoted(digests, sorted(blocks))
        for peer, block in outvoted.items():
            reason = f"its state of block {block} at step {step} disagrees with the majority of its replicas'"
            trust.ban_dishonest(peer, reason)
            replicas.standby.pop(peer, None)
    return Judgement(set(replicas.peers(step)), undecided)


def _digests(trust: Trust, replicas: ReplicaSet, spans: Mapping[PeerID, range]) -> dict[PeerID, dict[int, str]]:
    """Each replica's state digests of the blocks of its span, asked of all at once; one that does not answer is
    left out (it is not judged on nothing)."""
    calls = trust.calls

    def ask(peer: PeerID) -> dict[int, str] | None:
        try:
            digests = calls.ask(peer, DigestRequest(adapter=calls.adapter)).digests
        except (PeerFailure, RemoteError) as e:
            logger.warning("peer %s could not report its digests: %s", peer, e)
            return None
        return {b: digests.get(b, "") for b in spans[peer]}  # none for a block it serves: a digest nobody else has

    peers = list(spans)
    return {p: d for p, d in zip(peers, replicas.each(ask, peers), strict=True) if d is not None}


def _outvoted(digests: Mapping[PeerID, Mapping[int, str]], blocks: list[int]) -> tuple[dict[PeerID, int], list[int]]:
    """Per replica outvoted on some of ``blocks``, the first such block; and the blocks where two that disagree
    stay, with no majority."""
    outvoted: dict[PeerID, int] = {}
    undecided = []
    for block in blocks:
        verdict = tally({p: held[block] for p, held in digests.items() if block in held})
        if verdict.undecided:
            logger.warning("replicas of block %d hold different states and no majority decides", block)
            undecided.append(block)
        for peer in verdict.outvoted:
            outvoted.setdefault(peer, block)
    return outvoted, undecided
