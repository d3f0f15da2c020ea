"""``swarm status``: what a swarm serves, block by block, from its records and its live peers' answers."""

from __future__ import annotations

from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID

from swarm.network import join_dht
from swarm.records import ServerState, read_models
from swarm.security import Identity, SwarmKey
from swarm.transport import Transport
from swarm.view import SwarmView, observe

ME = PeerID(b"status")


def _short(peer: PeerID) -> str:
    text = peer.to_base58()
    return f"{text[:6]}..{text[-4:]}"


def render(model: str, num_blocks: int, view: SwarmView, replication: int) -> str:
    """A table: one row per block with its servers (state, relayed or not, span, throughput, adapter steps), the
    replication level, the peers keeping standby copies, how many peers hold each adapter's newest step, and
    UNCOVERED where no live peer serves it."""
    rows = [f"model {model}: {num_blocks} blocks, target replication {replication}"]
    rows.append(f"{'block':>5}  {'repl':>4}  servers / standby copies / copies of each adapter's newest step")
    newest = _newest_steps(view)
    uncovered = []
    for block in range(num_blocks):
        servers, online = [], 0
        for record in view.records.get(block, []):
            info = view.alive.get(record.peer_id)
            state = record.state.value if info is not None else "unreachable"
            online += info is not None and record.state == ServerState.ONLINE
            steps = ""
            if info is not None:
                steps = " ".join(
                    f"{name}@{a.steps[block]}" for name, a in sorted(info.adapters.items()) if block in a.steps
                )
            servers.append(
                f"{_short(record.peer_id)} {state}{' relayed' if record.relayed else ''} {record.start}:{record.end} "
                f"{record.throughput:.0f} tok/s" + (f" [{steps}]" if steps else "")
            )
        standby = []
        for peer, info in view.alive.items():
            held = [f"{name}@{a.standby[block]}" for name, a in sorted(info.adapters.items()) if block in a.standby]
            if held:
                standby.append(f"{_short(peer)} [{' '.join(held)}]")
        mark = "" if online else "  UNCOVERED"
        if not online:
            uncovered.append(block)
        low = "" if online >= replication or not online else "  (under-replicated)"
        rows.append(f"{block:>5}  {online:>4}  " + ("; ".join(servers) or "-") + mark + low)
        if standby:
            rows.append(f"{'':>5}  {'':>4}  standby: " + "; ".join(standby))
        copies = _copies(view, block, newest)
        if copies:
            text = "; ".join(f"{name}@{step}: {count}" for name, (step, count) in sorted(copies.items()))
            single = any(count < 2 for _, count in copies.values())
            rows.append(f"{'':>5}  {'':>4}  copies: {text}" + ("  (one failure would lose it)" if single else ""))
    if uncovered:
        rows.append(f"UNCOVERED blocks {uncovered}: start `swarm peer` serving them (or wait for a takeover)")
    return "\n".join(rows)


def _newest_steps(view: SwarmView) -> dict[str, int]:
    """Per adapter, the newest step any live peer holds of any block: the trainer's committed step."""
    newest: dict[str, int] = {}
    for info in view.alive.values():
        for name, adapter in info.adapters.items():
            for step in [*adapter.steps.values(), *adapter.standby.values()]:
                newest[name] = max(newest.get(name, step), step)
    return newest


def _copies(view: SwarmView, block: int, newest: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Per adapter, (its newest step, how many live peers hold ``block`` at that step, served or standby): one copy
    means a single failure there would lose the step."""
    counts: dict[str, tuple[int, int]] = {}
    for name, step in newest.items():
        count = sum(
            1 for info in view.alive.values() if name in info.adapters and info.adapters[name].step_of(block) == step
        )
        counts[name] = (step, count)
    return counts


def status(initial_peers: list[str], swarm_key: SwarmKey | None, model: str | None, replication: int) -> str:
    """Join as a client, find the models announced (or the one named), and render each."""
    dht = join_dht(initial_peers, Identity.load_or_create(None), swarm_key, client_mode=True)
    transport = Transport.for_dht(dht, swarm_key)
    try:
        models = read_models(dht)
        if model is not None:
            models = {model: models[model]} if model in models else {}
        if not models:
            return "no model is served in this swarm (yet): start peers with `swarm peer --model ...`"
        tables = []
        for name, num_blocks in sorted(models.items()):
            view = RemoteExpertWorker.run_coroutine(observe(dht, transport, name, num_blocks, ME))
            tables.append(render(name, num_blocks, view, replication))
        return "\n\n".join(tables)
    finally:
        RemoteExpertWorker.run_coroutine(transport.shutdown())
        dht.shutdown()
