"""The flow plan on hand-made swarms whose largest flow is known: replicas share in proportion to speed, a scarce
block takes a fast peer's time only there, fewer hops when the flow allows, no plan without a server."""

from __future__ import annotations

import random
from collections import defaultdict
from itertools import pairwise

import pytest

from swarm.client.flowplan import SLACK, FlowPlan, Server, plan_flow


def _work(plan: FlowPlan, servers: list[Server]) -> dict[str, float]:
    """Share of its time each server works under the plan."""
    seconds = {s.peer: s.block_seconds for s in servers}
    work: dict[str, float] = defaultdict(float)
    for chain in plan.chains:
        for peer, a, c in chain.hops:
            work[peer] += chain.rate * (c - a) * seconds[peer]
    return dict(work)


def _check_chains(plan: FlowPlan, servers: list[Server], start: int, end: int) -> None:
    """Every chain runs through every block once, on servers that hold its hops; no server works over its time."""
    spans = {s.peer: (s.start, s.end) for s in servers}
    for chain in plan.chains:
        assert chain.hops[0][1] == start and chain.hops[-1][2] == end
        assert all(left[2] == right[1] for left, right in pairwise(chain.hops))
        assert all(spans[peer][0] <= a < c <= spans[peer][1] for peer, a, c in chain.hops)
    assert plan.rate == pytest.approx(sum(chain.rate for chain in plan.chains))
    assert all(share <= 1 + 1e-6 for share in _work(plan, servers).values())


def test_replicas_of_one_span_share_in_proportion_to_speed():
    # 2 blocks each; 1 s, 2 s and 4 s per block: 0.5, 0.25 and 0.125 micro-batches/s
    servers = [Server("a", 0, 2, 1.0), Server("b", 0, 2, 2.0), Server("c", 0, 2, 4.0)]
    plan = plan_flow(servers, 0, 2)
    _check_chains(plan, servers, 0, 2)
    assert plan.rate == pytest.approx(0.875, rel=1e-6)
    rates = {chain.hops[0][0]: chain.rate for chain in plan.chains}
    assert rates == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.125}, rel=1e-6)


def test_a_scarce_block_takes_the_fast_peers_time_only_there():
    # Block 3 is only on the fast peer (0.1 s a block); the slow one (1 s a block) holds 0:3. Its 1/3 micro-batch/s
    # through 0:3 costs the fast peer 0.1 s each at block 3; the fast peer spends the rest on whole micro-batches
    # (0.4 s each): r + 0.1/3 = 1 - 0.3r... r = (1 - 1/30) / 0.4, 2.75 in all. The fastest chain alone is the fast
    # peer's 0:4, 2.5 micro-batches/s.
    servers = [Server("fast", 0, 4, 0.1), Server("slow", 0, 3, 1.0)]
    plan = plan_flow(servers, 0, 4)
    _check_chains(plan, servers, 0, 4)
    assert plan.rate == pytest.approx(2.75, rel=SLACK)
    assert _work(plan, servers) == pytest.approx({"fast": 1.0, "slow": 1.0}, abs=SLACK)


def test_blocks_split_between_two_peers_run_in_one_pipeline():
    # a holds 0:4 and b 2:4, both 1 s a block: a alone carries 1/4 micro-batch/s; a taking 0:2 and b 2:4 of each,
    # 2 s apiece, they carry 1/2 (any micro-batch a takes whole costs it 4 s that would carry two split ones)
    servers = [Server("a", 0, 4, 1.0), Server("b", 2, 4, 1.0)]
    plan = plan_flow(servers, 0, 4)
    _check_chains(plan, servers, 0, 4)
    assert plan.rate == pytest.approx(0.5, rel=SLACK)
    assert [chain.hops for chain in plan.chains] == [(("a", 0, 2), ("b", 2, 4))]


def test_fewest_hops_among_flows_as_large():
    # Three peers hold all 4 blocks at the same speed: one hop per micro-batch carries as much as any split, and each
    # hop is a transfer and a wait, so every chain is one hop.
    servers = [Server(name, 0, 4, 0.5) for name in "abc"]
    plan = plan_flow(servers, 0, 4)
    _check_chains(plan, servers, 0, 4)
    assert plan.rate == pytest.approx(1.5, rel=SLACK)
    assert all(len(chain.hops) == 1 for chain in plan.chains)


def test_a_part_of_the_blocks_is_planned_over_the_servers_that_reach_it():
    servers = [Server("a", 0, 6, 1.0), Server("b", 3, 6, 1.0)]
    plan = plan_flow(servers, 3, 6)  # a chain that starts at block 3 (the client already did 0:3)
    _check_chains(plan, servers, 3, 6)
    assert plan.rate == pytest.approx(2 / 3, rel=SLACK)


def test_no_plan_when_a_block_has_no_server():
    assert plan_flow([Server("a", 0, 2, 1.0), Server("b", 3, 4, 1.0)], 0, 4) is None
    assert plan_flow([], 0, 4) is None
    assert plan_flow([Server("a", 0, 4, 0.0)], 0, 4) is None  # no speed known: nothing to plan with


def test_random_swarms_get_valid_plans_at_least_as_large_as_the_best_single_server_mix():
    rng = random.Random(0)
    for _ in range(30):
        servers = []
        for i in range(rng.randrange(2, 12)):
            a = rng.randrange(0, 8)
            servers.append(Server(i, a, rng.randrange(a + 1, 9), rng.choice([0.1, 0.25, 0.5, 1.0])))
        plan = plan_flow(servers, 0, 8)
        if any(not any(s.start <= b < s.end for s in servers) for b in range(8)):
            assert plan is None
            continue
        _check_chains(plan, servers, 0, 8)
        # a lower bound: each block's servers each give it a 1/(#blocks they hold) share of their time
        rates = [(s.start, s.end, 1 / ((s.end - s.start) * s.block_seconds)) for s in servers]
        even = [sum(rate for a, c, rate in rates if a <= b < c) for b in range(8)]
        assert plan.rate >= (1 - SLACK) * min(even) - 1e-9
