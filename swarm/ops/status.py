"""``swarm status``: what a swarm serves, block by block, from its records and its live peers' answers.

The observation (``Observer``) and the health state (swarm/health.py) are shared with ``swarm monitor``; this module
only turns them into a text table."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID

from swarm.net.network import check_access, join_dht
from swarm.net.records import CommittedRecord, read_committed, read_models
from swarm.net.security import Identity, SwarmKey
from swarm.net.transport import Transport
from swarm.net.view import RETRY_TIMEOUT, SwarmView, observe
from swarm.ops.health import Block, ModelHealth, Peer, build, mib, ranges

logger = logging.getLogger(__name__)

ME = PeerID(b"status")
NO_MODEL = "no model is served in this swarm (yet): start peers with `swarm peer --model ...`"


def render(
    model: str,
    num_blocks: int,
    view: SwarmView,
    replication: int,
    committed: dict[str, CommittedRecord] | None = None,
    peers: bool = False,
) -> str:
    """A table: one row per run of blocks that show the same (a span of servers, as a rule) with how many peers serve
    it in each state, the replication level, standby copies, how many peers hold each adapter's newest step,
    UNCOVERED where no live peer serves them, and DISHONEST peers (from the trainers' ``committed`` records); with
    ``peers``, a row per peer too (state, span, throughput, adapter steps, memory). With those records, a peer
    serving other weights than every adapter's pin counts as mismatched."""
    return render_health(build(model, num_blocks, view, replication, committed), peers)


def render_health(health: ModelHealth, peers: bool = False) -> str:
    """The table of ``render``. Contiguous blocks served by peers of the same spans, whose lines read the same, share
    one row, ``0-14``: a model served in a few spans reads in a few rows at any number of peers, and a run that
    differs (UNCOVERED, under-replicated) stands out as its own."""
    groups: list[tuple[int, int, tuple]] = []  # (first block, last block, their lines and servers' spans)
    for block in health.blocks:
        lines = _block_lines(block, health.replication)
        key = (lines, sorted({(server.start, server.end) for server in block.servers}))
        if groups and groups[-1][2] == key and groups[-1][1] == block.block - 1:
            groups[-1] = (groups[-1][0], block.block, key)
        else:
            groups.append((block.block, block.block, key))
    labels = [str(first) if first == last else f"{first}-{last}" for first, last, _ in groups]
    width = max([len("blocks"), *(len(label) for label in labels)])
    rows = [f"model {health.model}: {health.num_blocks} blocks, target replication {health.replication}"]
    rows.append(f"{'blocks':>{width}}  {'repl':>4}  servers / standby copies / copies of each adapter's newest step")
    for label, (_, _, (lines, _)) in zip(labels, groups, strict=True):
        rows.append(f"{label:>{width}}  {lines[0]}")
        rows.extend(f"{'':>{width}}  {'':>4}  {line}" for line in lines[1:])
    if peers:
        rows.append("peers: state, span, throughput, [adapter@step of its blocks], standby blocks")
        rows.extend(f"  {_peer_line(peer)}" for peer in sorted(health.peers, key=lambda p: (p.start, p.end, p.peer)))
        reported = [peer for peer in health.peers if peer.memory is not None]
        if reported:
            rows.append("memory: resident (daemon, DHT, p2pd) / kept inputs / forward cache / generation, of bounds")
            rows.extend(f"  {_memory_line(peer)}" for peer in reported)
    else:
        noun = "peer" if len(health.peers) == 1 else "peers"
        rows.append(f"({len(health.peers)} {noun}; `swarm status --peers` lists each, with its memory)")
    uncovered = [b.block for b in health.blocks if not b.online]
    if uncovered:
        runs = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges(uncovered))
        noun = "block" if len(uncovered) == 1 else "blocks"
        rows.append(f"UNCOVERED {noun} {runs}: start `swarm peer` serving them (or wait for a takeover)")
    for adapter in health.adapters:
        rows.extend(
            f"DISHONEST peer {peer} (adapter {adapter.name}: outvoted by its replicas; the trainer no longer uses it)"
            for peer in adapter.dishonest
        )
    return "\n".join(rows)


def _counted(by_step: dict[int, int]) -> str:
    """``5`` when every holder is at step 5; ``4x1/5x2`` when they differ (one behind)."""
    if len(by_step) == 1:
        return str(next(iter(by_step)))
    return "/".join(f"{step}x{n}" for step, n in sorted(by_step.items()))


def _peer_line(peer: Peer) -> str:
    held = {name: sorted(set(h.steps.values())) for name, h in peer.adapters.items() if h.steps}
    steps = " ".join(f"{name}@{'/'.join(map(str, s))}" for name, s in held.items())
    standby = f"  standby {_runs(peer.standby_blocks)}" if peer.standby_blocks else ""
    relayed = " relayed" if peer.relayed else ""
    moves = ""
    if peer.moves:
        last = peer.moves[-1]
        to = f"{last.target_start}:{last.target_end}"
        moves = f"  moves in the last hour: {len(peer.moves)} (last to {to}: {last.reason})"
    return (
        f"{peer.short} {peer.state}{relayed} {peer.start}:{peer.end} {peer.throughput:.0f} tok/s"
        + (f" [{steps}]" if steps else "")
        + standby
        + moves
    )


