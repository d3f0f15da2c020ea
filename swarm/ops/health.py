"""A swarm's health, model by model, from one ``SwarmView``: the single source of truth for ``swarm status``'s table
and ``swarm monitor``'s page, so that the two never disagree.

``build`` is pure (one observation in, one state out); ``Tracker`` adds what only a watcher over time can know:
how long a peer has been up, which peers left recently, how fast each adapter trains."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from swarm.net.protocol import MemoryUse, MoveEntry
from swarm.net.records import CommittedRecord, ServerRecord, ServerState
from swarm.net.view import SwarmView

HEALTHY, DEGRADED, BROKEN = "healthy", "degraded", "broken"
GONE = "gone"
UNREACHABLE = "unreachable"
MISMATCHED = "mismatched"  # serves blocks from other weights than every trained adapter's (a look-alike model)
LOW_HOST_MEMORY = 0.1  # a peer's machine with less than this share of its memory available is heading for trouble
KEPT_INPUTS_HIGH = 0.8  # past this share of --kept-inputs-mb, a few more micro-batches get forwards refused


def short(peer: str) -> str:
    """A peer id as people read it: enough characters to tell peers apart."""
    return f"{peer[:6]}..{peer[-4:]}"


@dataclass
class Server:
    """One block's record of one peer, as that block sees it."""

    peer: str
    state: str  # online, joining, leaving, unreachable (a record nobody answers for), or mismatched (other weights)
    relayed: bool
    start: int
    end: int
    throughput: float
    steps: dict[str, int]  # adapter -> the step of this block on that peer


@dataclass
class Copies:
    """How many live peers hold one block of an adapter at its newest step (served or standby)."""

    step: int
    count: int


@dataclass
class Block:
    block: int
    online: int  # live servers in state online
    servers: list[Server]
    standby: dict[str, dict[str, int]]  # peer -> adapter -> step of its standby copy of this block
    copies: dict[str, Copies]  # adapter -> copies of its newest step


@dataclass
class Holding:
    """What one peer holds of one adapter: served and standby steps per block."""

    steps: dict[int, int]
    standby: dict[int, int]


@dataclass
class Peer:
    peer: str
    short: str
    state: str  # online, joining, leaving, unreachable, mismatched, or gone (left recently; only the tracker says so)
    relayed: bool
    start: int
    end: int
    throughput: float
    adapters: dict[str, Holding] = field(default_factory=dict)
    standby_blocks: list[int] = field(default_factory=list)
    weights: str = ""  # quantization / compute dtype, as the peer reports it
    memory: MemoryUse | None = None  # as the peer reports it (None: it did not answer, or predates the report)
    moves: list[MoveEntry] = field(default_factory=list)  # its moves in the last hour, as it reports them
    dishonest: list[str] = field(default_factory=list)  # adapters whose trainer banned it (outvoted by its replicas)
    up_since: float | None = None  # wall-clock time the monitor first saw it (tracker)
    gone_since: float | None = None  # wall-clock time it disappeared (tracker)


@dataclass
class Adapter:
    name: str
    newest: int  # the newest step any live peer holds
    committed: int | None  # from the trainer's committed record, if read
    trainer: str | None
    copies: dict[int, int]  # block -> live peers holding it at the newest step
    recoveries: list[dict] = field(default_factory=list)  # the trainer's last few: peer, during, step, seconds
    steps_lost: int = 0  # the trainer's count of updates lost
    dishonest: list[str] = field(default_factory=list)  # peers its trainer banned: outvoted by their replicas
    steps_per_minute: float | None = None  # tracker


@dataclass
class ModelHealth:
    model: str
    num_blocks: int
    replication: int
    status: str  # healthy, degraded or broken
    problems: list[str]
    blocks: list[Block]
    peers: list[Peer]
    adapters: list[Adapter]


def build(
    model: str,
    num_blocks: int,
    view: SwarmView,
    replication: int,
    committed: dict[str, CommittedRecord] | None = None,
) -> ModelHealth:
    """Turn one observation into a health state: per block, per peer, per adapter, and the problems in words."""
    newest = _newest_steps(view)
    pins = [record.weights for record in (committed or {}).values() if record.weights]
    blocks = [_block(view, block, newest, pins) for block in range(num_blocks)]
    online = [b.online for b in blocks]
    status = BROKEN if 0 in online else DEGRADED if any(n < replication for n in online) else HEALTHY
    peers = _peers(view, pins)
    adapters = [_adapter(name, step, blocks, (committed or {}).get(name)) for name, step in sorted(newest.items())]
    for peer in peers:
        peer.dishonest = [a.name for a in adapters if peer.peer in a.dishonest]
    return ModelHealth(
        model=model,
        num_blocks=num_blocks,
        replication=replication,
        status=status,
        problems=_problems(online, replication, peers, adapters),
        blocks=blocks,
        peers=peers,
        adapters=adapters,
    )


def mismatched(record: ServerRecord, pins: list[dict[int, str]]) -> bool:
    """Whether a peer serves its blocks from other weights than every adapter trained here was pinned to: nobody's
    trainer routes to it (it is another model under the same name)."""
    return bool(pins) and all(record.conflicts(pin) for pin in pins)


