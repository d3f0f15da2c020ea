"""Which contiguous span of decoder blocks a peer serves: pure decisions over a snapshot of the swarm.

Coverage maps block -> number of OTHER peers serving it (missing keys mean 0). Every decision ranks spans by the
swarm's badness if this peer served them, so all peers optimise the same objective and cannot undo each other's moves.

A single move can stall short of coverage: 2-block peers at 0:2, 1:3, 3:5 and 6:8 leave block 5 without a server, and
any one move that covers it leaves another block without one. `next_move` then follows a plan, the shortest sequence of
moves that ends with one more block covered, computed from the snapshot alone so that every peer agrees on it; only the
plan's first mover moves, and the next round's plan is one move shorter.

Replicas stall the same way: 2-block peers at 0:2, 0:2, 1:3, 2:4, 3:5 and 4:6 serve every block and block 5 once, and
any one move that serves it again leaves another block short. While every block has a server and the spans hold R
servers' worth of blocks (R x blocks in all), `next_move` follows a `replica_plan`: the shortest sequence of moves that
lowers the replication deficit, each move keeping every block served and the deficit no higher. (blocks without a
server, deficit, plan length) drops with every step, so peers following plans converge and cannot oscillate. A plan
search weighs at most MAX_PLAN_WORK windows and spans (a few hundred ms); when it finds nothing, nobody moves. Peers
joining one after another need no plan: `choose_span` lines their spans up end to end, and R pipelines form as they
come; plans mend what departures and peers starting at the same moment leave.

Throughput comes after coverage, growth and replication: a peer moves for it only once every block has its replicas, and
never at their expense (while some lack them, moves for replicas and for throughput would take turns: a plan's step
moved back for throughput as soon as the plan is through). A pipeline runs as fast as its slowest block, so the swarm's
capacity is its least per-block throughput (the summed span throughput of the block's servers). A new peer takes the
window whose weakest block is weakest. A settled peer moves for throughput only to relieve the weakest block, when that
block has less than RELIEVE_BELOW of the mean block throughput and the move lifts the least throughput over the blocks
it touches by more than MIN_GAIN (`relief_move`). Joining peers arrive about as often as peers leave and go to the
weakest blocks for free, so a block only somewhat slow waits for them; a move costs loading time, during which the peer
still serves its old span, and download time for blocks whose weights are not on its disk (a model from the hub). A move
that takes T seconds gives nothing for T seconds of a PAYBACK horizon, so its lift counts for (1 - T / PAYBACK) of what
it would be at once: a peer with the weights on disk relieves a block before one that must download them, and a move
taking longer than the horizon is not made (peers announce what a move costs them: ``MoveCost``). Each such move raises
the sorted vector of per-block throughputs (the blocks it touches all end above the weakest one before it, the others
stay as they were) without raising the badness, and one peer per snapshot makes it: with consistent views peers cannot
oscillate.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from swarm.net.records import MoveCost

MAX_PLAN_STATES = 2000  # swarm states a plan search expands at most
MAX_PLAN_WORK = 1_500_000  # ... and the windows and spans it weighs in them at most: 0.3 s on one core
RELIEVE_BELOW = 0.6  # a move relieves a block below this fraction of the mean block throughput; others wait for joins
MIN_GAIN = 1 / 3  # ... and lifts the blocks it touches by a third: Petals moves for that gain (balance quality 0.75)
# A throughput move pays for its loading within this time, or is not made: joins and departures reshape a volunteer
# swarm within about an hour, so a lift that would arrive later is likely overtaken by them.
PAYBACK = 3600.0


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


def _prefix(flags: Iterator[bool]) -> list[int]:
    """Running sums of `flags`, so that any window's total is two lookups."""
    return list(accumulate(flags, initial=0))


def _badness_with(coverage: dict[int, int], num_blocks: int, replication: int) -> Callable[[range], tuple[int, int]]:
    """`badness(coverage_with(coverage, num_blocks, w), replication)` for any window `w`, in constant time: serving a
    block removes a hole where nobody serves it, and one unit of deficit where fewer than `replication` do."""
    counts = [coverage.get(b, 0) for b in range(num_blocks)]
    holes, deficit = badness(counts, replication)
    zero = _prefix(c == 0 for c in counts)
    under = _prefix(c < replication for c in counts)

    def of(w: range) -> tuple[int, int]:
        lo, hi = min(w.start, num_blocks), min(w.stop, num_blocks)
        return holes - (zero[hi] - zero[lo]), deficit - (under[hi] - under[lo])

    return of


