"""``swarm monitor``: the health state shared with ``swarm status`` (unit tests on hand-made views), the JSON API and
the page against real local swarms (a peer SIGKILLed turns the swarm degraded), a private swarm seen with and
without its key, and the page as a headless browser draws it (skipped without chromium)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest
from hivemind.p2p import PeerID

from swarm.errors import SwarmAccessError
from swarm.health import BROKEN, DEGRADED, GONE, HEALTHY, Tracker, build, short
from swarm.localswarm import LocalSwarm
from swarm.monitor import API, MonitorConfig, serve, shutdown
from swarm.protocol import AdapterInfo, PeerInfo
from swarm.records import CommittedRecord, ServerRecord, ServerState
from swarm.security import Identity, keygen
from swarm.status import render, render_health
from swarm.view import SwarmView

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


def _get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read()


def test_an_observation_that_fails_is_an_error_on_the_page_not_a_crash(monkeypatch):
    """The server keeps serving its files and a JSON state whose ``error`` says what to do."""

    class Refused:
        def __init__(self, *_):
            raise SwarmAccessError("/ip4/1.2.3.4/tcp/1/p2p/Qm belongs to a private swarm: pass its swarm key")

    monkeypatch.setattr("swarm.monitor.Observer", Refused)
    server, watcher = serve(MonitorConfig(["/ip4/1.2.3.4/tcp/1/p2p/Qm"], None, refresh=0.1), "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        state = _wait(lambda: json.loads(_get(url + API)[1]), lambda s: "private swarm" in (s["error"] or ""), 10)
        assert "pass its swarm key" in state["error"] and state["models"] == []
        for path, kind in (("/", "text/html"), ("/app.js", "text/javascript"), ("/style.css", "text/css")):
            got, body = _get(url + path)
            assert got.startswith(kind) and body
        with pytest.raises(urllib.error.HTTPError, match="404"):
            _get(url + "/elsewhere")
        assert watcher.thread.is_alive()
    finally:
        shutdown(server, watcher)


# --- real swarms ---------------------------------------------------------------------------------------------


def _wait(read: Callable[[], object], done: Callable[[object], bool], timeout: float):
    """Poll ``read`` until ``done``; return the last value (a failing assertion on it then shows what was seen)."""
    deadline = time.monotonic() + timeout
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = read()
    return value


@contextmanager
def monitor(workdir: Path, initial_peers: list[str], name: str, *extra: str) -> Iterator[str]:
    """``swarm monitor`` on 127.0.0.1 (any free port), refreshing every second; yields its URL; killed by PID."""
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", "monitor", "--initial-peers", *initial_peers, "--port", "0"]
            + ["--refresh", "1", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "swarm monitor on " not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        line = next(ln for ln in log.read_text().splitlines() if ln.startswith("swarm monitor on "))
        yield line.split(" on ", 1)[1].split()[0].rstrip("/")
        assert process.poll() is None, log.read_text()[-3000:]  # it never crashed
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _state(url: str) -> dict:
    return json.loads(_get(url + API)[1])


def _model(state: dict) -> dict:
    return state["models"][0] if state["models"] else {"status": None, "peers": [], "problems": []}


@pytest.mark.swarm
def test_the_monitor_sees_a_peer_fail_within_two_refreshes(tiny_models, tmp_path):
    with LocalSwarm(tmp_path) as local:
        local.start_dht()
        peers = local.start_peers(tiny_models["llama"], {"a0": "0:2", "a1": "0:2", "b0": "2:4", "b1": "2:4"})
        monitor_process, url = local.start_monitor(refresh=1)  # as the demo starts it
        state = _wait(lambda: _state(url), lambda s: _model(s)["status"] == HEALTHY, 30)
        model = _model(state)
        assert state["error"] is None and model["status"] == HEALTHY, state
        assert {p["peer"] for p in model["peers"]} == {p.peer_id for p in peers.values()}
        assert [b["block"] for b in model["blocks"]] == [0, 1, 2, 3] and model["problems"] == []
        assert {p["weights"] for p in model["peers"]} == {"none/float32"}, "quantization / dtype as served"
        peers["b1"].signal(signal.SIGKILL)
        killed = time.monotonic()
        state = _wait(lambda: _state(url), lambda s: _model(s)["status"] == DEGRADED, 30)
        model = _model(state)
        assert model["status"] == DEGRADED, state
        assert time.monotonic() - killed < 10, "noticed within a couple of refreshes"
        assert "blocks 2-3 have one server: a failure there would pause training" in model["problems"][0]
        dead = {p["peer"]: p["state"] for p in model["peers"]}[peers["b1"].peer_id]
        assert dead in ("unreachable", GONE)
        assert monitor_process.popen.poll() is None, monitor_process.tail()  # it never crashed


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed: `apt-get install chromium` (scripts/test.sh does, as root)")
    return found


def _dom(browser: str, url: str, screenshot: Path) -> str:
    """The page after its script ran (and fetched the state), as a headless chromium sees it."""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    args += ["--window-size=1400,900", f"--user-data-dir={screenshot.parent / 'chromium-profile'}"]
    subprocess.run([*args, f"--screenshot={screenshot}", url], capture_output=True, timeout=60, check=True)
    return subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=60, check=True).stdout


@pytest.fixture(scope="module")
def private_swarm(tiny_models, tmp_path_factory) -> Iterator[tuple[LocalSwarm, Path, dict]]:
    """A private swarm whose two peers each serve the whole tiny model: healthy at replication 2."""
    workdir = tmp_path_factory.mktemp("private")
    key = keygen(workdir / "swarm.key")
    with LocalSwarm(workdir) as local:
        local.start_dht(extra=["--swarm-key", str(key)])
        peers = local.start_peers(tiny_models["llama"], {"p0": "0:4", "p1": "0:4"}, extra=["--swarm-key", str(key)])
        yield local, key, peers


@pytest.mark.swarm
def test_without_the_key_the_page_says_the_swarm_is_private(private_swarm, tmp_path):
    """...with a wrong key, that the key is wrong; with the key but a model nobody serves, that nobody serves it."""
    local, key, _ = private_swarm
    peers = local.initial_peers
    wrong = keygen(tmp_path / "wrong.key")
    with (
        monitor(tmp_path, peers, "outsider") as url,
        monitor(tmp_path, peers, "wrong-key", "--swarm-key", str(wrong)) as wrong_key,
        monitor(tmp_path, peers, "elsewhere", "--swarm-key", str(key), "--model", "llama-9000") as elsewhere,
    ):
        state = _wait(lambda: _state(url), lambda s: "private swarm" in (s["error"] or ""), 30)
        assert "pass its swarm key (--swarm-key FILE)" in state["error"] and state["models"] == [], state
        state = _wait(lambda: _state(wrong_key), lambda s: "wrong swarm key" in (s["error"] or ""), 30)
        assert state["models"] == [], state
        state = _wait(lambda: _state(elsewhere), lambda s: "nobody serves" in (s["error"] or ""), 30)
        assert "nobody serves model 'llama-9000' in this swarm; served: " in state["error"], state
        if shutil.which("chromium") or shutil.which("chromium-browser"):
            assert "--swarm-key" in _dom(_chromium(), url, tmp_path / "outsider.png")


@pytest.mark.swarm
def test_a_browser_shows_every_peer_and_block_healthy_then_degraded(private_swarm, tmp_path):
    """With the key, headless chromium draws the page (its script fetches the state): every peer and block,
    healthy; after a SIGKILL, degraded and which blocks."""
    browser = _chromium()
    local, key, peers = private_swarm
    with monitor(tmp_path, local.initial_peers, "member", "--swarm-key", str(key)) as url:
        assert _model(_wait(lambda: _state(url), lambda s: _model(s)["status"] == HEALTHY, 30))["status"] == HEALTHY
        dom = _dom(browser, url, tmp_path / "healthy.png")
        assert ">healthy<" in dom, dom[-3000:]
        assert all(short(peer.peer_id) in dom for peer in peers.values()), dom[-3000:]
        assert all(f">{b}<" in dom for b in range(4)), dom[-3000:]
        peers["p1"].signal(signal.SIGKILL)
        _wait(lambda: _state(url), lambda s: _model(s)["status"] == DEGRADED, 30)
        dom = _dom(browser, url, tmp_path / "degraded.png")
        assert ">degraded<" in dom and "blocks 0-3 have one server" in dom, dom[-3000:]


def _cli(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "swarm.cli", "monitor", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line(process: subprocess.Popen, needle: str) -> None:
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("swarm ")]
    assert len(errors) == 1 and needle in errors[0], stderr[-3000:]


@pytest.mark.swarm
def test_malformed_input_exits_2_and_unreachable_peers_are_said_on_the_page(tmp_path):
    nobody = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.load_or_create(None).peer_id.to_base58()}"
    with socket.socket() as taken:  # all at once: each pays for Python's and torch's imports, the monitor waits
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        runs = {
            "'garbage' is not a peer's multiaddr": _cli("--initial-peers", "garbage"),
            "positive number of seconds": _cli("--initial-peers", nobody, "--refresh", "0"),
            f"cannot listen on 127.0.0.1:{port}": _cli("--initial-peers", nobody, "--port", port),
        }
        with monitor(tmp_path, [nobody], "unreachable") as url:
            for needle, process in runs.items():
                _one_line(process, needle)
            state = _wait(lambda: _state(url), lambda s: "none of the initial peers" in (s["error"] or ""), 60)
            assert "none of the initial peers answered" in state["error"] and "swarm dht" in state["error"], state
