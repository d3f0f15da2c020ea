"""The swarm simulation (scripts/simulate_swarm.py), run short: the real balancer under churn, in a few seconds."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID

from peers.daemon import settled_spans
from swarm.net.protocol import PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView
from swarm.testing import simulation as sim


def test_coverage_recovers_after_bursts_without_oscillation():
    stats = sim.Simulation(sim.SimConfig(peers=100, hours=1.0, seed=1, bursts=2)).run()
    assert stats.failures == []
    assert len(stats.bursts) == 2 and all(b.left >= 10 for b in stats.bursts)
    for burst in stats.bursts:
        assert burst.covered_at is not None and burst.covered_at - burst.at < 120, burst
    assert stats.samples[-1].uncovered == 0 and stats.moves


def test_busy_balancer_never_oscillates():
    # R=3 with ~3.4 servers per block: the balancer moves all the time, many peers at once, each move taking a while.
    stats = sim.Simulation(sim.SimConfig(peers=100, hours=0.5, seed=2, replication=3, bursts=1)).run()
    assert stats.failures == []
    assert len(stats.moves) > 20


def test_skipping_idle_rounds_changes_nothing():
    # The fast path (no next_move call while every block has its replicas, or the state has not changed) must give
    # exactly the run that calls next_move in every round of every peer.
    config = dict(peers=40, hours=0.4, seed=3, bursts=1, replication=3)
    fast = sim.Simulation(sim.SimConfig(**config)).run()
    exact = sim.Simulation(sim.SimConfig(**config, exact=True)).run()
    assert exact.decisions > 2 * fast.decisions
    assert fast.moves == exact.moves and fast.samples == exact.samples and fast.throughput == exact.throughput


class _CheckedSimulation(sim.Simulation):
    """Checks, at every decision, that the simulation's running counts are what the records say."""

    def _decide(self, peer):
        view, (spans, pinned) = self._snapshot()
        blocks = range(self.config.num_blocks)
        coverage, throughput = view.coverage(PeerID(b"nobody")), view.throughput()
        assert self.coverage == [coverage.get(b, 0) for b in blocks]
        assert self.throughput == pytest.approx([throughput.get(b, 0.0) for b in blocks])
        assert self.planned == [pinned.get(b, 0) + sum(b in s for s in spans.values()) for b in blocks]
        return super()._decide(peer)


def test_running_counts_match_the_records():
    stats = _CheckedSimulation(sim.SimConfig(peers=30, hours=0.5, seed=4, replication=3)).run()
    assert stats.decisions > 50 and stats.failures == []


def test_stall_search_finds_none():
    assert sim.stall_search(150, seed=5) == []


def _record(peer: PeerID, state: ServerState, span: range, moving_to: range | None = None) -> ServerRecord:
    return ServerRecord(peer, state, span.start, span.stop, 1.0, moving_to=moving_to)


def test_settled_spans_counts_moving_peers_where_they_go():
    settled, joining, moving, dead = (PeerID(bytes([i + 1]) * 8) for i in range(4))
    announced = [  # (record, the blocks it is announced under), as PeerDaemon._records does
        (_record(settled, ServerState.ONLINE, range(0, 2)), range(0, 2)),
        (_record(joining, ServerState.JOINING, range(2, 4)), range(2, 4)),
        # moving from 4:6 to 5:7, loaded: online with moving_to on its blocks, joining on the block it adds
        (_record(moving, ServerState.ONLINE, range(4, 6), moving_to=range(5, 7)), range(4, 6)),
        (_record(moving, ServerState.JOINING, range(5, 7)), range(6, 7)),
        (_record(dead, ServerState.ONLINE, range(0, 8)), range(0, 8)),  # did not answer the ping
    ]
    records = {b: [record for record, blocks in announced if b in blocks] for b in range(8)}
    alive = {peer: PeerInfo("m", 0, 0, "online", 1.0, {}, []) for peer in (settled, joining, moving)}
    spans, pinned = settled_spans(SwarmView(records, alive), 8)
    assert spans == {settled.to_base58(): range(0, 2)}
    assert pinned == {2: 1, 3: 1, 5: 1, 6: 1}  # the moving peer no longer counts on block 4, which it leaves


def test_routed_steps_beat_the_widest_chain():
    # Micro-batches routed one by one over replicas finish a step sooner than the best single pipeline could.
    stats = sim.Simulation(sim.SimConfig(peers=100, hours=0.75, seed=0, bursts=0)).run()
    ratios = [t.routed / t.widest for t in stats.throughput if t.widest > 0]
    assert ratios and min(ratios) > 1.0, ratios
