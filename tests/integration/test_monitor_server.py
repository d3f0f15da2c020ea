"""``swarm monitor``: the health state shared with ``swarm status`` (unit tests on hand-made views), the JSON API and
the page against real local swarms (a peer SIGKILLed turns the swarm degraded), a private swarm seen with and
without its key, and the page as a headless browser draws it (skipped without chromium)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from swarm.net.errors import SwarmAccessError
from swarm.net.waiting import poll
from swarm.ops.monitor import API, MonitorConfig, serve, shutdown


def _get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read()


def test_an_observation_that_fails_is_an_error_on_the_page_not_a_crash(monkeypatch):
    """The server keeps serving its files and a JSON state whose ``error`` says what to do."""

    class Refused:
        def __init__(self, *_):
            raise SwarmAccessError("/ip4/1.2.3.4/tcp/1/p2p/Qm belongs to a private swarm: pass its swarm key")

    monkeypatch.setattr("swarm.ops.monitor.Observer", Refused)
    server, watcher = serve(MonitorConfig(["/ip4/1.2.3.4/tcp/1/p2p/Qm"], None, refresh=0.1), "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        state = poll(lambda: json.loads(_get(url + API)[1]), lambda s: "private swarm" in (s["error"] or ""), 10)
        assert "pass its swarm key" in state["error"] and state["models"] == []
        for path, kind in (("/", "text/html"), ("/app.js", "text/javascript"), ("/style.css", "text/css")):
            got, body = _get(url + path)
            assert got.startswith(kind) and body
        with pytest.raises(urllib.error.HTTPError, match="404"):
            _get(url + "/elsewhere")
        assert watcher.thread.is_alive()
    finally:
        shutdown(server, watcher)