def _state(record: ServerRecord, answered: bool, pins: list[dict[int, str]]) -> str:
    if not answered:
        return UNREACHABLE
    return MISMATCHED if mismatched(record, pins) else record.state.value


def _block(view: SwarmView, block: int, newest: dict[str, int], pins: list[dict[int, str]]) -> Block:
    servers, online = [], 0
    for record in view.records.get(block, []):
        info = view.alive.get(record.peer_id)
        state = _state(record, info is not None, pins)
        online += state == ServerState.ONLINE.value
        steps = {}
        if info is not None:
            steps = {name: a.steps[block] for name, a in sorted(info.adapters.items()) if block in a.steps}
        servers.append(
            Server(
                peer=record.peer_id.to_base58(),
                state=state,
                relayed=record.relayed,
                start=record.start,
                end=record.end,
                throughput=record.throughput,
                steps=steps,
            )
        )
    standby = {}
    for peer, info in view.alive.items():
        held = {name: a.standby[block] for name, a in sorted(info.adapters.items()) if block in a.standby}
        if held:
            standby[peer.to_base58()] = held
    copies = {
        name: Copies(step, sum(1 for info in view.alive.values() if _step_of(info, name, block) == step))
        for name, step in sorted(newest.items())
    }
    return Block(block=block, online=online, servers=servers, standby=standby, copies=copies)


def _step_of(info, name: str, block: int) -> int | None:
    return info.adapters[name].step_of(block) if name in info.adapters else None


def _newest_steps(view: SwarmView) -> dict[str, int]:
    """Per adapter, the newest step any live peer holds of any block: the trainer's committed step."""
    newest: dict[str, int] = {}
    for info in view.alive.values():
        for name, adapter in info.adapters.items():
            for step in [*adapter.steps.values(), *adapter.standby.values()]:
                newest[name] = max(newest.get(name, step), step)
    return newest


def _peers(view: SwarmView, pins: list[dict[int, str]]) -> list[Peer]:
    """One row per peer named in the records, from its newest announcement and (if it answered) its own info."""
    latest: dict[PeerID, ServerRecord] = {}
    for records in view.records.values():
        for record in records:
            if record.peer_id not in latest or record.announced_at > latest[record.peer_id].announced_at:
                latest[record.peer_id] = record
    peers = []
    for peer_id, record in latest.items():
        info = view.alive.get(peer_id)
        text = peer_id.to_base58()
        peers.append(
            Peer(
                peer=text,
                short=short(text),
                state=_state(record, info is not None, pins),
                relayed=record.relayed,
                start=record.start,
                end=record.end,
                throughput=record.throughput,
                adapters={n: Holding(dict(a.steps), dict(a.standby)) for n, a in sorted(info.adapters.items())}
                if info is not None
                else {},
                standby_blocks=sorted(info.standby_blocks) if info is not None else [],
                weights=info.weights if info is not None else "",
                memory=info.memory if info is not None else None,
                moves=list(info.moves) if info is not None else [],
            )
        )
    return sorted(peers, key=lambda p: (p.start, p.end, p.peer))


def _adapter(name: str, newest: int, blocks: list[Block], committed: CommittedRecord | None) -> Adapter:
    return Adapter(
        name=name,
        newest=newest,
        committed=committed.step if committed is not None else None,
        trainer=committed.trainer if committed is not None else None,
        copies={b.block: b.copies[name].count for b in blocks if name in b.copies},
        recoveries=list(committed.recoveries) if committed is not None else [],
        steps_lost=committed.steps_lost if committed is not None else 0,
        dishonest=list(committed.dishonest) if committed is not None else [],
    )


def ranges(blocks: list[int]) -> Iterator[tuple[int, int]]:
    """Runs of consecutive blocks, as (first, last)."""
    run: list[int] = []
    for block in sorted(blocks):
        if run and block != run[-1] + 1:
            yield run[0], run[-1]
            run = []
        run.append(block)
    if run:
        yield run[0], run[-1]


def _blocks_have(first: int, last: int) -> str:
    return f"block {first} has" if first == last else f"blocks {first}-{last} have"