def choose_span(
    coverage: dict[int, int],
    num_blocks: int,
    span_len: int,
    replication: int,
    throughput: dict[int, float] | None = None,
    rng: random.Random | None = None,
    held: set[int] | None = None,
    on_disk: set[int] | None = None,
) -> range:
    """Start-up span: the window that most reduces badness, then the one holding most of the blocks whose state this
    peer has on disk (``held``: a restarted peer serves again without copying state, and may hold the newest copy),
    then the one whose weakest block has the least `throughput` (then its second weakest, and so on): the swarm is as
    fast as its slowest block, and a new peer lifts it at no cost; then the one with most blocks whose weights are on
    this peer's disk (``on_disk``: nothing to download); then the one adding fewest breaks to the coverage
    (`_breaks_added`), so that spans meet end to end and line up into pipelines.

    Remaining ties are broken at random so that peers starting at the same moment spread out instead of piling up.
    """
    if num_blocks < 1 or span_len < 1:
        raise ValueError(f"need num_blocks >= 1 and span_len >= 1, got {num_blocks} and {span_len}")
    throughput, held, on_disk = throughput or {}, held or set(), on_disk or set()
    bad = _badness_with(coverage, num_blocks, replication)

    def key(w: range) -> tuple[tuple[int, int], int, tuple[float, ...], int, int]:
        weakest = tuple(sorted(throughput.get(b, 0.0) for b in w))
        breaks = _breaks_added(coverage, num_blocks, w)
        return bad(w), -len(held.intersection(w)), weakest, -len(on_disk.intersection(w)), breaks

    windows = _windows(num_blocks, min(span_len, num_blocks))
    best = min(key(w) for w in windows)
    return (rng or random.Random()).choice([w for w in windows if key(w) == best])


def _breaks_added(coverage: dict[int, int], num_blocks: int, window: range) -> int:
    """How many more breaks (blocks served by another number of peers than the block before them) there are once a
    peer serves `window`: -2 to 2. A window starting or ending inside a run of equally served blocks splits it, and
    the pieces are seldom a span long: peers filling them overlap their neighbours, and a block short of replicas
    then takes a chain of moves to mend (issue 56). A window flush with a break or the model's end leaves whole runs,
    so that R pipelines of spans meeting end to end form as peers join."""

    def added(inside: int, outside: int) -> int:
        if not 0 <= outside < num_blocks:
            return 0
        there, here = coverage.get(outside, 0), coverage.get(inside, 0)
        return (there != here + 1) - (there != here)

    return added(window.start, window.start - 1) + added(window.stop - 1, window.stop)


