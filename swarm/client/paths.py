"""The fastest chain over blocks: a shortest path whose nodes are (block boundary, the peer that delivered the
activations there) and whose edges are servers' hops.

A micro-batch reaches boundary ``b`` from some peer at some time; a server covering ``b`` can take it from there to
any boundary within its span. It starts once the activations have arrived over the link from that peer (the hop's
transfer: measured for some links, a default for the others and from the client) and the server has done the work
this client already gave it, then spends its compute time per block on each block of the hop. Arrival times only
grow along a path (waiting never makes a later arrival earlier), so the earliest arrival at each (boundary, peer),
taken in block order, gives the fastest chain (Dijkstra on a DAG).

Exact, with no pruning, and about as fast as one arrival per boundary was when every hop cost the same (the
simulation routes over 1000 peers and 80 blocks): a server's earliest start at ``b`` is the least, over the peers
that delivered there, of their arrival plus their link to it; a peer without a measured link to it costs the default
transfer, so of those only the earliest can win, and each server looks only at its measured links and at the
earliest arrival without one. A server keeps only its fastest hop so far: a hop from ``b`` reaches every later
boundary at (its start - b x block_seconds) + boundary x block_seconds, so it beats the server's hops from before to
every boundary, or to none.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hivemind.p2p import PeerID


@dataclass(frozen=True)
class Candidate:
    """A server that may take one hop of the micro-batch, with what the client estimates of it."""

    peer_id: PeerID
    start: int
    end: int
    block_seconds: float  # compute time of one block of the micro-batch
    busy_for: float = 0.0  # seconds until the work this client already gave it is done
    transfer: float = 0.0  # seconds for the activations to reach it from the client, or from a hop not in ``links``
    links: Mapping[PeerID, float] = field(default_factory=dict, compare=False)  # hop before -> seconds, measured


@dataclass(frozen=True)
class PlannedHop:
    """One hop of the fastest chain: who, which blocks, and when (seconds from now) it starts and finishes."""

    peer_id: PeerID
    start: int
    end: int
    begins: float
    finishes: float


CLIENT = -1  # who sends the micro-batch's first hop
# An arrival at a boundary: (time, when it was found: ties go to the first, the candidate that delivered it (its
# index), the boundary its hop began at, when the hop began, who sent to it: a candidate or CLIENT). Plain tuples,
# compared as they are: the simulation routes over 1000 peers.
_Arrival = tuple[float, int, int, int, float, int]


def fastest_chain(candidates: Iterable[Candidate], start: int, end: int) -> list[PlannedHop] | None:
    """The chain through blocks [start, end) that finishes earliest, or None if some block has no candidate.

    Ties go to the candidate listed first (the caller shuffles them so that equally fast servers share the work).
    Each candidate is one peer (listed twice, a peer would count as two that may hand on to each other).
    """
    candidates = list(candidates)
    index = {c.peer_id: i for i, c in enumerate(candidates)} if any(c.links for c in candidates) else {}
    links = [{j: seconds for p, seconds in c.links.items() if (j := index.get(p)) is not None} for c in candidates]
    covering: dict[int, list[int]] = {b: [] for b in range(start, end)}
    for i, c in enumerate(candidates):
        for b in range(max(c.start, start), min(c.end, end)):
            covering[b].append(i)
    found = itertools.count()
    # per candidate, its fastest hop so far (see the module's docstring): (the boundary it begins at, when, from
    # whom, when it was found), and its start less the blocks before it at its speed
    hops: list[tuple[int, float, int, int] | None] = [None] * len(candidates)
    offset = [math.inf] * len(candidates)
    arrivals: list[dict[int, _Arrival]] = [{} for _ in range(start, end + 1)]  # per boundary: who delivered -> when
    arrivals[0][CLIENT] = (0.0, next(found), CLIENT, start, 0.0, CLIENT)
    for b in range(start, end + 1):
        here = arrivals[b - start]
        for i in covering.get(b - 1, ()):  # the hops so far of those whose span reaches b arrive here
            if hops[i] is not None:
                began_at, begins, sender, when = hops[i]
                here[i] = (begins + (b - began_at) * candidates[i].block_seconds, when, i, began_at, begins, sender)
        if not here or b == end:
            continue
        ranked = sorted(here.values())
        for i in covering[b]:
            c = candidates[i]
            ready, sender = _earliest_start(i, c.transfer, links[i], here, ranked)
            begins = max(ready, c.busy_for)
            if begins - b * c.block_seconds < offset[i]:
                offset[i], hops[i] = begins - b * c.block_seconds, (b, begins, sender, next(found))
    if not arrivals[-1]:
        return None
    chain, boundary = [], end
    finishes, _, i, began_at, begins, sender = min(arrivals[-1].values())
    while i != CLIENT:
        chain.append(PlannedHop(candidates[i].peer_id, began_at, boundary, begins, finishes))
        boundary = began_at
        finishes, _, i, began_at, begins, sender = arrivals[boundary - start][sender]
    return chain[::-1]


def _earliest_start(
    i: int, transfer: float, links: dict[int, float], here: dict[int, _Arrival], ranked: list[_Arrival]
) -> tuple[float, int]:
    """When the activations can be at candidate ``i`` at the earliest, and from whom: over its measured ``links``
    from the candidates that delivered ``here``, or at the default ``transfer`` from the earliest of the others
    (``ranked``). A peer does not hand on to itself: its own longer hop is never slower."""
    best: tuple[float, int, int] = (math.inf, 0, CLIENT)  # (time, the sender's arrival found, sender)
    for j, seconds in links.items():
        arrival = here.get(j)
        if arrival is not None and j != i:
            best = min(best, (arrival[0] + seconds, arrival[1], j))
    for arrival in ranked:
        j = arrival[2]
        if j != i and j not in links:
            best = min(best, (arrival[0] + transfer, arrival[1], j))
            break
    return best[0], best[2]
