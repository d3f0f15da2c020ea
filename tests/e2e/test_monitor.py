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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from swarm.net.security import Identity, keygen
from swarm.net.waiting import poll
from swarm.ops.health import DEGRADED, GONE, HEALTHY, short
from swarm.ops.monitor import API
from swarm.testing.localswarm import LocalSwarm


def _get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read()


@contextmanager
def monitor(workdir: Path, initial_peers: list[str], name: str, *extra: str) -> Iterator[str]:
    """``swarm monitor`` on 127.0.0.1 (any free port), refreshing every second; yields its URL; killed by PID."""
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "swarm", "monitor", "--initial-peers", *initial_peers, "--port", "0"]
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


def test_the_monitor_sees_a_peer_fail_within_two_refreshes(tiny_models, tmp_path):
    with LocalSwarm(tmp_path) as local:
        local.start_dht()
        peers = local.start_peers(tiny_models["llama"], {"a0": "0:2", "a1": "0:2", "b0": "2:4", "b1": "2:4"})
        monitor_process, url = local.start_monitor(refresh=1)  # as the demo starts it
        state = poll(lambda: _state(url), lambda s: _model(s)["status"] == HEALTHY, 30, interval=0.5)
        model = _model(state)
        assert state["error"] is None and model["status"] == HEALTHY, state
        assert {p["peer"] for p in model["peers"]} == {p.peer_id for p in peers.values()}
        assert [b["block"] for b in model["blocks"]] == [0, 1, 2, 3] and model["problems"] == []
        assert {p["weights"] for p in model["peers"]} == {"none/float32"}, "quantization / dtype as served"
        memory = [p["memory"] for p in model["peers"]]
        assert all(m["rss"] > 100 * 2**20 and m["host_total"] >= m["host_available"] > 0 for m in memory), memory
        assert {(m["kept_inputs_max"], m["activation_cache_max"]) for m in memory} == {(4096 * 2**20, 1024 * 2**20)}
        peers["b1"].signal(signal.SIGKILL)
        killed = time.monotonic()
        state = poll(lambda: _state(url), lambda s: _model(s)["status"] == DEGRADED, 30, interval=0.5)
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
        state = poll(lambda: _state(url), lambda s: "private swarm" in (s["error"] or ""), 30, interval=0.5)
        assert "pass its swarm key (--swarm-key FILE)" in state["error"] and state["models"] == [], state
        state = poll(lambda: _state(wrong_key), lambda s: "wrong swarm key" in (s["error"] or ""), 30, interval=0.5)
        assert state["models"] == [], state
        state = poll(lambda: _state(elsewhere), lambda s: "nobody serves" in (s["error"] or ""), 30, interval=0.5)
        assert "nobody serves model 'llama-9000' in this swarm; served: " in state["error"], state
        if shutil.which("chromium") or shutil.which("chromium-browser"):
            assert "--swarm-key" in _dom(_chromium(), url, tmp_path / "outsider.png")


@pytest.mark.browser
def test_a_browser_shows_every_peer_and_block_healthy_then_degraded(private_swarm, tmp_path):
    """With the key, headless chromium draws the page (its script fetches the state): every peer and block,
    healthy; after a SIGKILL, degraded and which blocks."""
    browser = _chromium()
    local, key, peers = private_swarm
    with monitor(tmp_path, local.initial_peers, "member", "--swarm-key", str(key)) as url:
        assert (
            _model(poll(lambda: _state(url), lambda s: _model(s)["status"] == HEALTHY, 30, interval=0.5))["status"]
            == HEALTHY
        )
        dom = _dom(browser, url, tmp_path / "healthy.png")
        assert ">healthy<" in dom, dom[-3000:]
        assert all(short(peer.peer_id) in dom for peer in peers.values()), dom[-3000:]
        assert all(f">{b}<" in dom for b in range(4)), dom[-3000:]
        assert dom.count("inputs 0 MiB/4.0 GiB · cache ") == 2, dom[-3000:]  # each peer's memory against its bounds
        peers["p1"].signal(signal.SIGKILL)
        poll(lambda: _state(url), lambda s: _model(s)["status"] == DEGRADED, 30, interval=0.5)
        dom = _dom(browser, url, tmp_path / "degraded.png")
        assert ">degraded<" in dom and "blocks 0-3 have one server" in dom, dom[-3000:]


def _cli(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "swarm", "monitor", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line(process: subprocess.Popen, needle: str) -> None:
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("swarm ")]
    assert len(errors) == 1 and needle in errors[0], stderr[-3000:]


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
            state = poll(
                lambda: _state(url), lambda s: "none of the initial peers" in (s["error"] or ""), 60, interval=0.5
            )
            assert "none of the initial peers answered" in state["error"] and "swarm dht" in state["error"], state
