"""swarm.net.view and swarm.net.records: who counts as serving, what records carry, and what the status table
shows; with the daemon's default span sizing."""

from __future__ import annotations

from dataclasses import replace

from hivemind.p2p import PeerID

from peers.config import PeerConfig, blocks_that_fit, max_blocks, span_length
from peers.daemon import StartTimeline
from swarm.net.protocol import AdapterInfo, PeerInfo
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView
from swarm.ops.status import render
from swarm.spec import load_spec


def test_view_counts_only_live_peers_and_settles_joiners_by_id():
    alive_id, dead_id, joiner_small, joiner_big = (PeerID(bytes([i]) * 8) for i in (1, 2, 3, 4))
    records = {
        0: [ServerRecord(alive_id, ServerState.ONLINE, 0, 2, 10.0), ServerRecord(dead_id, ServerState.ONLINE, 0, 2, 9)],
        1: [ServerRecord(alive_id, ServerState.ONLINE, 0, 2, 10.0)],
        2: [
            ServerRecord(joiner_small, ServerState.JOINING, 2, 3, 1.0),
            ServerRecord(joiner_big, ServerState.JOINING, 2, 3, 1.0),
        ],
    }
    info = PeerInfo("m", 0, 2, "online", 10.0, {"a": AdapterInfo({"lora": {}, "seed": 0}, {0: 5, 1: 5}, {2: 4})}, [2])
    assert PeerInfo.from_meta(info.to_meta()) == info  # what `info` sends is what the view reads
    empty = PeerInfo("m", 2, 3, "joining", 1.0, {}, [])
    view = SwarmView(records, {alive_id: info, joiner_small: empty, joiner_big: empty})
    assert view.coverage(exclude=joiner_big) == {0: 1, 1: 1, 2: 1}  # the dead peer does not count
    assert view.coverage(exclude=joiner_big, joining_before=joiner_big) == {0: 1, 1: 1, 2: 1}
    assert view.coverage(exclude=joiner_small, joining_before=joiner_small) == {0: 1, 1: 1, 2: 0}
    assert view.newest("a", 2, exclude=joiner_big) == (4, alive_id)
    assert view.trainer_step("a") == 5 and view.watchers([2, 3]) == [alive_id]
    table = render("m", 4, view, replication=2)
    assert "unreachable" in table and "UNCOVERED blocks 2-3" in table
    assert "copies: a@5: 1  (one failure would lose it)" in table  # block 0: served at 5 by one live peer


def test_the_newest_copy_is_taken_from_a_server_before_a_standby_holder_at_the_same_step():
    """A copy pulled from a server follows its commits (it names itself as a watcher); one pulled from another
    standby holder, which never commits, would not."""
    holder, server, older = (PeerID(bytes([i]) * 8) for i in (9, 1, 5))
    meta = {"lora": {}, "seed": 0}
    infos = {
        holder: PeerInfo("m", 4, 6, "online", 1.0, {"a": AdapterInfo(meta, {4: 7, 5: 7}, {0: 7})}, [0]),
        server: PeerInfo("m", 0, 2, "online", 1.0, {"a": AdapterInfo(meta, {0: 7, 1: 7}, {})}, []),
        older: PeerInfo("m", 2, 4, "online", 1.0, {"a": AdapterInfo(meta, {2: 7, 3: 7}, {0: 6})}, [0]),
    }
    for order in (list(infos), list(reversed(infos))):
        view = SwarmView({}, {peer: infos[peer] for peer in order})
        assert view.newest("a", 0, exclude=older) == (7, server)
    assert SwarmView({}, {holder: infos[holder], older: infos[older]}).newest("a", 0, exclude=server) == (7, holder)


def test_standby_pullers_spread_over_a_blocks_replicas_whatever_order_they_see_them_in():
    """Copies follow each commit by pulling the step's update from the replica they took their copy from: were it the
    same replica for every puller, that one would upload every copy's update each step (sync bytes bounded by the
    adapter, issue 47), its fellow replica none. Each puller ranks equal replicas by a hash of both ids."""
    meta = {"lora": {}, "seed": 0}
    replicas = [PeerID(bytes([i]) * 8) for i in (1, 2)]
    infos = {r: PeerInfo("m", 0, 2, "online", 1.0, {"a": AdapterInfo(meta, {0: 7, 1: 7}, {})}, []) for r in replicas}
    pullers = [PeerID(bytes([i]) * 8) for i in range(10, 30)]
    chosen = {}
    for puller in pullers:
        answers = {
            SwarmView({}, {r: infos[r] for r in order}).newest("a", 0, puller) for order in (replicas, replicas[::-1])
        }
        assert len(answers) == 1, "the choice depends on the order the puller saw the replicas in"
        chosen[puller] = answers.pop()[1]
    counts = [list(chosen.values()).count(r) for r in replicas]
    assert min(counts) >= 5, f"20 pullers split {counts} over two replicas"


def test_records_carry_a_move_and_span_sizing_fits_the_model(tiny_models):
    record = ServerRecord(PeerID(b"x" * 8), ServerState.ONLINE, 0, 2, 1.0, {"a": 3}, moving_to=range(2, 4))
    back = ServerRecord.from_value(record.peer_id, record.to_value())
    assert back == record
    roomy = ServerRecord(PeerID(b"x" * 8), ServerState.ONLINE, 0, 2, 1.0, max_blocks=6)
    assert ServerRecord.from_value(roomy.peer_id, roomy.to_value()).max_blocks == 6
    config = PeerConfig(model=str(tiny_models["llama"]), initial_peers=[])
    assert blocks_that_fit(load_spec(tiny_models["llama"]), config) == 4  # a tiny model fits whole


def test_a_peer_grows_as_far_as_told_or_as_fits(tiny_models):
    """The span a peer serves and how far it may grow over orphans: ``--max-blocks`` as told (never below its span);
    a peer told a smaller span than fits may grow to what fits; one sized by memory is full already."""
    spec, free = load_spec(tiny_models["llama"]), 1 << 40  # 4 blocks, all of which fit
    sized = PeerConfig(model=str(tiny_models["llama"]), initial_peers=[])
    assert span_length(spec, sized, free) == 4 and max_blocks(spec, sized, 4, free) == 4
    told = replace(sized, blocks=range(0, 2))
    assert span_length(spec, told, free) == 2 and max_blocks(spec, told, 2, free) == 4
    assert max_blocks(spec, replace(told, max_blocks=3), 2, free) == 3
    counted = replace(sized, num_blocks=3, max_blocks=1)
    assert span_length(spec, counted, free) == 3 and max_blocks(spec, counted, 3, free) == 3


def test_a_peer_says_where_its_start_went(monkeypatch):
    clock = iter([110.0, 112.5, 113.0, 114.25])
    monkeypatch.setattr("peers.daemon.time.time", lambda: next(clock))
    timeline = StartTimeline(started=100.0)  # imports done at 110
    for phase in ("join", "choose", "load and take state"):
        timeline.mark(phase)
    assert timeline.text() == (
        "14.2 s after the process started: 10.0 s to start Python and import, 2.5 s to join, 0.5 s to choose, "
        "1.2 s to load and take state"
    )
