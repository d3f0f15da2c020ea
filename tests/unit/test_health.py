"""``swarm monitor``: the health state shared with ``swarm status`` (unit tests on hand-made views), the JSON API and
the page against real local swarms (a peer SIGKILLed turns the swarm degraded), a private swarm seen with and
without its key, and the page as a headless browser draws it (skipped without chromium)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from hivemind.p2p import PeerID

from swarm.net.errors import RequestError
from swarm.net.protocol import AdapterInfo, MemoryUse, MoveEntry, PeerInfo
from swarm.net.records import CommittedRecord, ServerRecord, ServerState
from swarm.net.view import SwarmView
from swarm.ops.health import BROKEN, DEGRADED, GONE, HEALTHY, Tracker, build, short
from swarm.ops.status import render, render_health

A0, A1, B0, B1 = (PeerID(bytes([i]) * 8) for i in (1, 2, 3, 4))


META = {"lora": {}, "seed": 0}


def _view(alive: set[PeerID], step: int = 5) -> SwarmView:
    """Four blocks: A0 and A1 serve 0:2, B0 and B1 serve 2:4; every peer keeps standby copies of the other half."""
    spans = {A0: (0, 2), A1: (0, 2), B0: (2, 4), B1: (2, 4)}
    records = {
        b: [ServerRecord(p, ServerState.ONLINE, s, e, 10.0) for p, (s, e) in spans.items() if s <= b < e]
        for b in range(4)
    }
    infos = {}
    for peer, (start, end) in spans.items():
        served = {b: step for b in range(start, end)}
        standby = {b: step for b in range(4) if b not in served}
        infos[peer] = PeerInfo(
            "m", start, end, "online", 10.0, {"a": AdapterInfo(META, served, standby)}, sorted(standby)
        )
    return SwarmView(records, {p: info for p, info in infos.items() if p in alive})


def test_every_block_at_the_target_is_healthy_and_the_state_is_json():
    committed = {"a": CommittedRecord(5, {}, 0, "trainer-1")}
    health = build("m", 4, _view({A0, A1, B0, B1}), replication=2, committed=committed)
    assert health.status == HEALTHY and health.problems == []
    assert [b.online for b in health.blocks] == [2, 2, 2, 2]
    assert {p.peer for p in health.peers} == {p.to_base58() for p in (A0, A1, B0, B1)}
    assert all(p.state == "online" and p.short == short(p.peer) for p in health.peers)
    (adapter,) = health.adapters
    assert (adapter.name, adapter.committed, adapter.trainer, adapter.copies) == (
        "a",
        5,
        "trainer-1",
        dict.fromkeys(range(4), 4),
    )
    assert json.loads(json.dumps(asdict(health)))["status"] == HEALTHY


def test_the_trainers_recoveries_and_steps_lost_are_shown_and_a_loss_is_a_problem():
    recovery = {"peer": B1.to_base58(), "during": "commit", "step": 5, "seconds": 0.4}
    committed = {"a": CommittedRecord(9, {}, 0, "trainer-1", [recovery], steps_lost=2)}
    value = CommittedRecord.from_value(committed["a"].to_value())
    assert value == committed["a"], "the record carries them through the DHT's encoding"
    health = build("m", 4, _view({A0, A1, B0, B1}), replication=2, committed=committed)
    (adapter,) = health.adapters
    assert (adapter.recoveries, adapter.steps_lost) == ([recovery], 2)
    assert any("2 step(s) lost so far" in problem for problem in health.problems), health.problems


def test_each_peers_memory_is_shown_against_its_bounds_and_trouble_is_a_problem():
    """A volunteer sees a peer heading for trouble: resident memory and the bounded stores in ``swarm status`` and on
    the page (the JSON), and a problem when its machine runs low or its kept inputs near their bound."""
    GiB, MiB = 2**30, 2**20
    view = _view({A0, A1, B0, B1})
    fine = MemoryUse(int(1.5 * GiB), 12 * GiB, 24 * GiB, 0, 4096 * MiB, 3 * MiB, 1024 * MiB, 0, 1024 * MiB)
    for peer in (A0, A1, B0):
        view.alive[peer].memory = fine
    view.alive[B1].memory = MemoryUse(20 * GiB, GiB, 24 * GiB, 3900 * MiB, 4096 * MiB, 0, 1024 * MiB, 0, 1024 * MiB)
    health = build("m", 4, view, replication=2)
    reported = {p.peer: p.memory for p in health.peers}
    assert reported[B1.to_base58()].rss == 20 * GiB and reported[A0.to_base58()] == fine
    troubled = [p for p in health.problems if short(B1.to_base58()) in p]
    assert len(troubled) == 2 and len(health.problems) == 2, health.problems
    assert "1.0 GiB of 24.0 GiB memory left" in troubled[0] and "killed for memory" in troubled[0]
    assert "3.8 GiB of its 4.0 GiB" in troubled[1] and "--kept-inputs-mb" in troubled[1]
    assert json.loads(json.dumps(asdict(health)))["peers"][0]["memory"]["kept_inputs_max"] == 4096 * MiB
    text = render_health(health, peers=True)
    assert f"{short(B1.to_base58())} 2:4  20.0 GiB resident, machine 1.0 GiB free of 24.0 GiB" in text, text
    assert "kept inputs 3.8 GiB / 4.0 GiB  forward cache 0 MiB / 1.0 GiB" in text, text
    assert text.count(" resident, machine ") == 4


def test_a_peer_info_carries_its_memory_and_a_malformed_report_is_refused():
    memory = MemoryUse(1, 2, 3, 4, 5, 6, 7, 8, 9)
    info = PeerInfo("m", 0, 2, "online", 1.0, {}, [], "none/float32", memory)
    assert PeerInfo.from_meta(info.to_meta()) == info
    assert PeerInfo.from_meta({**info.to_meta(), "memory": None}).memory is None  # a peer that predates the report
    with pytest.raises(RequestError, match="'memory' must map rss"):
        PeerInfo.from_meta({**info.to_meta(), "memory": {**asdict(memory), "rss": -1}})


def test_peers_the_trainer_banned_are_flagged_dishonest_on_the_page_and_in_status():
    committed = {"a": CommittedRecord(5, {}, 0, "trainer-1", dishonest=[A1.to_base58()])}
    assert CommittedRecord.from_value(committed["a"].to_value()) == committed["a"]
    health = build("m", 4, _view({A0, A1, B0, B1}), replication=2, committed=committed)
    assert {p.peer: p.dishonest for p in health.peers}[A1.to_base58()] == ["a"]
    assert all(p.dishonest == [] for p in health.peers if p.peer != A1.to_base58())
    assert any(f"peer {short(A1.to_base58())} is dishonest" in problem for problem in health.problems)
    assert f"DISHONEST peer {A1.to_base58()}" in render("m", 4, _view({A0, A1, B0, B1}), 2, committed)


def test_a_block_under_the_target_is_degraded_and_said_in_words():
    health = build("m", 4, _view({A0, A1, B0}), replication=2)
    assert health.status == DEGRADED
    assert "blocks 2-3 have one server: a failure there would pause training" in health.problems[0]
    assert any(f"peer {short(B1.to_base58())} (blocks 2:4) does not answer" in p for p in health.problems)
    assert {p.peer: p.state for p in health.peers}[B1.to_base58()] == "unreachable"
    three = build("m", 4, _view({A0, A1, B0, B1}), replication=3)
    assert three.status == DEGRADED and "blocks 0-3 have 2 servers, below the target of 3" in three.problems[0]


def test_a_block_without_a_server_is_broken_and_said_in_words():
    health = build("m", 4, _view({A0, A1}), replication=2)
    assert health.status == BROKEN
    assert health.problems[0].startswith(
        "blocks 2-3 have no server: training is paused until a peer serves them (start `swarm peer --blocks 2:4`"
    )
    lone = build("m", 5, _view({A0, A1, B0, B1}), replication=2)  # block 4: nobody announces it
    assert lone.status == BROKEN and lone.problems[0].startswith("block 4 has no server")
    assert any("adapter a: block 4 has no live copy of step 5" in p for p in lone.problems)


def test_status_renders_the_shared_state_with_its_copies_lines():
    view = _view({A0, B0})
    table = render("m", 4, view, replication=2)
    assert table == render_health(build("m", 4, view, replication=2))
    assert "copies: a@5: 2" in table and "(one failure would lose it)" not in table
    assert "unreachable" in table and "(under-replicated)" in table


def test_status_groups_contiguous_blocks_that_read_the_same_into_one_row():
    """30 blocks in 3 spans of 10: a row (and its copies line) per span, not 3 lines per block; a run that differs
    (uncovered, one block's standby copy) is a row of its own and still stands out."""
    spans = {A0: (0, 10), A1: (10, 20), B0: (20, 30)}
    records = {
        b: [ServerRecord(p, ServerState.ONLINE, s, e, 10.0) for p, (s, e) in spans.items() if s <= b < e]
        for b in range(30)
    }

    def view(alive: set[PeerID], standby: dict[int, int] | None = None) -> SwarmView:
        infos = {
            p: PeerInfo("m", s, e, "online", 10.0, {"a": AdapterInfo(META, dict.fromkeys(range(s, e), 5), {})}, [])
            for p, (s, e) in spans.items()
        }
        if standby:
            infos[A0] = PeerInfo(
                "m", 0, 10, "online", 10.0, {"a": AdapterInfo(META, dict.fromkeys(range(10), 5), standby)}, [12]
            )
        return SwarmView(records, {p: info for p, info in infos.items() if p in alive})

    table = render("m", 30, view({A0, A1, B0}), replication=2).splitlines()
    assert [line.split()[:2] for line in table[2:-1] if not line.startswith(" " * 8)] == [
        ["0-9", "1"],
        ["10-19", "1"],
        ["20-29", "1"],
    ]
    assert len(table) == 2 + 3 * 2 + 1 and all("(under-replicated)" in table[i] for i in (2, 4, 6)), table
    assert table[3].strip() == "copies: a@5: 1  (one failure would lose it)"

    broken = render("m", 30, view({A0, A1}), replication=2).splitlines()
    assert "UNCOVERED" in broken[-4] and broken[-4].split()[:2] == ["20-29", "0"]
    assert broken[-1].startswith("UNCOVERED blocks 20-29: start `swarm peer`")

    one_differs = render("m", 30, view({A0, A1, B0}, standby={12: 5}), replication=2).splitlines()
    labels = [line.split()[0] for line in one_differs[2:-1] if not line.startswith(" " * 8)]
    assert labels == ["0-9", "10-11", "12", "13-19", "20-29"], one_differs
    assert "standby: 1 peer [a@5]" in one_differs[7] and "copies: a@5: 2" in one_differs[8]


def test_the_tracker_keeps_gone_peers_for_a_while_and_measures_steps_per_minute():
    tracker = Tracker(keep_gone=600.0, window=300.0)
    everyone = {A0, A1, B0, B1}
    first = tracker.update(build("m", 4, _view(everyone, step=10), 2), now=1000.0)
    assert all(p.up_since == 1000.0 for p in first.peers) and first.adapters[0].steps_per_minute is None
    later = tracker.update(build("m", 4, _view(everyone, step=12), 2), now=1060.0)
    assert later.adapters[0].steps_per_minute == pytest.approx(2.0)
    gone_view = _view(everyone - {B1}, step=14)
    for records in gone_view.records.values():  # its records expired: the view no longer names it
        records[:] = [r for r in records if r.peer_id != B1]
    left = tracker.update(build("m", 4, gone_view, 2), now=1120.0)
    gone = [p for p in left.peers if p.state == GONE]
    assert [(p.peer, p.gone_since, p.start, p.end) for p in gone] == [(B1.to_base58(), 1120.0, 2, 4)]
    assert tracker.update(build("m", 4, gone_view, 2), now=1700.0).peers[-1].state == GONE  # still within 10 min
    assert all(p.state != GONE for p in tracker.update(build("m", 4, gone_view, 2), now=1721.0).peers)
    back = tracker.update(build("m", 4, _view(everyone, step=14), 2), now=1800.0)
    assert {p.peer: p.up_since for p in back.peers}[B1.to_base58()] == 1800.0  # a returning peer starts over


def test_a_peer_serving_other_weights_shows_as_mismatched_and_is_not_counted():
    """B1 announces other digests for blocks 2:4 than the adapter's committed record pins (a look-alike model under
    the same folder name): ``swarm status`` and the health page show it mismatched, and it does not count as a
    server of those blocks."""
    honest = {b: f"{b:064x}" for b in range(4)}
    view = _view({A0, A1, B0, B1})
    for block in range(4):
        for record in view.records[block]:
            record.digests = {b: honest[b] for b in record.blocks}
            if record.peer_id == B1:
                record.digests = {b: f"{b + 7:064x}" for b in record.blocks}
    committed = {"a": CommittedRecord(5, {}, 0, "trainer-1", weights=honest)}
    health = build("m", 4, view, replication=2, committed=committed)
    states = {p.peer: p.state for p in health.peers}
    assert states.pop(B1.to_base58()) == "mismatched" and set(states.values()) == {"online"}
    assert [b.online for b in health.blocks] == [2, 2, 1, 1] and health.status == DEGRADED
    assert any("serves other weights" in problem and short(B1.to_base58()) in problem for problem in health.problems)
    table = render("m", 4, view, replication=2, committed=committed, peers=True)
    assert f"{short(B1.to_base58())} mismatched 2:4" in table and "1 online, 1 mismatched" in table, table
    assert "mismatched" not in render("m", 4, view, replication=2, peers=True)  # no pin known: nobody to mismatch


def test_status_at_twenty_peers_is_a_row_per_span_and_the_peers_on_request():
    """20 peers in 4 spans of 8 blocks, 5 replicas each, one of them a step behind: the default table is one row per
    span, readable (no line over 100 characters), the lagging replica visible in its span's row; ``--peers`` adds
    one line per peer."""
    peers = [PeerID(bytes([10 + i]) * 8) for i in range(20)]
    spans = {peer: (8 * (i % 4), 8 * (i % 4) + 8) for i, peer in enumerate(peers)}
    records = {
        b: [ServerRecord(p, ServerState.ONLINE, s, e, 10.0) for p, (s, e) in spans.items() if s <= b < e]
        for b in range(32)
    }
    infos = {
        p: PeerInfo("m", s, e, "online", 10.0, {"a": AdapterInfo(META, dict.fromkeys(range(s, e), 7), {})}, [])
        for p, (s, e) in spans.items()
    }
    behind = peers[1]  # serves 8:16
    infos[behind] = PeerInfo(
        "m", 8, 16, "online", 10.0, {"a": AdapterInfo(META, dict.fromkeys(range(8, 16), 6), {})}, []
    )
    view = SwarmView(records, infos)
    table = render("m", 32, view, replication=2).splitlines()
    rows = [line for line in table[2:-1] if line[:6].strip()]
    assert [row.split()[:2] for row in rows] == [["0-7", "5"], ["8-15", "5"], ["16-23", "5"], ["24-31", "5"]], table
    assert "5 online [a@7]" in rows[0] and "5 online [a@6x1/7x4]" in rows[1], table
    assert max(len(line) for line in table) <= 100, table
    detailed = render("m", 32, view, replication=2, peers=True)
    assert all(detailed.count(short(p.to_base58())) == 1 for p in peers), detailed
    assert f"{short(behind.to_base58())} online 8:16 10 tok/s [a@6]" in detailed, detailed


def test_each_peers_moves_of_the_last_hour_are_shown_with_the_reason_of_the_last():
    view = _view({A0, A1, B0, B1})
    moved = MoveEntry(1000.0, 0, 2, 0, 4, "blocks 2:4 have no other live server (blocks unserved 2 -> 0)")
    back = MoveEntry(1060.0, 0, 4, 0, 2, "back to its --blocks 0:2: blocks 2:4 have other servers")
    view.alive[A0].moves = [moved, back]
    info = PeerInfo(**PeerInfo.read_meta(view.alive[A0].to_meta()))  # as the wire carries it
    assert info.moves == [moved, back] and info.moves_within(30.0, now=1070.0) == [back]
    health = build("m", 4, view, replication=2)
    text = render_health(health, peers=True)
    assert "moves in the last hour: 2 (last to 0:2: back to its --blocks 0:2" in text
    assert sum("moves in the last hour" in line for line in text.splitlines()) == 1
    state = json.loads(json.dumps(asdict(health)))
    assert [len(p["moves"]) for p in state["peers"]] == [2, 0, 0, 0]
