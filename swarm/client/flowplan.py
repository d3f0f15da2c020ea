"""Chains for a saturated stream: how a swarm's servers should share micro-batches so that the most go through.

When every server already has work queued, the chain that finishes one micro-batch earliest is no longer what
counts: each long hop on a fast peer spends its time on blocks that others could serve, and the scarce blocks
starve. The most micro-batches per second a set of servers can carry is a flow over block boundaries: a hop
[a, c) on peer p costs p (c - a) x its seconds per block, no peer works more than all the time, and what enters a
boundary leaves it. A linear program finds the largest flow; then, among flows within ``SLACK`` of it, the one with
the fewest hops (each hop is a transfer and a wait); then the largest flow over just those hops. Decomposed into
chains, each with its rate, the plan is what micro-batches follow: chain k gets its share of them, so every server
gets work in proportion to what it can do where it is needed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

SLACK = 0.02  # the share of the largest flow given up for fewer hops
MIN_SHARE = 1e-3  # chains carrying less than this share of the flow are dropped (solver noise)


@dataclass(frozen=True)
class Server:
    """A server the plan may use: who, its span, and its compute seconds per block of one micro-batch."""

    peer: Hashable
    start: int
    end: int
    block_seconds: float


@dataclass(frozen=True)
class PlannedChain:
    """A chain of hops (peer, start, end) through every block, and the micro-batches per second it carries."""

    hops: tuple[tuple[Hashable, int, int], ...]
    rate: float


@dataclass(frozen=True)
class FlowPlan:
    """The chains of the largest flow (their rates add up to ``rate``, micro-batches per second of forward work)."""

    chains: tuple[PlannedChain, ...]
    rate: float


def plan_flow(servers: Sequence[Server], start: int, end: int) -> FlowPlan | None:
    """The flow plan through blocks [start, end), or None if some block has no server (or no server has speed)."""
    servers = [s for s in servers if s.block_seconds > 0 and max(s.start, start) < min(s.end, end)]
    hops = [
        (k, a, c)
        for k, s in enumerate(servers)
        for a in range(max(s.start, start), min(s.end, end))
        for c in range(a + 1, min(s.end, end) + 1)
    ]
    if not hops or any(not any(s.start <= b < s.end for s in servers) for b in range(start, end)):
        return None
    largest = _solve(hops, servers, start, end)
    if largest is None:
        return None
    # the fewest hops among flows within SLACK of the largest; hop counts grow with the flow, so that flow sits at
    # the bound: the largest flow over just the hops it uses gives the rest back
    fewest = _solve(hops, servers, start, end, at_least=(1 - SLACK) * largest[-1])
    if fewest is not None:
        used = [hop for hop, x in zip(hops, fewest, strict=False) if x > 0]
        regained = _solve(used, servers, start, end)
        if regained is not None:
            hops, largest = used, regained
    chains = _decompose({hop: x for hop, x in zip(hops, largest, strict=False) if x > 0}, start, end)
    total = sum(rate for _, rate in chains)
    kept = tuple(
        PlannedChain(tuple((servers[k].peer, a, c) for k, a, c in chain), rate)
        for chain, rate in chains
        if rate >= MIN_SHARE * total
    )
    return FlowPlan(kept, sum(c.rate for c in kept)) if kept else None


def _solve(
    hops: list[tuple[int, int, int]],
    servers: Sequence[Server],
    start: int,
    end: int,
    at_least: float | None = None,
) -> np.ndarray | None:
    """Each hop's micro-batches per second, then the flow's: the largest flow, or (``at_least`` given) the fewest
    hops per second among flows of at least that much. None if there is no such flow."""
    flow = len(hops)  # the variable index of the flow's rate, after one per hop
    rows, cols, values = [], [], []
    # what leaves boundary b (b > start) equals what enters it; what leaves `start` is the flow
    for j, (_, a, c) in enumerate(hops):
        rows.append(a - start)
        cols.append(j)
        values.append(1.0)
        if c < end:
            rows.append(c - start)
            cols.append(j)
            values.append(-1.0)
    rows.append(0)
    cols.append(flow)
    values.append(-1.0)
    balance = coo_matrix((values, (rows, cols)), shape=(end - start, flow + 1)).tocsr()
    # no server works more than all the time
    work = [(c - a) * servers[k].block_seconds for k, a, c in hops]
    busy = coo_matrix((work, ([k for k, _, _ in hops], range(flow))), shape=(len(servers), flow + 1)).tocsr()
    if at_least is None:
        cost, bounds = np.zeros(flow + 1), [(0, None)] * (flow + 1)
        cost[flow] = -1.0
    else:
        cost, bounds = np.concatenate([np.ones(flow), [0.0]]), [(0, None)] * flow + [(at_least, None)]
    solved = linprog(
        cost,
        A_ub=busy,
        b_ub=np.ones(len(servers)),
        A_eq=balance,
        b_eq=np.zeros(end - start),
        bounds=bounds,
        method="highs",
    )
    if solved.status != 0 or solved.x[flow] <= 0:
        return None
    return solved.x


def _decompose(
    flows: dict[tuple[int, int, int], float], start: int, end: int
) -> list[tuple[list[tuple[int, int, int]], float]]:
    """Chains from ``start`` to ``end`` carrying the hops' flows: each follows the hop with the most flow left out
    of every boundary, carries the least of them, and is taken off; until nothing leaves ``start``."""
    leaving: dict[int, dict[tuple[int, int, int], float]] = {}
    for hop, x in flows.items():
        leaving.setdefault(hop[1], {})[hop] = x
    chains = []
    while leaving.get(start):
        chain, b = [], start
        while b < end:
            out = leaving.get(b)
            if not out:
                break  # solver rounding left a hop dangling: drop what reaches here
            hop = max(out, key=out.get)
            chain.append(hop)
            b = hop[2]
        rate = min(leaving[h[1]][h] for h in chain)
        for hop in chain:
            left = leaving[hop[1]][hop] - rate
            if left <= 1e-12:
                del leaving[hop[1]][hop]
            else:
                leaving[hop[1]][hop] = left
        if b == end and rate > 0:
            chains.append((chain, rate))
    return chains
