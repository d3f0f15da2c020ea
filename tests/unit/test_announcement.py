"""A peer's announcement is one DHT value holding all its records (swarm/net/records.py), and the blocks it gave up
lately stay in it as leaving for a record's lifetime (peers/leaving.py)."""

from __future__ import annotations

from hivemind.p2p import PeerID

from peers.leaving import LeavingBlocks
from swarm.net.records import MAX_ENTRIES, ServerRecord, ServerState, announcement, read_entries, valid_value

ME = PeerID(b"\x07" * 8)


def _record(state: ServerState, span: range) -> ServerRecord:
    return ServerRecord(ME, state, span.start, span.stop, 10.0)


def test_an_announcement_holds_each_record_with_its_blocks_and_refuses_other_shapes():
    online, joining = _record(ServerState.ONLINE, range(0, 4)), _record(ServerState.JOINING, range(2, 8))
    said = announcement([(online, range(0, 4)), (joining, range(4, 8))], 5.0)
    assert valid_value(said)
    entries = read_entries(ME, said)
    assert [(r.state, r.announced_at, blocks) for r, blocks in entries] == [
        (ServerState.ONLINE, 5.0, range(0, 4)),
        (ServerState.JOINING, 5.0, range(4, 8)),
    ]
    wider = {**said, "entries": [{**said["entries"][0], "blocks": [0, 9]}]}  # blocks past its record's span
    assert read_entries(ME, wider)[0][1] == range(0, 4)
    broken = [
        {**said, "kind": "server"},
        {**said, "entries": "all"},
        {**said, "entries": [{**said["entries"][0], "blocks": [0]}]},
        {**said, "entries": [{**said["entries"][0], "blocks": ["0", 4]}]},
        {**said, "entries": [{**said["entries"][0], "state": "dancing"}]},  # a malformed record
        {**said, "entries": said["entries"] * (MAX_ENTRIES // 2 + 1)},
    ]
    assert not any(valid_value(value) for value in broken)


def test_blocks_given_up_are_announced_leaving_for_a_while_unless_served_again():
    leaving = LeavingBlocks(ttl=30.0)
    gone = _record(ServerState.LEAVING, range(1, 2))
    joining = _record(ServerState.JOINING, range(1, 3))
    # a joining span switched from 1:3 to 2:4: block 1 withdrawn while the record still names 1:3
    entries = leaving.announce([(gone, range(1, 2))], [(joining, range(1, 3))], now=100.0)
    assert [(r.state, b) for r, b in entries] == [
        (ServerState.JOINING, range(2, 3)),
        (ServerState.LEAVING, range(1, 2)),
    ]
    later = leaving.announce([], [(_record(ServerState.JOINING, range(2, 4)), range(2, 4))], now=110.0)
    assert [(r.state, b) for r, b in later] == [(ServerState.JOINING, range(2, 4)), (ServerState.LEAVING, range(1, 2))]
    back = leaving.announce([], [(_record(ServerState.ONLINE, range(0, 4)), range(0, 4))], now=115.0)
    assert [(r.state, b) for r, b in back] == [(ServerState.ONLINE, range(0, 4))]  # served again: not leaving
    expired = leaving.announce([], [(_record(ServerState.ONLINE, range(2, 4)), range(2, 4))], now=131.0)
    assert [(r.state, b) for r, b in expired] == [(ServerState.ONLINE, range(2, 4))]  # a record's lifetime later
