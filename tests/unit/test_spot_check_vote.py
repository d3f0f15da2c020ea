"""A spot check that cannot decide must not take a liar's result: replicas too slow to answer are asked again, and
two that disagree with no third answer make the hop fail (it is redone), never pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerFailure
from swarm.client.remote import RemoteStack
from swarm.client.routing import Hop

LIAR, HONEST, SLOW = (PeerID(f"peer-{name}".encode()) for name in ("liar", "honest", "slow"))
TRUTH, LIE = torch.ones(3), torch.full((3,), 5.0)


class Peers:
    """The calls and router a RemoteStack consults: three replicas of blocks 0:2; bans recorded."""

    def __init__(self):
        self.banned: list[PeerID] = []
        self.distrusted: list[PeerID] = []
        record = lambda peer: SimpleNamespace(peer_id=peer, start=0, end=2)  # noqa: E731
        self.router = SimpleNamespace(
            replicas=lambda block: [record(LIAR), record(HONEST), record(SLOW)],
            ban=lambda peer, reason: self.banned.append(peer),
            distrust=lambda peer, reason: self.distrusted.append(peer),
            num_blocks=2,
        )
        self.current = SimpleNamespace(forget=lambda peer: None)
        self.adapter, self.wire = "a", None

    def peer_failed(self, peer: PeerID, reason: str) -> PeerFailure:
        self.banned.append(peer)
        return PeerFailure(peer, reason)


def redo_failing(times: dict[PeerID, int]):
    """Each replica's honest result, after failing (a timeout) its first ``times[peer]`` calls."""

    def redo(peer: PeerID) -> torch.Tensor:
        if times.get(peer, 0) > 0:
            times[peer] -= 1
            raise PeerFailure(peer, "timed out")
        return TRUTH.clone()

    return redo


def stack(peers: Peers) -> RemoteStack:
    return RemoteStack(peers, catch_up=lambda: None, spot_check=1.0, min_voters=3)


def test_a_replica_that_timed_out_is_asked_again_and_the_liar_outvoted():
    peers = Peers()
    hops = stack(peers)
    result, chosen = hops._spot_check(Hop(LIAR, 0, 2), LIE, redo_failing({SLOW: 2, HONEST: 1}), rate=1.0)
    assert torch.equal(result, TRUTH) and chosen in (HONEST, SLOW)
    assert hops.dishonest == [LIAR]


def test_two_that_disagree_with_no_third_answer_fail_the_hop_instead_of_passing_it():
    peers = Peers()
    hops = stack(peers)
    with pytest.raises(PeerFailure, match="could not decide"):
        hops._spot_check(Hop(LIAR, 0, 2), LIE, redo_failing({SLOW: 99}), rate=1.0)
    assert hops.dishonest == [] and LIAR in peers.banned  # banned for a while only: nobody was proven wrong
