"""The swarm simulation (scripts/simulate_swarm.py), run short: the real balancer under churn, in a few seconds."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID

from peers.placement import planned_throughput, settled_spans
from swarm.client import routing
from swarm.net.protocol import PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView
from swarm.testing import simulation as sim


def test_coverage_recovers_after_bursts_without_oscillation():
    stats = sim.Simulation(sim.SimConfig(peers=100, hours=1.0, seed=5, bursts=2)).run()
    assert stats.failures == []
    assert len(stats.bursts) == 2 and all(b.left >= 10 for b in stats.bursts)
    for burst in stats.bursts:
        assert burst.covered_at is not None and burst.covered_at - burst.at < 120, burst
    assert stats.samples[-1].uncovered == 0 and stats.moves


def test_busy_balancer_never_oscillates():
    # R=3 with ~3.4 servers per block: the balancer moves all the time, many peers at once, each move taking a while.
    stats = sim.Simulation(sim.SimConfig(peers=100, hours=0.5, seed=3, replication=3, bursts=1)).run()
    assert stats.failures == []
    assert len(stats.moves) > 20


@pytest.mark.parametrize("replication", [3, 1])
def test_skipping_idle_rounds_changes_nothing(replication):
    # The fast path (no next_move call while the state has not changed, nor while every block has its replicas,
    # but for the peer relief_move names) must give exactly the run that calls next_move in every round of every
    # peer. R=3 keeps 40 peers short of replicas (rounds for coverage, none for throughput); R=1 gives every block
    # its replicas most of the time, and moves for throughput.
    config = dict(peers=40, hours=0.4, seed=3, bursts=1, replication=replication)
    fast = sim.Simulation(sim.SimConfig(**config)).run()
    exact = sim.Simulation(sim.SimConfig(**config, exact=True)).run()
    assert exact.decisions > 2 * fast.decisions
    assert fast.moves == exact.moves and fast.samples == exact.samples and fast.throughput == exact.throughput
    assert fast.relief == exact.relief and (fast.relief > 0) == (replication == 1)


def test_the_relief_rule_is_the_configured_one():
    # R=1 gives every block its replicas most of the time (moves for throughput happen); a level of 0 relieves no
    # block, and a higher level than the daemon's relieves more.
    config = dict(peers=40, hours=0.4, seed=0, bursts=1, replication=1)
    default = sim.Simulation(sim.SimConfig(**config)).run()
    never = sim.Simulation(sim.SimConfig(**config, relieve_below=0.0)).run()
    eager = sim.Simulation(sim.SimConfig(**config, relieve_below=0.9, min_gain=0.1)).run()
    assert never.relief == 0 < default.relief < eager.relief
    assert never.failures == default.failures == eager.failures == []


class _CheckedSimulation(sim.Simulation):
    """Checks, at every decision, that the simulation's running counts are what the records say."""

    def _decide(self, peer):
        view, settled = self._snapshot()
        blocks = range(self.config.num_blocks)
        coverage, throughput = view.coverage(PeerID(b"nobody")), view.throughput()
        assert self.coverage == [coverage.get(b, 0) for b in blocks]
        assert self.throughput == pytest.approx([throughput.get(b, 0.0) for b in blocks])
        assert self.planned == [settled.pinned.get(b, 0) + sum(b in s for s in settled.spans.values()) for b in blocks]
        planned = planned_throughput(view, self.config.num_blocks)
        assert self._planned_throughput() == pytest.approx([planned[b] for b in blocks])
        return super()._decide(peer)


def test_running_counts_match_the_records():
    stats = _CheckedSimulation(sim.SimConfig(peers=30, hours=0.4, seed=4, replication=3)).run()
    assert stats.decisions > 50 and stats.failures == []


def test_stall_search_finds_none():
    assert sim.stall_search(150, seed=5) == []


def test_stall_search_with_random_speeds_finds_none():
    # Peers also move for throughput: every such move raises the sorted per-block throughputs, and play stops.
    assert sim.stall_search(100, seed=6, random_speeds=True) == []