def _runs(blocks: list[int]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges(sorted(blocks)))


def _memory_line(peer: Peer) -> str:
    m = peer.memory
    return (
        f"{peer.short} {peer.start}:{peer.end}  {mib(m.rss)} resident, machine {mib(m.host_available)} free of "
        f"{mib(m.host_total)}  kept inputs {mib(m.kept_inputs)} / {mib(m.kept_inputs_max)}  forward cache "
        f"{mib(m.activation_cache)} / {mib(m.activation_cache_max)}  generation {mib(m.inference)} / "
        f"{mib(m.inference_max)}  tokens in flight {m.tokens_in_flight} / {m.tokens_in_flight_max}"
    )


def _block_lines(block: Block, replication: int) -> tuple[str, ...]:
    """What the table says of one block, without its number: its row (servers counted by state, and by the step
    they hold), then its standby and copies lines if any."""
    states: dict[str, int] = {}
    for server in block.servers:
        states[server.state] = states.get(server.state, 0) + 1
    relayed = sum(1 for s in block.servers if s.relayed and s.state == "online")
    counts = [
        f"{n} {state}" + (f" ({relayed} relayed)" if state == "online" and relayed else "")
        for state, n in states.items()
    ]
    steps: dict[str, dict[int, int]] = {}
    for server in block.servers:
        for name, step in server.steps.items():
            steps.setdefault(name, {}).setdefault(step, 0)
            steps[name][step] += 1
    held = " ".join(f"{name}@{_counted(by_step)}" for name, by_step in steps.items())
    mark = "" if block.online else "  UNCOVERED"
    low = "" if block.online >= replication or not block.online else "  (under-replicated)"
    lines = [f"{block.online:>4}  " + (", ".join(counts) or "-") + (f" [{held}]" if held else "") + mark + low]
    if block.standby:
        standby: dict[str, dict[int, int]] = {}
        for held_by_peer in block.standby.values():
            for name, step in held_by_peer.items():
                standby.setdefault(name, {}).setdefault(step, 0)
                standby[name][step] += 1
        text = " ".join(f"{name}@{_counted(by_step)}" for name, by_step in standby.items())
        noun = "peer" if len(block.standby) == 1 else "peers"
        lines.append(f"standby: {len(block.standby)} {noun} [{text}]")
    if block.copies:
        text = "; ".join(f"{name}@{c.step}: {c.count}" for name, c in block.copies.items())
        fewest = min(c.count for c in block.copies.values())
        warning = "  (no live copy)" if fewest == 0 else "  (one failure would lose it)" if fewest == 1 else ""
        lines.append(f"copies: {text}{warning}")
    return tuple(lines)


@dataclass
class Observation:
    """One model as seen in one round."""

    model: str
    num_blocks: int
    view: SwarmView
    committed: dict[str, CommittedRecord]


class Observer:
    """A client-mode member of the swarm that looks at it: joins once (checking the key), then observes on demand."""

    def __init__(self, initial_peers: list[str], swarm_key: SwarmKey | None):
        self.dht: DHT = join_dht(initial_peers, Identity.load_or_create(None), swarm_key, client_mode=True)
        self.transport = Transport.for_dht(self.dht, swarm_key)
        try:
            RemoteExpertWorker.run_coroutine(check_access(self.transport, initial_peers))
        except BaseException:
            self.close()
            raise

    def models(self, only: str | None = None) -> dict[str, int]:
        """Models announced in the swarm (or just ``only``) and their number of blocks."""
        models = read_models(self.dht)
        return models if only is None else {only: models[only]} if only in models else {}

    def observe(
        self, model: str, num_blocks: int, committed: bool = True, retry_timeout: float | None = None
    ) -> Observation:
        """The records and live peers of ``model``; with ``committed``, also each adapter's committed record
        (``retry_timeout``: see ``observe``)."""
        view = RemoteExpertWorker.run_coroutine(
            observe(self.dht, self.transport, model, num_blocks, ME, retry_timeout=retry_timeout)
        )
        records = {}
        if committed:
            for name in sorted(view.adapters()):
                record = read_committed(self.dht, model, name)
                if record is not None:
                    records[name] = record
        return Observation(model, num_blocks, view, records)

    def close(self) -> None:
        try:
            RemoteExpertWorker.run_coroutine(self.transport.shutdown())
        finally:
            self.dht.shutdown()


def status(
    initial_peers: list[str], swarm_key: SwarmKey | None, model: str | None, replication: int, peers: bool = False
) -> str:
    """Join as a client, find the models announced (or the one named), and render each (``peers``: with a row per
    peer)."""
    observer = Observer(initial_peers, swarm_key)
    try:
        models = observer.models(model)
        if not models:
            return NO_MODEL if model is None else no_such_model(model, observer.models())
        tables = []
        for name, num_blocks in sorted(models.items()):
            seen = observer.observe(name, num_blocks, retry_timeout=RETRY_TIMEOUT)
            tables.append(render(name, num_blocks, seen.view, replication, seen.committed, peers))
        return "\n\n".join(tables)
    finally:
        observer.close()


def no_such_model(model: str, served: dict[str, int]) -> str:
    if not served:
        return NO_MODEL
    return f"nobody serves model {model!r} in this swarm; served: {', '.join(sorted(served))} (check --model)"
