"""Chains on the wire: the route a span request carries (the peers after the one it is sent to), what the hops that
ran report back (how long each took, who holds which gradients), and where a chain broke.

A chained request runs on the peer it is sent to, which passes its output on to the first hop of the route itself;
the hops' acks come back along the chain. A forward that names a ``Delivery`` has its last hop hand the output to the
client's ``collect`` instead (the reply along the chain then carries acks only); one without, or a last hop that
cannot hold it, answers along the chain with it. A hop that cannot reach the next one answers with its own output
and the failure, so that the client goes on from there (``reached``) without recomputing the spans before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from swarm.net.errors import RequestError
from swarm.net.gradhash import read_grad_hash
from swarm.net.gradnorm import GradNorm, read_grad_norm

MAX_ROUTE = 256  # hops a route may name (a model has fewer blocks than that)
MAX_ROUTE_MADDRS = 8  # addresses a route may give for one hop
T = TypeVar("T")
HOP_SLACK = 2.0  # seconds each hop adds to the wait for a chain (its transfers, its queue)


@dataclass(frozen=True)
class ChainHop:
    """A hop of a route: who, which blocks, how long the caller may wait for it alone (seconds), and the addresses
    the client knows it at (so that the previous peer can dial it, or reach it through its relay)."""

    peer: str
    start: int
    end: int
    timeout: float
    maddrs: tuple[str, ...] = ()

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def to_wire(self) -> list:
        return [self.peer, self.start, self.end, self.timeout, list(self.maddrs)]


@dataclass(frozen=True)
class Delivery:
    """Where a chain's last hop puts its output: held for the client's ``collect`` of ``token``, at most ``hold``
    seconds (the chain's timeout: the client has given up on the chain by then)."""

    token: str
    hold: float

    def to_wire(self) -> list:
        return [self.token, self.hold]


MAX_HOLD = 600.0  # seconds a peer keeps an output for a collect, whatever the request asks
TOKEN_CHARS = 64


def read_delivery(meta: dict, key: str) -> Delivery | None:
    value = meta.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise RequestError(f"{key!r} must be [token, hold seconds]")
    token, hold = value
    if not 1 <= len(token) <= TOKEN_CHARS:
        raise RequestError(f"{key!r}: a token is 1 to {TOKEN_CHARS} characters")
    if not isinstance(hold, int | float) or isinstance(hold, bool) or not 0 < hold <= MAX_HOLD:
        raise RequestError(f"{key!r}: the hold must be seconds in (0, {MAX_HOLD:g}]")
    return Delivery(token, float(hold))


def write_delivery(delivery: Delivery | None) -> list | None:
    return None if delivery is None else delivery.to_wire()


def route_timeout(route: list[ChainHop]) -> float:
    """How long a caller waits for a chain: each hop's own time and some slack, summed."""
    return sum(hop.timeout + HOP_SLACK for hop in route)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hop(entry: object) -> ChainHop:
    if not isinstance(entry, list) or len(entry) != 5:
        raise ValueError(f"{entry!r} is not [peer, start, end, timeout, maddrs]")
    peer, start, end, timeout, maddrs = entry
    if not isinstance(peer, str) or not peer:
        raise ValueError(f"{peer!r} is not a peer id")
    if not (_is_int(start) and _is_int(end) and 0 <= start < end):
        raise ValueError(f"{start!r}:{end!r} is not a block range")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ValueError(f"{timeout!r} is not a timeout in seconds")
    if not isinstance(maddrs, list) or len(maddrs) > MAX_ROUTE_MADDRS or not all(isinstance(m, str) for m in maddrs):
        raise ValueError(f"{maddrs!r} is not a list of at most {MAX_ROUTE_MADDRS} multiaddrs")
    return ChainHop(peer, start, end, float(timeout), tuple(maddrs))


def _read_hops(meta: dict, key: str, read: Callable[[object], T], most: int) -> list[T]:
    """A list of at most ``most`` hops (absent: none), each read by ``read`` (which raises ValueError)."""
    value = meta.get(key, [])
    if not isinstance(value, list) or len(value) > most:
        raise RequestError(f"{key!r} must be a list of at most {most} hops")
    try:
        return [read(entry) for entry in value]
    except ValueError as e:
        raise RequestError(f"{key!r}: {e}") from None


def read_route(meta: dict, key: str) -> list[ChainHop]:
    """The hops after this one, in the order the request travels."""
    return _read_hops(meta, key, _hop, MAX_ROUTE)


def write_route(route: list[ChainHop]) -> list:
    return [hop.to_wire() for hop in route]


@dataclass(frozen=True)
class HopAck:
    """A hop that ran: which peer, which blocks, and the seconds it spent from the request's arrival to its answer
    (the chain after it included), and of them computing its own blocks (None from a peer that does not say); after a
    backward, its blocks' accumulated gradient norms (see swarm/net/gradnorm.py)
    and the hash of each block's LoRA gradients of the micro-batch, as this hop holds them (swarm/net/gradhash.py).
    """

    peer: str
    start: int
    end: int
    seconds: float
    norms: tuple[GradNorm, ...] = ()
    hashes: tuple[tuple[int, str], ...] = ()  # (block, gradient hash), after a backward
    compute: float | None = None

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


def _ack(entry: object) -> HopAck:
    if not isinstance(entry, list) or len(entry) not in (4, 5, 6, 7):
        raise ValueError(f"{entry!r} is not [peer, start, end, seconds, norms?, hashes?, compute?]")
    peer, start, end, seconds = entry[:4]
    norms = entry[4] if len(entry) >= 5 else []
    hashes = entry[5] if len(entry) >= 6 else []
    compute = entry[6] if len(entry) == 7 else None
    if not isinstance(peer, str) or not (_is_int(start) and _is_int(end) and 0 <= start < end):
        raise ValueError(f"{entry!r} is not [peer, start, end, seconds]")
    for duration in (seconds,) if compute is None else (seconds, compute):
        if not isinstance(duration, int | float) or isinstance(duration, bool) or not 0 <= duration < math.inf:
            raise ValueError(f"{duration!r} is not a duration")
    if not isinstance(norms, list) or len(norms) > end - start:
        raise ValueError(f"{norms!r} is not a list of the hop's blocks' gradient norms")
    read = tuple(read_grad_norm(n) for n in norms)
    if any(n.block not in range(start, end) for n in read):
        raise ValueError(f"gradient norms {norms!r} name blocks outside the hop's {start}:{end}")
    spent = None if compute is None else float(compute)
    return HopAck(peer, start, end, float(seconds), read, _hashes(hashes, range(start, end)), spent)


def _hashes(value: object, blocks: range) -> tuple[tuple[int, str], ...]:
    """A hop's ``[[block, hash], ...]``: each of its blocks at most once."""
    if not isinstance(value, list) or len(value) > len(blocks):
        raise ValueError(f"{value!r} is not a list of the hop's blocks' gradient hashes")
    read = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0]) and item[0] in blocks):
            raise ValueError(f"{item!r} is not [block, hash] for a block of the hop's {blocks.start}:{blocks.stop}")
        read.append((item[0], read_grad_hash(item[1])))
    if len({block for block, _ in read}) != len(read):
        raise ValueError(f"gradient hashes {value!r} name a block twice")
    return tuple(read)


def read_acks(meta: dict, key: str) -> list[HopAck]:
    return _read_hops(meta, key, _ack, MAX_ROUTE + 1)


def write_acks(acks: list[HopAck]) -> list:
    return [
        [a.peer, a.start, a.end, a.seconds, [n.to_wire() for n in a.norms], [list(h) for h in a.hashes]]
        + ([] if a.compute is None else [a.compute])
        for a in acks
    ]


class FailureKind:
    """How a hop failed to reach the next one: a refusal (its error kind), no answer in time, or no connection."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"  # the caller could not connect: the peer may be dead, or only out of its reach


@dataclass(frozen=True)
class ChainFailure:
    """Where a chain broke: the peer that did not answer (or refused), how, and why."""

    peer: str
    kind: str
    error: str

    def to_wire(self) -> list:
        return [self.peer, self.kind, self.error]


def read_failure(meta: dict, key: str) -> ChainFailure | None:
    value = meta.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, str) for v in value)):
        raise RequestError(f"{key!r} must be [peer, kind, error]")
    return ChainFailure(*value)


def write_failure(failure: ChainFailure | None) -> list | None:
    return None if failure is None else failure.to_wire()
