"""Churn, the way volunteers' machines behave: for two minutes peers crash, freeze, leave, restart from their
checkpoint dirs and join, one event every 4 s on average, two at once sometimes, most aimed at a phase (forward,
backward, commit, standby pull, checkpoint write, move), while a client that connected at once trains with
sub-second steps. What must hold is not a speed but the promises: the training loop never sees an exception, no step
is lost unless two holders of a block were down at once (and then the loss is reported), and the adapter ends equal
to local peft on the same batches.
The same driver, longer and with a no-churn run beside it, is scripts/churn.py.
"""

from __future__ import annotations

import itertools
import signal
from datetime import datetime
from pathlib import Path

import pytest

from swarm.testing.chaos import (
    MOVE,
    PHASES,
    ChaosDriver,
    ChaosEvent,
    ChaosPeers,
    ChurnStats,
    Outage,
    ShadowStarts,
    chaos_schedule,
)
from swarm.testing.localswarm import LocalSwarm


def test_a_schedule_comes_from_its_seed_alone_and_has_every_kind_of_fault():
    names = [f"peer{i}" for i in range(5)]
    schedule = chaos_schedule(4, 120.0, 4.0, names)
    assert schedule == chaos_schedule(4, 120.0, 4.0, names)
    assert schedule != chaos_schedule(5, 120.0, 4.0, names)
    assert all(0 < a.at < b.at < 120.0 for a, b in zip(schedule, schedule[1:], strict=False))
    assert {e.kind for e in schedule} == {"kill", "freeze", "term", "double-kill", "join"}
    assert {e.phase for e in schedule} == {None, *PHASES, MOVE}
    assert all(len(e.targets) == 2 and e.targets[0] != e.targets[1] for e in schedule if e.kind == "double-kill")
    assert 15 <= len(schedule) <= 45  # about one event per 4 s


def test_a_loss_is_excused_only_by_two_holders_of_a_block_down_at_once():
    stats = ChurnStats(outages=[Outage("a", range(0, 2), 1.0, 11, until=5.0), Outage("b", range(2, 4), 2.0, 12)])
    assert stats.shared_outages() == []  # no common block
    stats.outages.append(Outage("c", range(1, 3), 6.0, 13, until=9.0))  # shares block 1 with a, but a is back
    assert [(x.name, y.name) for x, y in stats.shared_outages()] == [("b", "c")]  # b, still down, shares block 2


def test_a_standby_copy_holder_down_with_the_blocks_server_excuses_a_loss():
    """The only server of 0:2 is down, and so is the peer of 2:4 that held the copies of 0:2: every holder of 0:2's
    state is down, though no two servers of a block are (a churn run on a loaded machine, whose late peers had not
    joined yet, lost steps so and called the loss unexcused)."""
    server = Outage("a", range(0, 2), 1.0, 11)
    assert ChurnStats(outages=[server, Outage("b", range(2, 4), 2.0, 12)]).shared_outages() == []
    holder = Outage("b", range(2, 4), 2.0, 12, copies=frozenset({0, 1}))
    assert len(ChurnStats(outages=[server, holder]).shared_outages()) == 1


def test_a_peers_standby_copies_are_read_from_its_log(tmp_path):
    """The copies a struck peer held are the last ones its log names (each change of them is logged)."""
    peers = ChaosPeers(LocalSwarm(tmp_path), tmp_path, [], tmp_path)
    log = tmp_path / "a.log"
    peers.processes["a"] = type("P", (), {"log": log})()
    assert peers.copies("a") == frozenset()
    log.write_text(
        "x INFO peers.adapters: adapter 'n': holding standby copies of blocks 0:2,5:6\n"
        "y INFO peers.adapters: adapter 'n': holding standby copies of blocks 0:3\n"
    )
    assert peers.copies("a") == frozenset({0, 1, 2})
    log.write_text(log.read_text() + "z INFO peers.adapters: adapter 'n': holding standby copies of blocks nothing\n")
    assert peers.copies("a") == frozenset()