def plan_move(
    coverage: dict[int, int],
    num_blocks: int,
    current: range,
    span_len: int,
    replication: int,
    max_blocks: int | None = None,
) -> range | None:
    """The span to move to, or None to stay.

    A move happens only if it strictly lowers (blocks without a server, blocks beyond span_len, replication deficit),
    since `current` wins all other ties. With a consistent view every move lowers that potential, so peers converge
    instead of oscillating. Growing past span_len (up to `max_blocks`) is a takeover: it happens only to serve a block
    nobody serves, never to add a replica, and the peer shrinks back once others serve it. A peer holding more than
    `max_blocks` is not allowed to stay and shrinks back to its capacity.
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
    bad = _badness_with(coverage, num_blocks, replication)

    def key(w: range) -> tuple[int, int, int, int, int, int]:
        holes, deficit = bad(w)
        return holes, max(0, len(w) - span_len), deficit, int(w != current), -_overlap(w, current), w.start

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


@dataclass(frozen=True)
class Snapshot:
    """The swarm as a peer's move weighs it. ``spans``: every settled live peer's span (the deciding peer's
    included); ``pinned``: per block, the servers no plan moves (joining or moving peers); ``capacity``: peer -> the
    blocks it may grow to, as announced; ``speeds``: each peer in ``spans`` -> its span throughput (tokens/s, as
    announced); ``pinned_throughput``: per block, the throughput the pinned servers will bring there; ``costs``: peer
    -> what a move costs it, as announced (a peer without one moves for free)."""

    spans: Mapping[str, range]
    num_blocks: int
    replication: int
    pinned: Mapping[int, int] | None = None
    capacity: Mapping[str, int] | None = None
    speeds: Mapping[str, float] | None = None
    pinned_throughput: Mapping[int, float] | None = None
    costs: Mapping[str, MoveCost] | None = None

    def counts(self) -> list[int]:
        """Per block, its servers: those in ``spans`` and the pinned ones."""
        counts = [(self.pinned or {}).get(b, 0) for b in range(self.num_blocks)]
        for span in self.spans.values():
            for b in span:
                counts[b] += 1
        return counts


def next_move(
    swarm: Snapshot,
    me: str,
    span_len: int,
    max_blocks: int | None = None,
    relieve_below: float = RELIEVE_BELOW,
    min_gain: float = MIN_GAIN,
) -> range | None:
    """This peer's (``me``) move this round, or None: the `plan_move` one if it leaves no block without a server,
    else this peer's step of the `cover_plan` while some block has no server, else its step of the `replica_plan`
    while some block has fewer than `replication` servers, else, given speeds, the `relief_move` if it falls to this
    peer.

    A move dropping a block nobody else serves is no move at all: the daemon would load it, have `safe_to_drop`
    refuse it, and try again every round. With capacities, a growth over orphaned blocks is left to the peer that
    covers one of them at least cost (least time by the announced costs, then fewest blocks added, then smallest id),
    so that one peer takes them over instead of every one in reach. Without speeds nobody moves for throughput.
    """
    counts = swarm.counts()
    target = _own_move(swarm, me, counts, span_len, max_blocks)
    if target is not None:
        grows = len(target) > len(swarm.spans[me])
        if grows and swarm.capacity is not None and _outgrown(swarm, me, target, counts):
            return None
        return target
    if 0 in counts:
        plan = cover_plan(swarm)
    elif badness(counts, swarm.replication)[1]:
        plan = replica_plan(swarm)
    else:
        move = None if swarm.speeds is None else relief_move(swarm, relieve_below, min_gain)
        plan = [move] if move is not None else []
    return plan[0][1] if plan and plan[0][0] == me else None


def block_throughput(
    spans: Mapping[str, range],
    speeds: Mapping[str, float],
    num_blocks: int,
    pinned_throughput: Mapping[int, float] | None = None,
) -> list[float]:
    """Per block, the summed span throughput (tokens/s) of the peers in `spans` serving it, plus what joining and
    moving peers will bring there (`pinned_throughput`)."""
    flow = [(pinned_throughput or {}).get(b, 0.0) for b in range(num_blocks)]
    for peer, span in spans.items():
        for b in span:
            if b < num_blocks:
                flow[b] += speeds.get(peer, 0.0)
    return flow


def relief_move(
    swarm: Snapshot, level: float = RELIEVE_BELOW, gain: float = MIN_GAIN, payback: float = PAYBACK
) -> tuple[str, range] | None:
    """The one move for throughput that this snapshot calls for, as (peer, window), or None (always None without
    its `speeds`).

    It relieves the weakest block, if that block has less than `level` of the mean block throughput: some settled peer
    of span throughput x takes a window of its span's length holding that block, such that the least throughput over
    the blocks it leaves and enters, after the move, exceeds (1 + `gain`) x the weakest block's now. A move taking T
    seconds (`costs`: its peer's announced load and download times) counts that lift for (1 - T / `payback`) of it.
    Among those moves, the one after which the swarm's weakest block is strongest wins, then the one lifting the blocks
    it touches most, then the one loading fewest blocks, then the smallest peer id and start. A move must not raise the
    badness (holes, then replication deficit, counting `pinned` servers); `pinned_throughput` is what joining and
    moving peers will bring where they go, so that two peers do not both rush to the same block. Every peer computes the
    same move from the same snapshot and only its peer makes it.
    """
    spans, speeds, num_blocks, costs = swarm.spans, swarm.speeds or {}, swarm.num_blocks, swarm.costs
    counts = swarm.counts()
    flow = block_throughput(spans, speeds, num_blocks, swarm.pinned_throughput)
    weakest = min(range(num_blocks), key=flow.__getitem__)
    floor = flow[weakest]
    if floor >= level * sum(flow) / num_blocks or max(speeds.values(), default=0.0) <= gain * floor:
        return None  # the common case, found at once: no block slow enough, or no peer fast enough to lift it
    order = sorted(range(num_blocks), key=flow.__getitem__)
    neutral = _neutral(counts, swarm.replication)
    best: tuple[tuple[float, float, int, str, int], str, range] | None = None
    for peer in sorted(spans):
        span, speed = spans[peer], speeds.get(peer, 0.0)
        if weakest in span or speed <= gain * floor:
            continue
        for start in range(max(0, weakest - len(span) + 1), min(weakest, num_blocks - len(span)) + 1):
            window = range(start, start + len(span))
            if not neutral(span, window):
                continue
            seconds = costs[peer].seconds(span, window) if costs and peer in costs else 0.0
            if seconds >= payback:
                continue
            lifted = floor + (_lifted(flow, span, window, speed) - floor) * (1 - seconds / payback)
            if lifted <= (1 + gain) * floor:
                continue
            rest = next((flow[b] for b in order if b not in span and b not in window), lifted)
            key = (-min(lifted, rest), -lifted, len(window) - _overlap(span, window), peer, start)
            if best is None or key < best[0]:
                best = (key, peer, window)
    return None if best is None else (best[1], best[2])


def _lifted(flow: Sequence[float], span: range, window: range, speed: float) -> float:
    """The least throughput over `span` and `window` once a peer of span throughput `speed` moved from one to the
    other."""
    return min(
        [flow[b] - speed for b in span if b not in window]
        + [flow[b] + speed for b in window if b not in span]
        + [flow[b] for b in window if b in span]
    )


def _neutral(counts: Sequence[int], replication: int) -> Callable[[range, range], bool]:
    """Whether a peer moving from one span to another of the same length leaves the badness as it is or lowers it:
    no block it leaves is left without a server, and it leaves no more blocks short of `replication` servers than it
    brings up to it (prefix sums: constant time per move)."""
    alone = _prefix(c <= 1 for c in counts)
    thin = _prefix(c <= replication for c in counts)
    under = _prefix(c < replication for c in counts)

    def of(span: range, window: range) -> bool:
        if window.start > span.start:
            left, entered = (span.start, min(window.start, span.stop)), (max(window.start, span.stop), window.stop)
        else:
            left, entered = (max(span.start, window.stop), span.stop), (window.start, min(span.start, window.stop))
        if alone[left[1]] - alone[left[0]]:
            return False
        return thin[left[1]] - thin[left[0]] <= under[entered[1]] - under[entered[0]]

    return of


def _own_move(swarm: Snapshot, peer: str, counts: list[int], span_len: int, max_blocks: int | None) -> range | None:
    """`peer`'s `plan_move` target, unless it drops a block nobody else serves (``counts``: the snapshot's)."""
    current = swarm.spans[peer]
    others = {b: c - (b in current) for b, c in enumerate(counts)}
    target = plan_move(others, swarm.num_blocks, current, span_len, swarm.replication, max_blocks)
    return target if target is not None and all(others[b] for b in current if b not in target) else None


def _outgrown(swarm: Snapshot, me: str, target: range, counts: list[int]) -> bool:
    """Whether another settled peer's own move serves one of the orphaned blocks `target` grows over sooner: in less
    time (the snapshot's `costs`: what each peer announced a move costs it; none said: no time), then adding fewer
    blocks than this growth does, then the smaller id. Orphaned blocks stop training until someone serves them: the
    peer that has their weights on disk takes them before one that must download them. Each peer's move is judged as
    it judges it itself, with the span it serves as its span length (the other peer's --num-blocks is not announced)
    and up to the `capacity` it announces."""
    spans, capacity, costs = swarm.spans, swarm.capacity or {}, swarm.costs or {}

    def cost(peer: str, grown: range) -> tuple[float, int, str]:
        seconds = costs[peer].seconds(spans[peer], grown) if peer in costs else 0.0
        return seconds, len(grown) - len(spans[peer]), peer

    orphans = {b for b in target if counts[b] == 0}
    mine = cost(me, target)
    for peer, span in spans.items():
        room = capacity.get(peer, 0)
        if peer == me:
            continue
        theirs = _own_move(swarm, peer, counts, len(span), max(len(span), room))
        if theirs is not None and orphans.intersection(theirs) and cost(peer, theirs) < mine:
            return True
    return False


def cover_plan(swarm: Snapshot, max_states: int = MAX_PLAN_STATES) -> list[tuple[str, range]]:
    """The shortest list of (peer, new span) moves of the peers in the snapshot's `spans` (its `pinned` servers stay)
    after which one more block has a server; [] if there is none within `max_states` expanded swarm states (or
    MAX_PLAN_WORK weighed).

    Each move keeps the peer's span length and leaves no block without a server, so `safe_to_drop` has no reason to
    refuse it; each one but the last covers no new block and does not raise the replication deficit, the last covers
    a block. So no step raises the badness and each lowers (blocks without a server, plan length): peers following
    plans cannot oscillate. The search is breadth-first, spans by start then windows by start, and of the peers on
    one span the smallest id moves, so the plan depends on the snapshot alone and every peer that sees it agrees on
    who moves first.
    """
    return _plan(swarm, max_states, replicas=False)


def replica_plan(swarm: Snapshot, max_states: int = MAX_PLAN_STATES) -> list[tuple[str, range]]:
    """`cover_plan` for replicas: the shortest list of moves after which the replication deficit is lower, while
    every block has a server and the swarm serves `replication` x `num_blocks` blocks in all (`pinned` included);
    [] otherwise, or if there is none within `max_states` expanded states.

    Short of that capacity some block stays short whatever the peers do: single moves still lower the deficit, and
    a search for more would spend its budget at every change of the swarm. Each move keeps its peer's span length
    and leaves every block served; each but the last leaves the deficit as it is, the last lowers it: so (deficit,
    plan length) drops with every step.
    """
    num_blocks = swarm.num_blocks
    pins = sum(c for b, c in (swarm.pinned or {}).items() if 0 <= b < num_blocks)
    if sum(len(s) for s in swarm.spans.values()) + pins < swarm.replication * num_blocks:
        return []
    return _plan(swarm, max_states, replicas=True)


def _plan(swarm: Snapshot, max_states: int, replicas: bool) -> list[tuple[str, range]]:
    """The search's moves, each made by the first peer (by id) on the span it moves from."""
    spans, num_blocks, pinned = swarm.spans, swarm.num_blocks, swarm.pinned
    frozen = tuple(sorted((span.start, len(span)) for span in spans.values()))
    pins = tuple(sorted((b, c) for b, c in (pinned or {}).items() if c and 0 <= b < num_blocks))
    where = {peer: spans[peer] for peer in sorted(spans)}
    plan = []
    for old, window in _search(frozen, pins, num_blocks, swarm.replication, max_states, replicas):
        peer = next(p for p, span in where.items() if span == old)
        where[peer] = window
        plan.append((peer, window))
    return plan


@lru_cache(maxsize=16)  # every peer seeing the same snapshot asks for the same plan
def _search(
    frozen: tuple[tuple[int, int], ...],
    pins: tuple[tuple[int, int], ...],
    num_blocks: int,
    replication: int,
    limit: int,
    replicas: bool,
) -> tuple[tuple[range, range], ...]:
    """Breadth-first search for a plan, as (old span, new span) moves, ending in a move that covers a block or
    (`replicas`) lowers the deficit; a state's counts are made from its parent's when it is expanded.

    Peers on one span are interchangeable, so a state is the sorted (start, length) of every span: a swarm of equal
    GPUs is searched once, not once per order of its peers. The search stops after `limit` states, or once it has
    weighed MAX_PLAN_WORK windows and spans (a state of a large swarm has thousands).
    """
    counts = [0] * num_blocks
    for b, c in pins:
        counts[b] += c
    for start, length in frozen:
        for b in range(start, start + length):
            counts[b] += 1
    holes, deficit = badness(counts, replication)
    if (holes or not deficit) if replicas else not holes:
        return ()  # nothing this plan mends
    seen = {frozen}
    queue = deque([(frozen, counts, None, ())])
    work = 0
    for _ in range(limit):
        if not queue or work > MAX_PLAN_WORK:
            break
        state, counts, move, path = queue.popleft()
        if move is not None:
            counts = _moved(counts, *move)
        steps, weighed = _steps(state, counts, replication)
        work += weighed + len(steps) * len(state)  # each next state is built and hashed
        for j, new, covered, lowered in steps:
            old, length = state[j]
            step = (*path, (range(old, old + length), range(new, new + length)))
            if lowered > 0 if replicas else covered:
                return step
            following = _replaced(state, j, (new, length))
            if following not in seen:
                seen.add(following)
                queue.append((following, counts, (old, new, length), step))
    return ()


def _replaced(state: tuple[tuple[int, int], ...], j: int, span: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    spans = list(state)
    del spans[j]
    insort(spans, span)
    return tuple(spans)


def _moved(counts: list[int], old: int, new: int, length: int) -> list[int]:
    counts = list(counts)
    for b in range(old, old + length):
        counts[b] -= 1
    for b in range(new, new + length):
        counts[b] += 1
    return counts


def _steps(
    state: tuple[tuple[int, int], ...], counts: list[int], replication: int
) -> tuple[list[tuple[int, int, int, int]], int]:
    """Every allowed move from one state, as (index of the span in `state`, new start, blocks it covers, deficit it
    lowers by): those covering a block, and those not raising the deficit; and how many blocks and windows were
    weighed to find them. Of the peers on one span, one stands for all.

    A peer may only move to windows holding every block it serves alone, so nothing is left uncovered; the blocks it
    leaves and enters are two intervals, whose effect on holes and deficit the prefix sums give in constant time.
    """
    num_blocks = len(counts)
    zero = _prefix(c == 0 for c in counts)
    under = _prefix(c < replication for c in counts)  # entering lowers the deficit
    thin = _prefix(c <= replication for c in counts)  # leaving raises it
    alone = _prefix(c == 1 for c in counts)
    moves, weighed = [], num_blocks
    for j, (old, length) in enumerate(state):
        if j and state[j - 1] == state[j]:
            continue
        lo, hi = _window_starts(alone, old, length, num_blocks)
        candidates = _candidates(old, length, lo, hi, under)
        weighed += hi - lo + 1 + len(candidates)
        for new in candidates:
            if abs(new - old) >= length:
                left, entered = (old, old + length), (new, new + length)
            elif new > old:
                left, entered = (old, new), (old + length, new + length)
            else:
                left, entered = (new + length, old + length), (new, old)
            covered = zero[entered[1]] - zero[entered[0]]
            lowered = (under[entered[1]] - under[entered[0]]) - (thin[left[1]] - thin[left[0]])
            if covered or lowered >= 0:
                moves.append((j, new, covered, lowered))
    return moves, weighed


def _window_starts(alone: list[int], start: int, length: int, num_blocks: int) -> tuple[int, int]:
    """The least and greatest start of a window holding every block the span at `start` serves alone (`alone`: the
    running count of such blocks, bisected for the first and last of them in the span); any window if none."""
    stop = start + length
    if alone[stop] == alone[start]:
        return 0, num_blocks - length
    first, last = bisect_right(alone, alone[start]) - 1, bisect_left(alone, alone[stop]) - 1
    return max(0, last - length + 1), min(first, num_blocks - length)


def _candidates(old: int, length: int, lo: int, hi: int, under: list[int]) -> list[int]:
    """The starts in [lo, hi] worth weighing for a peer whose span starts at `old`: windows overlapping that span,
    and windows holding a block short of replicas (`under`: their running count). Any other is a jump that leaves
    every block the peer serves and enters none short of replicas: it raises the deficit, unless the peer serves
    only blocks with spare replicas, and then a window holding a short block is a plan's last move, found in the same
    expansion."""
    return [s for s in range(lo, hi + 1) if s != old and (abs(s - old) < length or under[s + length] > under[s])]
