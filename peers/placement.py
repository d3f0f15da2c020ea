"""Where a peer should serve: the swarm's records turned into what the balancer (peers/balancer.py) weighs, and the
decision of a peer's next move from them. Pure functions of a view, shared by the daemon and the simulation."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from hivemind.p2p import PeerID

from peers.balancer import Snapshot, badness, block_throughput, coverage_with, next_move
from swarm.blocks import spans_text
from swarm.net.records import MoveCost, ServerRecord, ServerState
from swarm.net.view import SwarmView


class Settled(NamedTuple):
    """The view as ``next_move`` takes it (see ``settled_spans``)."""

    spans: dict[str, range]  # settled live peers (online on one span, not moving): a plan may move them
    pinned: dict[int, int]  # per block, how many joining or moving live peers will serve it
    speeds: dict[str, float]  # settled peers' span throughput (tokens/s through the whole span), as announced
    pinned_throughput: dict[int, float]  # per block, the span throughput the joining and moving peers will bring

    def snapshot(
        self,
        num_blocks: int,
        replication: int,
        capacity: Mapping[str, int] | None = None,
        costs: Mapping[str, MoveCost] | None = None,
    ) -> Snapshot:
        """The balancer's snapshot of this view (its dicts, not copies), with what peers announce of their moves."""
        return Snapshot(
            self.spans,
            num_blocks,
            replication,
            pinned=self.pinned,
            capacity=capacity,
            speeds=self.speeds,
            pinned_throughput=self.pinned_throughput,
            costs=costs,
        )


def settled_spans(
    view: SwarmView, num_blocks: int, exclude: PeerID | None = None, yielding: frozenset[PeerID] = frozenset()
) -> Settled:
    """The view as ``next_move`` takes it: each settled live peer's span and throughput, and per block how many other
    live peers will serve it and with what throughput. A peer on the span its operator told it (``--blocks``) counts
    as pinned where it serves: it leaves that span only to cover an orphan, so no plan may count on moving it. A
    joining or moving peer counts where it is going, not where it is leaving: two peers counting on each other to
    keep a block would both leave it, or both rush to the same slow one. A moving peer keeps its speed (span
    throughput times span length) on the span it moves to; a joining one has not measured it yet and counts as the
    median settled peer. ``exclude``: a peer left out (one choosing
    its own span). ``yielding``: moving peers counted where they serve now, not where they go (they give way to the
    peer asking: see ``Mover.move``)."""
    online: dict = {}  # peer -> the spans it announces online
    going: dict = {}  # peer -> the blocks it is loading or moving to
    rates: dict = {}  # peer -> (span throughput, span length) of an online record
    told: set = set()  # peers serving the span their operator told them: counted where they are, never planned
    for records in view.records.values():
        for r in records:
            if r.peer_id not in view.alive or r.peer_id == exclude:
                continue
            if r.peer_id in yielding and r.state != ServerState.ONLINE:
                continue
            if r.state == ServerState.ONLINE:
                online.setdefault(r.peer_id, set()).add(r.blocks)
                rates[r.peer_id] = (r.throughput, len(r.blocks))
                if r.home is not None:
                    told.add(r.peer_id)
            target = {ServerState.ONLINE: r.moving_to, ServerState.JOINING: r.blocks}.get(r.state)
            if target is not None and r.peer_id not in yielding:
                going.setdefault(r.peer_id, set()).update(b for b in target if b < num_blocks)
    settled = {
        peer: span
        for peer, spans in online.items()
        if peer not in going and peer not in told and len(spans) == 1 and (span := next(iter(spans))).stop <= num_blocks
    }
    speeds = {peer.to_base58(): rates[peer][0] for peer in settled}
    guess = statistics.median(speeds.values()) if speeds else 0.0
    pinned: dict[int, int] = {}
    flow: dict[int, float] = {}
    for peer in (online.keys() - settled.keys()) | going.keys():
        blocks = going.get(peer) or {b for span in online.get(peer, ()) for b in span if b < num_blocks}
        if not blocks:
            continue
        rate = rates[peer][0] * rates[peer][1] / len(blocks) if peer in rates else guess
        for b in blocks:
            pinned[b] = pinned.get(b, 0) + 1
            flow[b] = flow.get(b, 0.0) + rate
    return Settled({peer.to_base58(): span for peer, span in settled.items()}, pinned, speeds, flow)


def planned_throughput(view: SwarmView, num_blocks: int, exclude: PeerID | None = None) -> dict[int, float]:
    """Per block, the summed span throughput its live servers will give once joining and moving ones are where they
    go (``exclude`` left out): what a new peer weighs, so that two peers joining one after the other spread out."""
    settled = settled_spans(view, num_blocks, exclude)
    return dict(enumerate(block_throughput(settled.spans, settled.speeds, num_blocks, settled.pinned_throughput)))


def movers(view: SwarmView) -> set[PeerID]:
    """Peers serving one span while moving to another (online there, and joining or ``moving_to`` elsewhere)."""
    records = [r for records in view.records.values() for r in records]
    online = {r.peer_id for r in records if r.state == ServerState.ONLINE}
    going = {r.peer_id for r in records if r.moving_to is not None or r.state == ServerState.JOINING}
    return online & going


