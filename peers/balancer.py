"""Which contiguous span of decoder blocks a peer serves: pure decisions over a snapshot of the swarm.

Coverage maps block -> number of OTHER peers serving it (missing keys mean 0). Every decision ranks spans by the
swarm's badness if this peer served them, so all peers optimise the same objective and cannot undo each other's moves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def badness(counts: Sequence[int], replication: int) -> tuple[int, int]:
    """(blocks with no server, total replication deficit): uncovered blocks break training, so they dominate."""
    return sum(1 for c in counts if c == 0), sum(max(0, replication - c) for c in counts)


def coverage_with(coverage: dict[int, int], num_blocks: int, span: range | None) -> list[int]:
    """Per-block server counts if this peer served `span` (None: serves nothing)."""
    span = span or range(0)
    return [coverage.get(b, 0) + (b in span) for b in range(num_blocks)]


def _windows(num_blocks: int, length: int) -> list[range]:
    return [range(s, s + length) for s in range(num_blocks - length + 1)]


def _overlap(a: range, b: range) -> int:
    return max(0, min(a.stop, b.stop) - max(a.start, b.start))


def choose_span(
    coverage: dict[int, int],
    num_blocks: int,
    span_len: int,
    replication: int,
    throughput: dict[int, float] | None = None,
    rng: random.Random | None = None,
) -> range:
    """Start-up span: the window that most reduces badness, then the least loaded one.

    Remaining ties are broken at random so that peers starting at the same moment spread out instead of piling up.
    """
    if num_blocks < 1 or span_len < 1:
        raise ValueError(f"need num_blocks >= 1 and span_len >= 1, got {num_blocks} and {span_len}")
    throughput = throughput or {}

    def key(w: range) -> tuple[tuple[int, int], float]:
        return badness(coverage_with(coverage, num_blocks, w), replication), sum(throughput.get(b, 0.0) for b in w)

    windows = _windows(num_blocks, min(span_len, num_blocks))
    best = min(key(w) for w in windows)
    return (rng or random.Random()).choice([w for w in windows if key(w) == best])


def plan_move(
    coverage: dict[int, int],
    num_blocks: int,
    current: range,
    span_len: int,
    replication: int,
    max_blocks: int | None = None,
) -> range | None:
    """The span to move to, or None to stay.

    A move happens only if it strictly lowers (swarm badness, blocks beyond span_len), since `current` wins all other
    ties. With a consistent view every move lowers that potential, so peers converge instead of oscillating. A peer
    holding more than `max_blocks` (after a takeover) is not allowed to stay and shrinks back to its capacity.
    """
    span_len = min(span_len, num_blocks)
    max_blocks = span_len if max_blocks is None else max_blocks
    candidates = set(_windows(num_blocks, span_len))
    for length in range(span_len + 1, min(max_blocks, num_blocks) + 1):
        candidates.update(
            w for w in _windows(num_blocks, length) if w.start <= current.start and w.stop >= current.stop
        )
    if len(current) <= max_blocks:
        candidates.add(current)

    def key(w: range) -> tuple[tuple[int, int], int, int, int, int]:
        bad = badness(coverage_with(coverage, num_blocks, w), replication)
        return bad, max(0, len(w) - span_len), int(w != current), -_overlap(w, current), w.start

    best = min(candidates, key=key)
    return None if best == current else best


def choose_standby(holders: dict[int, int], serving: range, num_blocks: int, count: int) -> list[int]:
    """Blocks outside `serving` to keep standby adapter state for: the least-held first, so a departure loses least.

    Nearer blocks win ties because a peer extending its span by takeover reaches them first.
    """

    def distance(b: int) -> int:
        return serving.start - b if b < serving.start else b - (serving.stop - 1)

    others = [b for b in range(num_blocks) if b not in serving]
    ranked = sorted(others, key=lambda b: (holders.get(b, 0), distance(b), b))
    return sorted(ranked[: max(0, count)])


def safe_to_drop(block: int, others: list[tuple[str, bool]], my_peer_id: str) -> bool:
    """Whether this peer may stop serving `block` (described by `others`) without leaving it uncovered.

    Safe if another peer stays on it. If all others are leaving too, the mover with the largest id yields, so two
    peers moving away at once never both drop the block.
    """
    return any(not moving or peer_id > my_peer_id for peer_id, moving in others if peer_id != my_peer_id)