class _Popen:
    """What the driver reads of a process: it is alive until it gets a signal that ends it."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class _Process:
    def __init__(self, pid: int):
        self.popen = _Popen(pid)
        self.pid = pid

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.popen.returncode = -sig


class _Fleet:
    """The driver's view of named peers, without processes: which are alive, and every (re)start."""

    def __init__(self, names: list[str]):
        self.pids = itertools.count(100)
        self.processes = {name: _Process(next(self.pids)) for name in names}
        self.started: list[str] = []

    def alive(self, name: str) -> bool:
        return self.processes[name].popen.poll() is None

    def span(self, name: str) -> range:
        return range(0, 2)

    def copies(self, name: str) -> frozenset[int]:
        return frozenset()

    def start(self, name: str) -> _Process:
        self.started.append(name)
        self.processes[name] = _Process(next(self.pids))
        return self.processes[name]


def test_a_peer_struck_again_while_going_down_restarts_once():
    """Chaos found it in its own driver: a peer SIGTERMed, then SIGKILLed by the next event while still in its leave
    grace, was restarted twice: two processes with one identity and one checkpoint dir, and the commits of the client
    that routed a backward to one of them and asked the other for the gradients failed 8 rounds in a row."""
    fleet = _Fleet(["a", "b", "c"])
    driver = ChaosDriver(fleet, [], restart_delay=0.0, target_size=5)  # short of its size: every restart is due
    going_down = fleet.processes["a"]
    going_down.signal = lambda sig: None  # still alive when the second strike comes: its leave takes a while
    driver._strike(ChaosEvent(0.0, "term", ("a",)), ["a"])
    driver._strike(ChaosEvent(0.0, "kill", ("a",)), ["a"])
    going_down.popen.returncode = -9
    for _, _, action in sorted(driver.actions, key=lambda item: item[:2]):
        action()
    assert fleet.started == ["a"]
    assert [o.name for o in driver.stats.outages] == ["a", "a"]


def test_restart_times_are_read_from_each_restarted_process_log(tmp_path):
    fleet = ChaosPeers(local=None, model=tmp_path, extra=[], workdir=tmp_path)
    started = datetime(2026, 12, 2, 0, 53, 11, 990000).timestamp()
    served = tmp_path / "peer2.4.log"
    served.write_text(
        "Failed to load CPU gemm_4bit_forward\n"
        "2026-12-02 00:53:35,570 INFO peers.daemon: announcing addresses /ip4/127.0.0.1/tcp/1/p2p/Qm\n"
        "2026-12-02 00:53:41,817 INFO peers.daemon: serving blocks 3:6 of model as Qm\n"
        "2026-12-02 00:54:37,749 INFO peers.mover: now serving blocks 2:5, 28110 tokens/s\n"
    )
    crashed = tmp_path / "peer3.5.log"
    crashed.write_text("2026-12-02 00:53:20,000 INFO peers.daemon: announcing addresses /ip4/127.0.0.1\n")
    fleet.restarted_at = {served: started, crashed: started}
    times = {r.log: r for r in fleet.restart_times()}
    assert times["peer2.4"].joined == pytest.approx(23.58)
    assert times["peer2.4"].serving == pytest.approx(29.827)
    assert times["peer3.5"].serving is None


def test_a_control_run_starts_a_peer_wherever_the_churn_run_would():
    # A crash or a clean leave restarts one peer 2 s later, a double crash two, a freeze only when it ends in SIGKILL
    # (after its hold), a join starts one: the control run's load is the churn run's starts, without its failures.
    schedule = [
        ChaosEvent(1.0, "kill", ("a",)),
        ChaosEvent(2.0, "double-kill", ("a", "b")),
        ChaosEvent(3.0, "freeze", ("a",), thaw=True),
        ChaosEvent(4.0, "freeze", ("b",), hold=1.5, thaw=False),
        ChaosEvent(5.0, "join"),
        ChaosEvent(6.0, "term", ("c",)),
    ]
    starts = ShadowStarts(LocalSwarm(Path("/nonexistent")), Path("/nonexistent"), schedule, "0:3", delay=2.0)
    assert starts.starts == [3.0, 4.0, 4.0, 7.0, 7.5, 8.0]
    starts.stop()  # never started: nothing to wait for
