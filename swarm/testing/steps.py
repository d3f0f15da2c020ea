"""A training step's time through a swarm, played out: micro-batches pipelined over their chains, peers working in turn.

A step's micro-batches run as the client runs them (``swarm.client.pipeline``): at most ``in_flight`` at once, the next
one started (and routed) when one finishes. Each goes forward hop by hop along its chain, then backward along the same
hops in reverse (each peer kept the input; a backward costs ``backward_cost`` forwards). A peer works on one hop at a
time, in the order the hops reach it, so micro-batches routed onto the same peer queue there. Transfers are left out:
the simulation knows the peers' compute, not their links (swarm/planning.py ``play_step``, played here with compute
stages only, adds them).

This is what the simulation measures routes by: the time of a whole step, which counts both what one micro-batch waits
for (the chain's latency) and what several in flight share (its throughput), so it is fair to the one widest chain as
much as to routes that spread micro-batches over replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from swarm.planning import Stage, play_step

Chain = Sequence[tuple[Hashable, float]]  # hops: (peer, seconds of its forward for one micro-batch)


def step_seconds(
    chain_at: Callable[[float], Chain], micro_batches: int, in_flight: int, backward_cost: float = 2.0
) -> float:
    """Seconds from the start of a step until the last micro-batch's backward is done; ``chain_at(t)`` routes the
    micro-batch started at time t (the client routes each as it starts it, seeing the work routed before)."""

    def stages(_index: int, at: float) -> list[Stage]:
        chain = list(chain_at(at))
        forward = [Stage((peer,), seconds) for peer, seconds in chain]
        return forward + [Stage((peer,), backward_cost * seconds) for peer, seconds in reversed(chain)]

    return play_step(stages, micro_batches, in_flight)[0]
