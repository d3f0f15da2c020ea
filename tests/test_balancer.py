"""Unit tests for the block balancer: pure functions, no processes."""

from __future__ import annotations

import random

import pytest

from peers.balancer import badness, choose_span, choose_standby, coverage_with, plan_move, safe_to_drop


def test_badness_counts_uncovered_then_deficit():
    assert badness([0, 1, 2, 3], 2) == (1, 3)
    assert badness([2, 2], 2) == (0, 0)
    assert badness([0, 0], 1) == (2, 2)


def test_coverage_with_adds_this_peer():
    assert coverage_with({0: 1, 3: 2}, 4, range(1, 3)) == [1, 1, 1, 2]
    assert coverage_with({0: 1, 3: 2}, 4, None) == [1, 0, 0, 2]


def test_choose_span_prefers_uncovered_window():
    # Blocks 0..3 have one server each, 4..5 none: only range(4, 6) covers two holes.
    cov = {0: 1, 1: 1, 2: 1, 3: 1}
    assert choose_span(cov, 6, 2, 2, rng=random.Random(0)) == range(4, 6)


def test_choose_span_uncovered_beats_deficit():
    # R=3: [0, 2) cuts the deficit most (blocks 0..1 have one server), but [4, 6) covers the hole at block 5.
    cov = {0: 1, 1: 1, 2: 3, 3: 3, 4: 3}
    assert choose_span(cov, 6, 2, 3, rng=random.Random(0)) == range(4, 6)


def test_choose_span_prefers_most_under_replicated():
    # Everything covered; blocks 2..3 have one server, the rest two (R=2).
    cov = {0: 2, 1: 2, 2: 1, 3: 1, 4: 2, 5: 2}
    assert choose_span(cov, 6, 2, 2, rng=random.Random(0)) == range(2, 4)


def test_choose_span_prefers_lowest_throughput():
    cov = {b: 2 for b in range(6)}
    tput = {0: 100.0, 1: 100.0, 2: 50.0, 3: 50.0, 4: 10.0, 5: 10.0}
    for seed in range(10):
        assert choose_span(cov, 6, 2, 2, throughput=tput, rng=random.Random(seed)) == range(4, 6)


def test_choose_span_random_ties_spread_out():
    spans = {choose_span({}, 8, 2, 2, rng=random.Random(seed)) for seed in range(20)}
    assert len(spans) > 1
    assert all(len(s) == 2 and 0 <= s.start and s.stop <= 8 for s in spans)


def test_choose_span_clips_span_len():
    assert choose_span({}, 3, 10, 2, rng=random.Random(0)) == range(0, 3)


def test_plan_move_to_uncovered():
    # Another peer shares [0, 2) with A; nobody serves [2, 4).
    assert plan_move({0: 1, 1: 1}, 4, range(0, 2), 2, 2) == range(2, 4)


def test_plan_move_alone_stays_or_extends():
    # A alone on [0, 2), nobody on [2, 4): any 2-window leaves two holes, so moving gains nothing.
    assert plan_move({}, 4, range(0, 2), 2, 2, max_blocks=2) is None
    assert plan_move({}, 4, range(0, 2), 2, 2) is None
    # With memory for 4 blocks, A takes over the holes by extending.
    assert plan_move({}, 4, range(0, 2), 2, 2, max_blocks=4) == range(0, 4)


def test_plan_move_balanced_stays():
    assert plan_move({0: 1, 1: 1, 2: 2, 3: 2}, 4, range(0, 2), 2, 2) is None
    assert plan_move({0: 1, 1: 1, 2: 2, 3: 2}, 4, range(0, 2), 2, 2, max_blocks=4) is None


def test_plan_move_shrinks_over_capacity():
    # A took over [2, 4) earlier; now another peer serves it, and A may hold only 2 blocks.
    assert plan_move({2: 1, 3: 1}, 4, range(0, 4), 2, 2, max_blocks=2) == range(0, 2)


def test_plan_move_no_extension_without_gain():
    # A can hold 4 blocks, but [2, 4) is already well served: extending only costs memory.
    assert plan_move({0: 1, 1: 1, 2: 2, 3: 2}, 4, range(0, 2), 2, 2, max_blocks=4) is None


def test_plan_move_does_not_shift_deficit():
    # A, B on [0, 2), C on [2, 4): every 2-window leaves the same deficit, so A stays.
    assert plan_move({0: 1, 1: 1, 2: 1, 3: 1}, 4, range(0, 2), 2, 2) is None


