"""The fastest chain over blocks: a shortest path whose nodes are block boundaries and whose edges are servers' hops.

A micro-batch reaches boundary ``b`` at some time; a server covering ``b`` can take it from there to any boundary
within its span. It starts once the activations have arrived (the hop's transfer) and the server has done the work
this client already gave it, then spends its compute time per block on each block of the hop. Arrival times only grow
along a path (waiting never makes a later arrival earlier), so the earliest arrival at each boundary, taken in block
order, gives the fastest chain (Dijkstra on a DAG).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hivemind.p2p import PeerID


@dataclass(frozen=True)
class Candidate:
    """A server that may take one hop of the micro-batch, with what the client estimates of it."""

    peer_id: PeerID
    start: int
    end: int
    block_seconds: float  # compute time of one block of the micro-batch
    busy_for: float = 0.0  # seconds until the work this client already gave it is done
    transfer: float = 0.0  # seconds for the activations to reach it from the hop before


@dataclass(frozen=True)
class PlannedHop:
    """One hop of the fastest chain: who, which blocks, and when (seconds from now) it starts and finishes."""

    peer_id: PeerID
    start: int
    end: int
    begins: float
    finishes: float


def fastest_chain(candidates: Iterable[Candidate], start: int, end: int) -> list[PlannedHop] | None:
    """The chain through blocks [start, end) that finishes earliest, or None if some block has no candidate.

    Ties go to the candidate listed first (the caller shuffles them so that equally fast servers share the work).
    """
    covering: dict[int, list[Candidate]] = {b: [] for b in range(start, end)}
    for c in candidates:
        for b in range(max(c.start, start), min(c.end, end)):
            covering[b].append(c)
    arrival: dict[int, float] = {start: 0.0}
    came: dict[int, PlannedHop] = {}
    for b in range(start, end):
        if b not in arrival:
            continue
        for c in covering[b]:
            begins = max(arrival[b] + c.transfer, c.busy_for)
            for stop in range(b + 1, min(c.end, end) + 1):
                finishes = begins + (stop - b) * c.block_seconds
                if finishes < arrival.get(stop, float("inf")):
                    arrival[stop] = finishes
                    came[stop] = PlannedHop(c.peer_id, b, stop, begins, finishes)
    if end not in arrival:
        return None
    hops, boundary = [], end
    while boundary > start:
        hop = came[boundary]
        hops.append(hop)
        boundary = hop.start
    return hops[::-1]
