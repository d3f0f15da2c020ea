"""The replicas' vote at the end of a commit (``swarm.client.commit._vote``), on hand-made replies: a replica that
moved onto other blocks in the middle of a commit is asked for its digests again, not judged by its old reply."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

from swarm.client.commit import _vote
from swarm.net.errors import ReplicasDisagreeError
from swarm.net.protocol import CommitReply, DigestReply, DigestRequest

STEP = 5
MOVER, SERVER = PeerID(b"mover" * 7), PeerID(b"server" * 6)


def _swarm(digests_now: dict[PeerID, dict[int, str]]):
    """A client over 6 blocks whose peers answer a DigestRequest with ``digests_now``; no standby copy holder."""
    asked: list[PeerID] = []

    def ask(peer, request, **kwargs):
        assert isinstance(request, DigestRequest)
        asked.append(peer)
        return DigestReply(digests_now[peer])

    calls = SimpleNamespace(ask=ask, adapter="a", router=SimpleNamespace(num_blocks=6))
    hops = SimpleNamespace(calls=calls, dishonest=set(), ban_dishonest=lambda peer, reason: None)
    taken_back: list[PeerID] = []
    replicas = SimpleNamespace(
        standby={},
        standby_holders=lambda block, step: [],
        take_back=lambda peers, step: taken_back.extend(peers),
        realign=lambda block, step, opinions: {},  # no survivor declared current
    )
    return hops, replicas, SimpleNamespace(step=STEP), asked, taken_back


def test_a_replica_that_moved_in_the_middle_of_the_commit_is_asked_for_its_new_blocks_digests():
    """The mover replied while it served 3:6, then took 0:3 over from a copy already past the step: counted on 0:3,
    it agrees with the other server of 0:3 once asked; read from its old reply, it had no digest there."""
    after = {0: "d0", 1: "d1", 2: "d2"}
    hops, replicas, ledger, asked, taken_back = _swarm({MOVER: after})
    votes = {
        MOVER: CommitReply({3: STEP + 1, 4: STEP + 1, 5: STEP + 1}, {3: "d3", 4: "d4", 5: "d5"}),
        SERVER: CommitReply({b: STEP + 1 for b in after}, after),
    }
    applied = {MOVER: range(0, 3), SERVER: range(0, 3)}
    kept = _vote(hops, replicas, ledger, None, applied, votes)
    assert asked == [MOVER] and taken_back == [] and set(kept) == {MOVER, SERVER}


def test_a_replica_that_still_reports_no_digest_for_a_block_it_applied_disagrees():
    """Asked again, a replica that gives no digest of a block it counts for holds a state nobody else has."""
    hops, replicas, ledger, asked, taken_back = _swarm({MOVER: {3: "d3"}})
    votes = {
        MOVER: CommitReply({3: STEP + 1}, {3: "d3"}),
        SERVER: CommitReply({b: STEP + 1 for b in range(3)}, {0: "d0", 1: "d1", 2: "d2"}),
    }
    applied = {MOVER: range(0, 3), SERVER: range(0, 3)}
    with pytest.raises(ReplicasDisagreeError):
        _vote(hops, replicas, ledger, None, applied, votes)
    assert asked == [MOVER] and sorted(taken_back, key=str) == sorted([MOVER, SERVER], key=str)
