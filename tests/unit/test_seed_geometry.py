"""The seed story's yardstick (swarm/testing/seed.py ``best_doubled``): the most blocks a number of equal spans can give
two servers each, checked against every placement on small swarms, and the seed's own figures."""

from __future__ import annotations

import itertools

import pytest

from swarm.testing.seed import best_doubled


def _brute_force(peers: int, span: int, layers: int) -> int:
    best = 0
    for starts in itertools.combinations_with_replacement(range(layers - span + 1), peers):
        counts = [0] * layers
        for start in starts:
            for block in range(start, start + span):
                counts[block] += 1
        best = max(best, sum(1 for c in counts if c >= 2))
    return best


@pytest.mark.parametrize(
    ("peers", "span", "layers"), [(p, s, n) for n in (4, 7, 9) for s in (1, 2, 3, 4) for p in (1, 2, 3, 4) if s <= n]
)
def test_best_doubled_is_the_best_placement(peers, span, layers):
    assert best_doubled(peers, span, layers) == _brute_force(peers, span, layers)


def test_the_seed_case():
    assert best_doubled(6, 34, 80) == 80  # six spans of 34: every block can have two servers
    assert best_doubled(5, 34, 80) == 68  # five cannot: blocks 34-45 keep one
    assert best_doubled(5, 40, 80) == 80