def _problems(online: list[int], replication: int, peers: list[Peer], adapters: list[Adapter]) -> list[str]:
    """What is wrong, each in a sentence that says what it means for training and what to do."""
    problems = []
    for first, last in ranges([b for b, n in enumerate(online) if n == 0]):
        problems.append(
            f"{_blocks_have(first, last)} no server: training is paused until a peer serves them "
            f"(start `swarm peer --blocks {first}:{last + 1}`, or wait for a takeover)"
        )
    for count in sorted({n for n in online if 0 < n < replication}):
        for first, last in ranges([b for b, n in enumerate(online) if n == count]):
            if count == 1:
                problems.append(
                    f"{_blocks_have(first, last)} one server: a failure there would pause training "
                    "(start another `swarm peer`; it chooses the blocks that need it)"
                )
            else:
                problems.append(
                    f"{_blocks_have(first, last)} {count} servers, below the target of {replication} "
                    "(start another `swarm peer`; it chooses the blocks that need it)"
                )
    for peer in peers:
        if peer.state == UNREACHABLE:
            problems.append(
                f"peer {peer.short} (blocks {peer.start}:{peer.end}) does not answer: it is not counted, and its "
                "record lingers until it expires"
            )
        if peer.state == MISMATCHED:
            problems.append(
                f"peer {peer.short} (blocks {peer.start}:{peer.end}) serves other weights under this model's name "
                "(another fine-tune, revision or renamed model): no adapter trained here uses it; point it at the "
                "right model folder, or give its model folder another name"
            )
    problems.extend(_memory_problems(peers))
    for adapter in adapters:
        for peer in adapter.dishonest:
            problems.append(
                f"adapter {adapter.name}: peer {short(peer)} is dishonest (its results or its state disagreed with "
                "its replicas' majority): the trainer no longer uses it; stop it or check its machine"
            )
        if adapter.steps_lost:
            problems.append(
                f"adapter {adapter.name}: {adapter.steps_lost} step(s) lost so far (every copy of some block died; "
                "the trainer's model.steps_lost says which): run peers with --checkpoint-dir and enough standby room"
            )
        for first, last in ranges([b for b, count in adapter.copies.items() if count == 0]):
            problems.append(
                f"adapter {adapter.name}: {_blocks_have(first, last)} no live copy of step {adapter.newest}: "
                "training resumes there from a checkpoint or an older copy, if a peer has one"
            )
        for first, last in ranges([b for b, count in adapter.copies.items() if count == 1]):
            problems.append(
                f"adapter {adapter.name}: {_blocks_have(first, last)} one copy of step {adapter.newest}: "
                "one failure there would lose the step (peers with room for standby copies fix it)"
            )
    return problems


def _memory_problems(peers: list[Peer]) -> list[str]:
    """Peers heading for trouble with memory, in sentences that say what happens next and what to do."""
    problems = []
    for peer in peers:
        memory = peer.memory
        if memory is None:
            continue
        if memory.host_total and memory.host_available < LOW_HOST_MEMORY * memory.host_total:
            problems.append(
                f"peer {peer.short} (blocks {peer.start}:{peer.end}): its machine has {mib(memory.host_available)} of "
                f"{mib(memory.host_total)} memory left (the peer holds {mib(memory.rss)}): it may be killed for "
                "memory; serve fewer blocks (--num-blocks), lower --activation-cache-mb, or free the machine"
            )
        if memory.kept_inputs_max and memory.kept_inputs > KEPT_INPUTS_HIGH * memory.kept_inputs_max:
            problems.append(
                f"peer {peer.short} (blocks {peer.start}:{peer.end}) keeps {mib(memory.kept_inputs)} of its "
                f"{mib(memory.kept_inputs_max)} for span inputs of the step in progress: past it, forwards are "
                "refused; commit with fewer micro-batches per step or restart it with a larger --kept-inputs-mb"
            )
    return problems


def mib(n: int) -> str:
    """Bytes as people read them in a status line."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class Tracker:
    """What a watcher learns over time: when each peer was first seen, which ones left recently (kept as ``gone``
    for ``keep_gone`` seconds, so a failure stays visible after the fact), and each adapter's steps per minute
    over the last ``window`` seconds."""

    def __init__(self, keep_gone: float = 600.0, window: float = 300.0):
        self.keep_gone, self.window = keep_gone, window
        self.last: dict[tuple[str, str], Peer] = {}  # (model, peer) -> its last row while present
        self.up_since: dict[tuple[str, str], float] = {}
        self.gone_since: dict[tuple[str, str], float] = {}
        self.samples: dict[tuple[str, str], deque[tuple[float, int]]] = {}

    def update(self, health: ModelHealth, now: float) -> ModelHealth:
        """``health`` with up times, recently gone peers and training rates filled in."""
        present = set()
        for peer in health.peers:
            key = (health.model, peer.peer)
            present.add(key)
            self.gone_since.pop(key, None)
            peer.up_since = self.up_since.setdefault(key, now)
            self.last[key] = copy.deepcopy(peer)
        for key in [k for k in self.last if k[0] == health.model and k not in present]:
            since = self.gone_since.setdefault(key, now)
            self.up_since.pop(key, None)
            if now - since > self.keep_gone:
                del self.last[key], self.gone_since[key]
                continue
            gone = copy.deepcopy(self.last[key])
            gone.state, gone.gone_since, gone.up_since = GONE, since, None
            health.peers.append(gone)
        for adapter in health.adapters:
            adapter.steps_per_minute = self._rate((health.model, adapter.name), adapter, now)
        return health

    def _rate(self, key: tuple[str, str], adapter: Adapter, now: float) -> float | None:
        samples = self.samples.setdefault(key, deque())
        samples.append((now, adapter.committed if adapter.committed is not None else adapter.newest))
        while samples and samples[0][0] < now - self.window:
            samples.popleft()
        (first_t, first_step), (last_t, last_step) = samples[0], samples[-1]
        if last_t - first_t < 1.0:
            return None
        return max(0, last_step - first_step) / (last_t - first_t) * 60.0
