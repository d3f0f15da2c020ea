"""The step-time model the simulation measures routes by (swarm/testing/steps.py): hand-made chains, known times."""

from __future__ import annotations

import pytest

from swarm.testing.steps import step_seconds


def test_one_peer_does_every_micro_batch_in_turn_whatever_is_in_flight():
    # forward 1 s, backward 2 s: 3 s a micro-batch, and the peer works on one hop at a time
    for in_flight in (1, 2, 4):
        assert step_seconds(lambda at: [("a", 1.0)], 4, in_flight) == pytest.approx(12.0)


def test_replicas_share_the_micro_batches_in_flight():
    chains = iter([[("a", 1.0)], [("b", 1.0)]] * 2)
    assert step_seconds(lambda at: next(chains), 4, 2) == pytest.approx(6.0)


def test_a_chain_costs_its_latency_forward_and_back():
    assert step_seconds(lambda at: [("a", 1.0), ("b", 1.0)], 1, 1) == pytest.approx(6.0)  # 1 + 1, then 2 + 2


def test_each_micro_batch_is_routed_when_it_starts():
    starts = []

    def chain_at(at: float) -> list[tuple[str, float]]:
        starts.append(at)
        return [("a", 1.0)]

    step_seconds(chain_at, 3, 1)
    assert starts == pytest.approx([0.0, 3.0, 6.0])


def test_nothing_to_run_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        step_seconds(lambda at: [("a", 1.0)], 0, 1)
