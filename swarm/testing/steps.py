"""A training step's time through a swarm, played out: micro-batches pipelined over their chains, peers working in turn.

A step's micro-batches run as the client runs them (``swarm.client.pipeline``): at most ``in_flight`` at once, the next
one started (and routed) when one finishes. Each goes forward hop by hop along its chain, then backward along the same
hops in reverse (each peer kept the input; a backward costs ``backward_cost`` forwards). A peer works on one hop at a
time, in the order the hops reach it, so micro-batches routed onto the same peer queue there. Transfers are left out:
the simulation knows the peers' compute, not their links.

This is what the simulation measures routes by: the time of a whole step, which counts both what one micro-batch waits
for (the chain's latency) and what several in flight share (its throughput), so it is fair to the one widest chain as
much as to routes that spread micro-batches over replicas.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

Chain = Sequence[tuple[Hashable, float]]  # hops: (peer, seconds of its forward for one micro-batch)


def step_seconds(
    chain_at: Callable[[float], Chain], micro_batches: int, in_flight: int, backward_cost: float = 2.0
) -> float:
    """Seconds from the start of a step until the last micro-batch's backward is done; ``chain_at(t)`` routes the
    micro-batch started at time t (the client routes each as it starts it, seeing the work routed before)."""
    if micro_batches < 1 or in_flight < 1:
        raise ValueError(f"need at least one micro-batch and one in flight, got {micro_batches} and {in_flight}")
    free: dict[Hashable, float] = {}  # when each peer is done with the hops that reached it so far
    order = itertools.count()
    events: list[tuple[float, int, int, int]] = []  # (time, tie-break, micro-batch, index of its next stage)
    stages: dict[int, list[tuple[Hashable, float]]] = {}
    started, finished = 0, 0.0

    def start(at: float) -> None:
        nonlocal started
        chain = list(chain_at(at))
        stages[started] = chain + [(peer, backward_cost * seconds) for peer, seconds in reversed(chain)]
        heapq.heappush(events, (at, next(order), started, 0))
        started += 1

    for _ in range(min(in_flight, micro_batches)):
        start(0.0)
    while events:
        at, _, micro_batch, stage = heapq.heappop(events)
        if stage == len(stages[micro_batch]):
            finished = max(finished, at)
            if started < micro_batches:
                start(at)
            continue
        peer, seconds = stages[micro_batch][stage]
        done = max(at, free.get(peer, 0.0)) + seconds
        free[peer] = done
        heapq.heappush(events, (done, next(order), micro_batch, stage + 1))
    return finished
