"""A spot check that cannot decide must not take a liar's result: replicas too slow to answer are asked again, and
two that disagree with no third answer make the hop fail (it is redone), never pass. Replicas of other numerics
(swarm/net/numerics.py) are compared at the tolerance their announced errors give, replicas of one class tightly: an
honest quantized replica is never outvoted, a liar inside its class or just above the exact class's rounding is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerFailure
from swarm.client.routing import Hop
from swarm.client.trust import Trust
from swarm.net.compression import WireFormat
from swarm.net.numerics import EXACT, Numerics

LIAR, HONEST, SLOW = (PeerID(f"peer-{name}".encode()) for name in ("liar", "honest", "slow"))
TRUTH, LIE = torch.ones(3), torch.full((3,), 5.0)
NF4 = Numerics("nf4", "float32", "cpu", {0: 0.3, 1: 0.3})  # errors of NF4 on a tiny model's blocks
INT8 = Numerics("int8", "float32", "cpu", {0: 0.02, 1: 0.03})


class Peers:
    """The calls and router a Trust consults: three replicas of blocks 0:2 (``numerics``: of each, exact
    fp32 by default); bans recorded."""

    def __init__(self, numerics: dict[PeerID, Numerics] | None = None):
        self.banned: list[PeerID] = []
        self.distrusted: list[PeerID] = []
        numerics = numerics or {}
        record = lambda peer: SimpleNamespace(peer_id=peer, start=0, end=2, numerics=numerics.get(peer, EXACT))  # noqa: E731
        self.router = SimpleNamespace(
            replicas=lambda block, eligible_only=True: [record(LIAR), record(HONEST), record(SLOW)],
            ban=lambda peer, reason: self.banned.append(peer),
            distrust=lambda peer, reason: self.distrusted.append(peer),
            num_blocks=2,
        )
        self.current = SimpleNamespace(forget=lambda peer: None)
        self.adapter, self.wire = "a", WireFormat()

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


def trust(peers: Peers) -> Trust:
    return Trust(peers, spot_check=1.0, min_voters=3)


def test_a_replica_that_timed_out_is_asked_again_and_the_liar_outvoted():
    peers = Peers()
    hops = trust(peers)
    result, chosen = hops.check(Hop(LIAR, 0, 2), LIE, redo_failing({SLOW: 2, HONEST: 1}), rate=1.0)
    assert torch.equal(result, TRUTH) and chosen in (HONEST, SLOW)
    assert hops.dishonest == [LIAR]


def test_two_that_disagree_with_no_third_answer_fail_the_hop_instead_of_passing_it():
    peers = Peers()
    hops = trust(peers)
    with pytest.raises(PeerFailure, match="could not decide"):
        hops.check(Hop(LIAR, 0, 2), LIE, redo_failing({SLOW: 99}), rate=1.0)
    assert hops.dishonest == [] and LIAR in peers.banned  # banned for a while only: nobody was proven wrong


def results(by_peer: dict[PeerID, torch.Tensor]):
    return lambda peer: by_peer[peer].clone()


def test_an_honest_nf4_replica_beside_two_exact_ones_is_never_outvoted():
    """NF4's honest error on these blocks is far beyond what a comparison with fp32 can judge: its result is not
    used (the two exact replicas agree), and nobody is banned."""
    nf4_result = TRUTH * 1.3
    hops = trust(Peers({LIAR: NF4}))
    result, chosen = hops.check(Hop(LIAR, 0, 2), nf4_result, results({HONEST: TRUTH, SLOW: TRUTH}), rate=1.0)
    assert hops.dishonest == [] and chosen in (HONEST, SLOW) and torch.equal(result, TRUTH)


def test_an_int8_replica_within_its_announced_error_passes_and_one_beyond_it_is_outvoted():
    honest, lying = TRUTH * 1.04, TRUTH * 1.5  # int8's announced error on 0:2 is 0.05: within 2x, and far beyond
    hops = trust(Peers({LIAR: INT8}))
    result, chosen = hops.check(Hop(LIAR, 0, 2), honest, results({HONEST: TRUTH, SLOW: TRUTH}), rate=1.0)
    assert hops.dishonest == [] and chosen == LIAR and torch.equal(result, honest)
    result, chosen = hops.check(Hop(LIAR, 0, 2), lying, results({HONEST: TRUTH, SLOW: TRUTH}), rate=1.0)
    assert hops.dishonest == [LIAR] and chosen in (HONEST, SLOW)


def test_a_liar_inside_the_nf4_class_is_outvoted_by_its_class():
    """Off by 1e-3: a hundredth of NF4's error against fp32, but NF4 replicas compute the same dequantized weights."""
    hops = trust(Peers(dict.fromkeys((LIAR, HONEST, SLOW), NF4)))
    hops.check(Hop(LIAR, 0, 2), TRUTH * 1.001, results({HONEST: TRUTH, SLOW: TRUTH}), rate=1.0)
    assert hops.dishonest == [LIAR]


def test_a_liar_just_above_the_rounding_of_the_exact_class_is_outvoted():
    hops = trust(Peers())
    hops.check(Hop(LIAR, 0, 2), TRUTH * (1 + 1e-4), results({HONEST: TRUTH, SLOW: TRUTH}), rate=1.0)
    assert hops.dishonest == [LIAR]


def test_the_rounding_of_other_kernels_passes():
    hops = trust(Peers())
    rounded = TRUTH * (1 + 2e-6)  # default vs AVX2 kernels differ by about 1e-6 per block
    result, chosen = hops.check(Hop(LIAR, 0, 2), rounded, results({HONEST: TRUTH, SLOW: TRUTH}), rate=1.0)
    assert hops.dishonest == [] and chosen == LIAR


def test_replicas_of_the_hops_class_are_asked_first():
    """A hop on an NF4 peer is checked by its NF4 mate before the exact replica: the tight comparison decides."""
    asked: list[PeerID] = []

    def redo(peer: PeerID) -> torch.Tensor:
        asked.append(peer)
        return TRUTH.clone()

    hops = trust(Peers({LIAR: NF4, SLOW: NF4}))
    for _ in range(20):
        asked.clear()
        hops.check(Hop(LIAR, 0, 2), TRUTH.clone(), redo, rate=1.0)
        assert asked == [SLOW]