def announced_again(
    before: dict[int, list[ServerRecord]], after: dict[int, list[ServerRecord]], blocks: Iterable[int], me: PeerID
) -> list[PeerID]:
    """Peers that announced themselves online or joining (loading them) on any of ``blocks`` between two reads of the
    records: alive, whatever their pings said (a peer re-announces every third of its records' lifetime, through its
    DHT process: a peer on a machine too busy to answer a ping in time still does, a dead one never)."""
    then = {(b, r.peer_id): r.announced_at for b in blocks for r in before.get(b, [])}
    return sorted(
        {
            r.peer_id
            for b in blocks
            for r in after.get(b, [])
            if r.peer_id != me
            and r.state in (ServerState.ONLINE, ServerState.JOINING)
            and r.announced_at > then.get((b, r.peer_id), -1.0)
        },
        key=lambda p: p.to_bytes(),
    )


def busy_peers(view: SwarmView, me: PeerID, yielding: frozenset[PeerID] = frozenset()) -> set[PeerID]:
    """Other live peers whose span is about to change: joining (loading a span) or moving (online on one span while
    loading another). A peer draining blocks after a move is not: its records already say where it will be."""
    return {
        r.peer_id
        for records in view.records.values()
        for r in records
        if (r.state == ServerState.JOINING or r.moving_to is not None)
        and r.peer_id != me
        and r.peer_id not in yielding
        and r.peer_id in view.alive
    }


@dataclass(frozen=True)
class Placement:
    """What a peer's move depends on besides the view: the model's size and the swarm's placement settings.
    ``home``: the span its operator told it (``--blocks``), None for a peer that places itself."""

    num_blocks: int
    span_len: int
    replication: int
    max_blocks: int | None
    home: range | None = None


class Move(NamedTuple):
    """A move a peer decided, and why, in words an operator reads in its log and in ``swarm status --peers``."""

    target: range
    reason: str
    covers: tuple[int, ...] = ()  # blocks without another live server that the move serves: checked twice first


def decide_move(
    view: SwarmView,
    me: PeerID,
    serving: range,
    throughput: float,
    placement: Placement,
    yielding: frozenset[PeerID] = frozenset(),
    cost: MoveCost | None = None,
    one_at_a_time: bool = True,
) -> Move | None:
    """This peer's move from the view, standing on ``serving``, its own moves left out (``cost``: what a move costs
    this peer, as it announces it): ``home_move`` for a peer told its span, else ``next_move``.

    With ``one_at_a_time``, a move that serves no orphaned block is made on a swarm at rest, by one peer: it waits
    while another peer joins or moves (``busy_peers``), and a peer on the same span with a smaller id that would make
    the same move makes it. Peers deciding on views that others' moves were about to change chose the same target
    at once, each loaded it for half a minute, and then gave way to each other (bench_seed on two loaded cores: 16
    moves begun, a handful made)."""
    if placement.home is not None:
        spans, pinned, speeds, _ = settled_spans(view, placement.num_blocks, me, yielding)
        others = _counts_of(spans, pinned, placement.num_blocks)
        online = [len(view.online(b, exclude=me)) for b in range(placement.num_blocks)]
        served = [online[b] if b in serving else count for b, count in enumerate(others)]
        target = home_move(served, placement.num_blocks, placement.home, serving, placement.max_blocks)
        return None if target is None else _explain(others, serving, target, placement, speeds, spans, me.to_base58())
    move = _placed_move(view, me, serving, throughput, placement, yielding, cost)
    # A block that a moving peer still serves is no orphan: that peer keeps it until another serves it
    # (``safe_to_drop``); two peers leaving one span at once made three others rush to cover it.
    if move is None or not one_at_a_time or any(not view.online(b, exclude=me) for b in move.covers):
        return move
    if busy_peers(view, me, yielding):
        return None
    return None if _twin_moves(view, me, serving, placement, yielding, move.target) else move


def _placed_move(
    view: SwarmView,
    me: PeerID,
    serving: range,
    throughput: float,
    placement: Placement,
    yielding: frozenset[PeerID],
    cost: MoveCost | None,
) -> Move | None:
    """``next_move`` for a peer that places itself, with the reason it follows."""
    settled = settled_spans(view, placement.num_blocks, me, yielding)
    spans, speeds, mine = settled.spans, settled.speeds, me.to_base58()
    others = _counts_of(spans, settled.pinned, placement.num_blocks)
    spans[mine], speeds[mine] = serving, throughput
    records = [r for records in view.records.values() for r in records]
    capacity = {r.peer_id.to_base58(): r.max_blocks for r in records}
    costs = {r.peer_id.to_base58(): r.cost for r in records if r.cost is not None and r.state == ServerState.ONLINE}
    if cost is not None:
        costs[mine] = cost
    swarm = settled.snapshot(placement.num_blocks, placement.replication, capacity, costs)
    target = next_move(swarm, mine, placement.span_len, placement.max_blocks)
    return None if target is None else _explain(others, serving, target, placement, speeds, spans, mine)