def test_plan_move_prefers_overlap_then_start():
    # Block 2 is uncovered; from [3, 5), windows [1, 3) and [2, 4) both fix it: [2, 4) keeps more of A's blocks.
    cov = {0: 2, 1: 2, 3: 2, 4: 2, 5: 2}
    assert plan_move(cov, 6, range(3, 5), 2, 2) == range(2, 4)
    # [2, 4), [3, 5) and [4, 6) tie with no overlap: the lowest start wins, deterministically.
    assert plan_move({0: 1, 1: 1}, 6, range(0, 2), 2, 1) == range(2, 4)


def test_plan_move_prefers_moving_over_growing():
    # B shares [0, 2) with A; moving to [2, 4) and extending to [0, 4) both cover everything: moving costs no memory.
    assert plan_move({0: 1, 1: 1}, 4, range(0, 2), 2, 1, max_blocks=4) == range(2, 4)


def test_plan_move_extends_only_around_current():
    # A 3-window [3, 6) would cover most, but it does not contain A's blocks: only a plain 2-window move is allowed.
    assert plan_move({0: 1, 1: 1}, 6, range(0, 2), 2, 1, max_blocks=3) == range(2, 4)


def test_plan_move_short_span_stays_without_gain():
    # A serves a single block; growing to a full window gains nothing, so A does not move.
    assert plan_move({0: 5, 1: 5, 2: 5}, 3, range(1, 2), 2, 2) is None


def _converge(
    spans: list[range], num_blocks: int, span_len: int, replication: int, max_rounds: int = 50
) -> list[range]:
    for _ in range(max_rounds):
        changed = False
        for i, span in enumerate(spans):
            cov: dict[int, int] = {}
            for j, other in enumerate(spans):
                if j != i:
                    for b in other:
                        cov[b] = cov.get(b, 0) + 1
            target = plan_move(cov, num_blocks, span, span_len, replication)
            if target is not None:
                spans[i] = target
                changed = True
        if not changed:
            return spans
    pytest.fail(f"no convergence after {max_rounds} rounds: {spans}")


def _swarm_badness(spans: list[range], num_blocks: int, replication: int) -> tuple[int, int]:
    return badness([sum(b in s for s in spans) for b in range(num_blocks)], replication)


def test_simulation_converges_and_covers():
    spans = _converge([range(0, 2)] * 3, 6, 2, 1)
    assert _swarm_badness(spans, 6, 1) == (0, 0), spans
    assert sorted(s.start for s in spans) == [0, 2, 4]


def test_simulation_converges_from_random_starts():
    # Single moves may stop at a local optimum, but they must settle and never make the swarm worse.
    rng = random.Random(1)
    for _ in range(100):
        spans = [range(s, s + 2) for s in (rng.randrange(7) for _ in range(4))]
        before = _swarm_badness(spans, 8, 2)
        assert _swarm_badness(_converge(spans, 8, 2, 2), 8, 2) <= before


def test_choose_standby_orders_and_excludes_served():
    holders = {0: 1, 1: 1, 2: 3, 3: 3, 4: 0, 5: 2, 6: 2, 7: 0}
    # Served: [2, 4). Fewest holders: 4 and 7 (0), then 0, 1 (1), then 5, 6 (2).
    assert choose_standby(holders, range(2, 4), 8, 2) == [4, 7]
    # Tie between 0 and 1 at one holder: 1 is nearer to [2, 4).
    assert choose_standby(holders, range(2, 4), 8, 3) == [1, 4, 7]
    # Tie between 5 and 6: 5 is nearer.
    assert choose_standby(holders, range(2, 4), 8, 5) == [0, 1, 4, 5, 7]
    assert choose_standby(holders, range(2, 4), 8, 100) == [0, 1, 4, 5, 6, 7]
    assert choose_standby(holders, range(2, 4), 8, 0) == []


def test_choose_standby_ties_by_distance_then_index():
    # All blocks equally held; served [3, 5): blocks 2 and 5 are both at distance 1, then 1 and 6.
    assert choose_standby({}, range(3, 5), 8, 2) == [2, 5]
    assert choose_standby({}, range(3, 5), 8, 3) == [1, 2, 5]


def test_safe_to_drop():
    assert safe_to_drop(0, [("b", False)], "c") is True
    assert safe_to_drop(0, [("z", True)], "m") is True
    assert safe_to_drop(0, [("a", True)], "m") is False
    assert safe_to_drop(0, [], "m") is False
    assert safe_to_drop(0, [("a", True), ("b", False)], "m") is True
    # Two movers: exactly one of them may go.
    assert safe_to_drop(0, [("b", True)], "a") != safe_to_drop(0, [("a", True)], "b")
