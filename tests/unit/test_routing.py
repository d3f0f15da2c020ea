"""Route choice on hand-made swarms whose fastest chain is known: speed, hops, measured speed, work in flight, the
links between peers; and on small random ones, against every chain."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from hivemind.p2p import PeerID

from swarm.client.paths import Candidate, fastest_chain
from swarm.client.routing import Router, RouterOptions
from swarm.net.protocol import Method
from swarm.net.records import Link, ServerRecord, ServerState
from swarm.net.transport import Transport


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _peer(i: int) -> PeerID:
    return PeerID(bytes([i]) * 34)


def _router(spans: dict[int, tuple[int, int, float]], num_blocks: int, clock=None, **options) -> Router:
    """Peers i -> (start, end, tokens/s through their span); micro-batches of 100 tokens, 10 ms per hop."""
    options = {"tokens": 100, "hop_seconds": 0.01, "work_per_forward": 1.0, "seed": 0, **options}
    timed = {} if clock is None else {"clock": clock}
    router = Router(None, Transport(p2p=None), "m", num_blocks, RouterOptions(**options), **timed)
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


def test_a_fast_peer_whose_answers_waited_in_its_queue_is_routed_by_its_compute_time():
    # 1 computes twice as fast as 2, but its answers took 4x longer: they waited behind work the router already
    # counts as booked. Routed by the answers' time, it would look slower than 2; by its compute time, it is faster.
    router = _router({1: (0, 2, 100.0), 2: (0, 2, 100.0)}, 2)
    router.succeeded(_peer(1), Method.FORWARD, units=200, seconds=4.0, compute=1.0)
    router.succeeded(_peer(2), Method.FORWARD, units=200, seconds=2.0, compute=2.0)
    assert _chain(router)[0][0] == 1


def test_a_peer_claiming_to_compute_in_no_time_is_believed_only_down_to_a_share_of_its_measured_time():
    router = _router({1: (0, 2, 100.0), 2: (0, 2, 100.0)}, 2)
    router.succeeded(_peer(1), Method.FORWARD, units=200, seconds=10.0, compute=0.0)  # counted as 2.5 s
    router.succeeded(_peer(2), Method.FORWARD, units=200, seconds=2.0, compute=2.0)
    assert _chain(router)[0][0] == 2


def test_a_peer_given_work_is_waited_for_longer_not_banned_for_being_loaded():
    clock = _Clock()
    router = _router({1: (0, 2, 100.0)}, 2, clock=clock, work_per_forward=3.0)
    router.succeeded(_peer(1), Method.BACKWARD, units=200, seconds=4.0)
    idle = router.timeout(_peer(1), Method.BACKWARD, 200)
    for _ in range(4):  # four micro-batches routed to it, 1 s of forward each, 3 s with their backward: 12 s booked
        router.route()
    assert router.timeout(_peer(1), Method.BACKWARD, 200) == pytest.approx(idle + 12.0, rel=0.05)
    clock.now = 20.0  # all of it done by now
    assert router.timeout(_peer(1), Method.BACKWARD, 200) == idle


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


# --- links: a hop costs the transfer from the hop before, over the link that one announced -------------------------


def _linked(router: Router, links: dict[int, dict[int, Link]]) -> Router:
    """Peers i announce their links to peers j (i -> j -> Link) in every record: the router sees a new view."""
    announced = {_peer(i): {_peer(j): link for j, link in to.items()} for i, to in links.items()}
    router.servers = {
        b: [replace(r, links=announced.get(r.peer_id, {})) for r in rs] for b, rs in router.servers.items()
    }
    return router


NEAR, FAR = Link(rtt=0.002, bandwidth=1e9), Link(rtt=1.0, bandwidth=1e9)  # 1 ms, 0.5 s to pass on (small payloads)
NARROW = Link(rtt=0.002, bandwidth=1e5)  # 4096-byte tokens x 100: 4 s


def test_a_fast_peer_behind_a_slow_link_loses_to_a_slower_peer_close_by():
    # 2 and 3 both serve 2:4 after 1: 2 in 0.25 s, 3 in 0.5 s. Unmeasured, 2 wins; 1's link to 2 takes 0.5 s more.
    spans = {1: (0, 2, 200.0), 2: (2, 4, 400.0), 3: (2, 4, 200.0)}
    assert _chain(_router(spans, 4)) == [(1, 0, 2), (2, 2, 4)]
    assert _chain(_linked(_router(spans, 4), {1: {2: FAR, 3: NEAR}})) == [(1, 0, 2), (3, 2, 4)]
    # the same by bandwidth: 100 tokens of 4096 bytes take 4 s at 100 kB/s, 0.4 ms at 1 GB/s
    narrow = _linked(_router(spans, 4, bytes_per_token=4096), {1: {2: NARROW, 3: NEAR}})
    assert _chain(narrow) == [(1, 0, 2), (3, 2, 4)]


def test_an_unmeasured_link_costs_what_the_measured_ones_do():
    # 1 measured only its link to 3: near. 2, unmeasured, is not taken for slow, nor 3 for being known.
    spans = {1: (0, 2, 200.0), 2: (2, 4, 400.0), 3: (2, 4, 200.0)}
    router = _linked(_router(spans, 4, bytes_per_token=4096), {1: {3: NEAR}})
    assert router.links.default == pytest.approx(NEAR.rtt / 2 + 409600 / NEAR.bandwidth)
    assert _chain(router) == [(1, 0, 2), (2, 2, 4)]


def test_the_link_counts_from_the_peer_that_passes_on():
    # 1 and 2 serve 0:2 alike; 3 serves 2:4. 1 is far from 3, 2 is near: the chain goes through 2, whoever is listed.
    spans = {1: (0, 2, 200.0), 2: (0, 2, 200.0), 3: (2, 4, 200.0)}
    for seed in range(5):
        router = _linked(_router(spans, 4, seed=seed), {1: {3: FAR}, 2: {3: NEAR}})
        assert _chain(router) == [(2, 0, 2), (3, 2, 4)]


def test_without_links_a_payload_changes_no_choice():
    spans = {1: (0, 3, 33.3), 2: (0, 1, 1000.0), 3: (1, 4, 200.0), 4: (3, 6, 100.0), 5: (4, 6, 500.0)}
    assert _chain(_router(spans, 6, bytes_per_token=4096)) == _chain(_router(spans, 6))


def test_client_driven_hops_ignore_the_peers_links():
    spans = {1: (0, 2, 200.0), 2: (2, 4, 400.0), 3: (2, 4, 200.0)}
    router = _linked(_router(spans, 4, chained=False), {1: {2: FAR, 3: NEAR}})
    assert _chain(router) == [(1, 0, 2), (2, 2, 4)]


def _finish(chain: list[tuple[Candidate, int, int]], start: int) -> float:
    """When a chain of (candidate, start, stop) hops ends, by the same rules as fastest_chain."""
    time, before = 0.0, None
    for c, b, stop in chain:
        assert b == start and c.start <= b < stop <= c.end
        transfer = c.transfer if before is None else c.links.get(before, c.transfer)
        time = max(time + transfer, c.busy_for) + (stop - b) * c.block_seconds
        before, start = c.peer_id, stop
    return time


def _every_chain(candidates: list[Candidate], start: int, end: int):
    if start == end:
        yield []
        return
    for c in candidates:
        if c.start <= start < c.end:
            for stop in range(start + 1, min(c.end, end) + 1):
                for rest in _every_chain(candidates, stop, end):
                    yield [(c, start, stop), *rest]


def test_the_fastest_chain_is_the_best_of_every_chain_on_small_swarms():
    """Brute force over every chain (a peer handing on to itself included) on random swarms of 4-7 peers over 5
    blocks, with random speeds, work in flight and measured links (fast and slow) between some of them."""
    rng = random.Random(0)
    for _ in range(300):
        peers = range(1, rng.randint(4, 7) + 1)
        spans = {i: sorted(rng.sample(range(6), 2)) for i in peers}
        seconds = [0.001, 0.05, 0.3, 2.0]
        links = {i: {j: rng.choice(seconds) for j in peers if j != i and rng.random() < 0.5} for i in peers}
        candidates = [
            Candidate(
                _peer(i),
                *spans[i],
                block_seconds=rng.choice([0.05, 0.1, 0.2, 0.5]),
                busy_for=rng.choice([0.0, 0.0, 0.3, 1.0]),
                transfer=rng.choice([0.0, 0.01, 0.1]),
                links={_peer(j): links[j][i] for j in peers if i in links[j]},
            )
            for i in peers
        ]
        best = min((_finish(chain, 0) for chain in _every_chain(candidates, 0, 5)), default=None)
        found = fastest_chain(candidates, 0, 5)
        if best is None:
            assert found is None
            continue
        by_peer = {c.peer_id: c for c in candidates}
        assert found[-1].finishes == pytest.approx(best)
        assert _finish([(by_peer[h.peer_id], h.start, h.end) for h in found], 0) == pytest.approx(best)


def test_micro_batches_in_flight_grow_with_the_servers_a_step_can_keep_busy():
    two = _router({1: (0, 2, 100.0), 2: (2, 4, 100.0)}, 4)
    assert two.in_flight() == 4  # two per server
    four = _router({1: (0, 2, 100.0), 2: (2, 4, 100.0), 3: (0, 2, 50.0), 4: (2, 4, 50.0)}, 4)
    assert four.in_flight() == 8  # a replica per span added: each needs work waiting too
    four.ban(_peer(3), "test")
    assert four.in_flight() == 6  # only servers a route may use count
    crowd = _router({i: (0, 4, 100.0) for i in range(1, 41)}, 4)
    assert crowd.in_flight() == 32  # at most: each micro-batch in flight holds activations on its peers
    assert _router({1: (0, 4, 100.0)}, 4).in_flight() == 4  # at least


def test_a_saturated_stream_follows_the_flow_plan_and_an_idle_swarm_the_fastest_chain():
    # 1 holds 0:4 at 0.1 s a block, 2 holds 0:3 at 1 s a block; block 3 is only on 1. The largest flow sends 1/3
    # micro-batch/s through 2's 0:3 and on through 1's block 3, and 2.42/s through 1 alone: 12 % of micro-batches
    # take 2 (test_flowplan.py). Routed at once, the first take the fastest chain (1 alone); once it would wait more
    # than twice what it computes, the rest follow the plan's chains in their shares.
    clock = _Clock()
    router = _router({1: (0, 4, 250.0), 2: (0, 3, 100.0 / 3)}, 4, clock=clock)  # 0.4 s and 3 s a micro-batch
    first = [tuple(_chain(router)) for _ in range(10)]
    assert first[0] == ((1, 0, 4),)
    chains = Counter(tuple(_chain(router)) for _ in range(200))
    whole, through_2 = ((1, 0, 4),), ((2, 0, 3), (1, 3, 4))
    assert set(chains) == {whole, through_2}, chains
    assert chains[through_2] / 200 == pytest.approx(1 / 3 / 2.75, abs=0.02), chains
    clock.now = 1000.0  # the work is done: one micro-batch alone takes the fastest chain again
    assert _chain(router) == [(1, 0, 4)]


def test_the_preferred_peer_is_kept_when_the_stream_is_saturated():
    router = _router({1: (0, 4, 1000.0), 2: (2, 4, 100.0)}, 4)
    for _ in range(50):
        router.route()
    assert _chain(router, start=2, prefer=_peer(2)) == [(2, 2, 4)]