def _record(
    peer: PeerID, state: ServerState, span: range, moving_to: range | None = None, throughput: float = 0.0
) -> ServerRecord:
    return ServerRecord(peer, state, span.start, span.stop, throughput, moving_to=moving_to)


def test_settled_spans_counts_moving_peers_where_they_go():
    settled, other, joining, moving, dead = (PeerID(bytes([i + 1]) * 8) for i in range(5))
    announced = [  # (record, the blocks it is announced under), as Announcer.records does
        (_record(settled, ServerState.ONLINE, range(0, 2), throughput=30.0), range(0, 2)),
        (_record(other, ServerState.ONLINE, range(0, 1), throughput=50.0), range(0, 1)),
        (_record(joining, ServerState.JOINING, range(2, 4)), range(2, 4)),
        # moving from 4:6 to 5:8, loaded: online with moving_to on its blocks, joining on the blocks it adds
        (_record(moving, ServerState.ONLINE, range(4, 6), range(5, 8), throughput=60.0), range(4, 6)),
        (_record(moving, ServerState.JOINING, range(5, 8), throughput=60.0), range(6, 8)),
        (_record(dead, ServerState.ONLINE, range(0, 8), throughput=99.0), range(0, 8)),  # did not answer the ping
    ]
    records = {b: [record for record, blocks in announced if b in blocks] for b in range(8)}
    alive = {peer: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for peer in (settled, other, joining, moving)}
    view = SwarmView(records, alive)
    spans, pinned, speeds, pinned_throughput = settled_spans(view, 8)
    assert spans == {settled.to_base58(): range(0, 2), other.to_base58(): range(0, 1)}
    assert speeds == {settled.to_base58(): 30.0, other.to_base58(): 50.0}
    assert pinned == {2: 1, 3: 1, 5: 1, 6: 1, 7: 1}  # the moving peer no longer counts on block 4, which it leaves
    # The joining peer has not measured itself: it counts as the median settled peer (40). The moving one keeps its
    # speed, 60 tokens/s through each of 2 blocks, spread over the 3 it moves to.
    assert pinned_throughput == {2: 40.0, 3: 40.0, 5: 40.0, 6: 40.0, 7: 40.0}
    assert planned_throughput(view, 8) == {0: 80.0, 1: 30.0, 2: 40.0, 3: 40.0, 4: 0.0, 5: 40.0, 6: 40.0, 7: 40.0}
    # A peer choosing its span leaves itself out.
    assert planned_throughput(view, 8, exclude=joining)[2] == 0.0


def test_routed_steps_beat_the_widest_chain():
    # Micro-batches routed one by one over replicas finish a step sooner than the best single pipeline could.
    stats = sim.Simulation(sim.SimConfig(peers=100, hours=0.75, seed=0, bursts=0)).run()
    ratios = [t.routed / t.widest for t in stats.throughput if t.widest > 0]
    assert ratios and min(ratios) > 1.0, ratios


def test_a_saturated_stream_following_the_flow_plan_beats_fastest_chains(monkeypatch):
    # Many micro-batches at once: each routed to the chain that finishes it first, long hops on fast peers starve
    # the blocks few peers hold; following the flow plan gives each peer work where it is needed, and 100 peers
    # deliver over 0.8 of the ideal (0.80-0.86 against 0.61-0.69 in seeds 0-3, fill and drain included).
    def stream(seed: int) -> float:
        config = sim.SimConfig(peers=100, hours=0.25, seed=seed, bursts=0, route_s=1e9, stream_s=1e9, stream_waves=4)
        (sample,) = sim.Simulation(config).run().streams
        return sample.routed / sample.ideal

    planned = stream(1)
    monkeypatch.setattr(routing, "SATURATED", float("inf"))  # every micro-batch on its fastest chain
    fastest = stream(1)
    assert planned > 0.8 and planned > fastest + 0.1, (planned, fastest)