def _twin_moves(
    view: SwarmView, me: PeerID, serving: range, placement: Placement, yielding: frozenset[PeerID], target: range
) -> bool:
    """Whether a settled peer on ``serving`` with a smaller id would move to ``target`` too, seeing this view (with
    the throughput and move cost it announces): two peers alike both see the same move, and only one should load it."""
    settled = settled_spans(view, placement.num_blocks, me, yielding)
    for peer in sorted(view.alive, key=lambda p: p.to_bytes()):
        if peer.to_bytes() >= me.to_bytes():
            break
        if settled.spans.get(peer.to_base58()) != serving:
            continue
        # As the twin sees it: this peer alive too (a look pings everyone but the looker; only membership counts, so
        # the twin's own info stands in for this one's). Without it, the twin saw one server fewer on its span and
        # another move: three peers alike all moved at once (bench_seed).
        seen = SwarmView(view.records, {**view.alive, me: view.alive[peer]})
        theirs = _placed_move(seen, peer, serving, settled.speeds[peer.to_base58()], placement, yielding, None)
        if theirs is not None and theirs.target == target:
            return True
    return False


def home_move(others: list[int], num_blocks: int, home: range, serving: range, max_blocks: int | None) -> range | None:
    """The move of a peer told its span (``home``), or None. It leaves ``home`` only to serve blocks no other live
    peer serves: by moving a window of its length over them where the blocks it leaves keep another server, else by
    growing over ``home`` (up to ``max_blocks``); and it goes back to ``home`` as soon as every block there has a
    server again and the blocks it took have another. It never moves for replicas or throughput: its operator chose.
    ``others``: per block, the other live peers serving it (``decide_move`` counts, on blocks this peer serves, only
    those online: it hands a block to a peer still loading it only once that peer serves; elsewhere a peer loading a
    block counts: it is covered)."""
    capacity = max(len(home), max_blocks or len(home))
    grown = [
        range(start, start + length)
        for length in range(len(home) + 1, min(capacity, num_blocks) + 1)
        for start in range(max(0, home.stop - length), min(home.start, num_blocks - length) + 1)
    ]
    shifted = [range(start, start + len(home)) for start in range(num_blocks - len(home) + 1)]

    def holes(w: range) -> int:
        return sum(1 for b, count in enumerate(others) if count == 0 and b not in w)

    def key(w: range) -> tuple:  # fewest orphans left, fewest blocks, home, where it is, least to load
        kept = max(0, min(w.stop, serving.stop) - max(w.start, serving.start))
        return holes(w), len(w), w != home, w != serving, -kept, w.start

    best = min([serving, home, *shifted, *grown], key=key)
    return None if best == serving else best


def _counts_of(spans: dict[str, range], pinned: dict[int, int], num_blocks: int) -> list[int]:
    counts = [pinned.get(b, 0) for b in range(num_blocks)]
    for span in spans.values():
        for b in span:
            if b < num_blocks:
                counts[b] += 1
    return counts


def _explain(
    others: list[int],
    serving: range,
    target: range,
    placement: Placement,
    speeds: dict[str, float],
    spans: dict[str, range],
    mine: str,
) -> Move:
    """Which rule a move follows, with its numbers (``others``: per block, the other live servers)."""
    num_blocks, replication = placement.num_blocks, placement.replication
    covers = tuple(b for b in target if b not in serving and others[b] == 0)
    before = badness(coverage_with(dict(enumerate(others)), num_blocks, serving), replication)
    after = badness(coverage_with(dict(enumerate(others)), num_blocks, target), replication)
    dropped = [b for b in serving if b not in target]
    if covers:
        unserved = f"{before[0]} -> {after[0]}"
        reason = f"blocks {spans_text(list(covers))} have no other live server (blocks unserved {unserved})"
    elif placement.home is not None and target == placement.home:
        reason = f"back to its --blocks {target.start}:{target.stop}: blocks {spans_text(dropped)} have other servers"
    elif len(target) < len(serving):
        reason = f"back to {len(target)} blocks: blocks {spans_text(dropped)} have other servers"
    elif after[1] < before[1]:
        reason = f"replication: blocks short of {replication} servers {before[1]} -> {after[1]}"
    elif before[1] > 0:
        reason = f"a step of the plan that brings every block to {replication} servers (short now: {before[1]})"
    else:
        flow = block_throughput({**spans, mine: serving}, speeds, num_blocks)
        moved = block_throughput({**spans, mine: target}, speeds, num_blocks)
        reason = f"throughput: the weakest block {min(flow):.0f} -> {min(moved):.0f} tokens/s"
    return Move(target, reason, covers)


def others_serving(view: SwarmView, block: int, me: PeerID) -> list[tuple[str, bool]]:
    """Other live servers of ``block`` and whether each is moving away from it too."""
    return [
        (r.peer_id.to_base58(), r.moving_to is not None and block not in r.moving_to)
        for r in view.online(block, exclude=me)
    ]
