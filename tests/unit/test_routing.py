"""Route choice on hand-made swarms whose fastest chain is known: speed, hops, measured speed, work in flight."""

from __future__ import annotations

from collections import Counter

from hivemind.p2p import PeerID

from swarm.client.paths import Candidate, fastest_chain
from swarm.client.routing import Router
from swarm.net.protocol import Method
from swarm.net.records import ServerRecord, ServerState
from swarm.net.transport import Transport


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _peer(i: int) -> PeerID:
    return PeerID(bytes([i]) * 34)


def _router(spans: dict[int, tuple[int, int, float]], num_blocks: int, **options) -> Router:
    """Peers i -> (start, end, tokens/s through their span); micro-batches of 100 tokens, 10 ms per hop."""
    options = {"tokens": 100, "hop_seconds": 0.01, "work_per_forward": 1.0, "seed": 0, **options}
    router = Router(None, Transport(p2p=None), "m", num_blocks, **options)
    records = [ServerRecord(_peer(i), ServerState.ONLINE, s, e, t) for i, (s, e, t) in spans.items()]
    router.servers = {b: [r for r in records if r.start <= b < r.end] for b in range(num_blocks)}
    return router


def _chain(router: Router, **kwargs) -> list[tuple[int, int, int]]:
    return [(h.peer_id.to_bytes()[0], h.start, h.end) for h in router.route(**kwargs)]


def test_fast_short_spans_beat_one_slow_long_span():
    # 1 holds all 4 blocks at 50 tokens/s (200 block-tokens/s): 2 s a micro-batch; 2 and 3 hold 2 blocks each at
    # 200 tokens/s (400 block-tokens/s): 0.5 s each, 1 s in all. Fewest hops would take 1.
    router = _router({1: (0, 4, 50.0), 2: (0, 2, 200.0), 3: (2, 4, 200.0)}, 4)
    assert _chain(router) == [(2, 0, 2), (3, 2, 4)]


def test_a_hop_costs_its_latency_so_equal_speeds_take_fewer_hops():
    router = _router({1: (0, 4, 100.0), 2: (0, 2, 200.0), 3: (2, 4, 200.0)}, 4)  # 1 s of compute either way
    assert _chain(router) == [(1, 0, 4)]


def test_the_fastest_of_several_mixes_is_found():
    # Block-token speeds: 1 at 0:3 100/s, 2 at 0:1 1000/s, 3 at 1:4 600/s, 4 at 3:6 300/s, 5 at 4:6 1000/s.
    spans = {1: (0, 3, 33.3), 2: (0, 1, 1000.0), 3: (1, 4, 200.0), 4: (3, 6, 100.0), 5: (4, 6, 500.0)}
    router = _router(spans, 6)
    # 0.1 s + 3 x 1/6 s + 1/3 s + 2 x 0.1 s, plus four hops: the rest is slower (e.g. 1 for 0:3 is 3 s alone)
    assert _chain(router) == [(2, 0, 1), (3, 1, 4), (5, 4, 6)]


def test_measured_speed_overrides_the_announced_one():
    router = _router({1: (0, 2, 100.0), 2: (0, 2, 90.0)}, 2)
    assert _chain(router)[0][0] == 1
    router.busy_until.clear()
    router.succeeded(_peer(1), Method.FORWARD, units=200, seconds=20.0)  # 0.1 s per block-token: far slower
    assert _chain(router)[0][0] == 2


def test_micro_batches_in_flight_spread_over_replicas_in_proportion_to_speed():
    clock = _Clock()
    # 400, 200 and 50 block-tokens/s: 0.5, 1 and 4 s a micro-batch
    router = _router({1: (0, 2, 200.0), 2: (0, 2, 100.0), 3: (0, 2, 25.0)}, 2, clock=clock)
    blocks = Counter()
    for _ in range(26):  # routed at once: each sees the others' work (a micro-batch may pass from one to another)
        for peer, start, end in _chain(router):
            blocks[peer] += end - start
    share = {1: 32, 2: 16, 3: 4}  # 52 blocks in proportion to speed: the slow peer gets less work, not none
    assert all(abs(blocks[p] - share[p]) <= 2 for p in share), blocks
    clock.now = 100.0  # the work is done: the fastest is free again
    assert _chain(router) == [(1, 0, 2)]


def test_work_in_flight_can_move_a_hop_off_a_long_span():
    # 1 serves 0:4 fast and is busy for a while; 2 and 3 split the blocks, slower, but free.
    candidates = [
        Candidate(_peer(1), 0, 4, block_seconds=0.1, busy_for=3.0),
        Candidate(_peer(2), 0, 2, block_seconds=0.5),
        Candidate(_peer(3), 2, 4, block_seconds=0.5),
    ]
    assert [(h.peer_id, h.start, h.end) for h in fastest_chain(candidates, 0, 4)] == [
        (_peer(2), 0, 2),
        (_peer(3), 2, 4),
    ]
    assert fastest_chain(candidates[1:2], 0, 4) is None  # blocks 2:4 have no server


def test_the_preferred_peer_takes_the_blocks_it_holds():
    router = _router({1: (0, 4, 1000.0), 2: (2, 4, 10.0)}, 4)
    assert _chain(router, start=2, prefer=_peer(2)) == [(2, 2, 4)]
