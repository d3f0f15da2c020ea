"""swarm.net.waiting.WaitLine: a wait polled every second tells what it still misses once in place on a terminal, and
at most every ``every`` seconds in a log, never as a burst of identical lines (a fake clock: no timing)."""

from __future__ import annotations

import io
import logging

import pytest

from swarm.net.waiting import Deadline, WaitLine

LOG = logging.getLogger("test-waiting")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _wait(stream: io.StringIO, seconds: int, clock: Clock) -> WaitLine:
    """A wait of 300 s of patience, looked at once a second for ``seconds`` seconds, then over."""
    waiting = WaitLine("waiting for peers", Deadline(300, clock), LOG, stream=stream)
    for second in range(seconds):
        clock.now = 100.0 + second
        waiting.update(f"blocks without a server yet: {'0:15,15:30' if second < 15 else '15:30'}")
    waiting.done("ready at step 0")
    return waiting


def test_a_log_gets_one_line_every_ten_seconds_with_what_is_missing_and_the_patience_left(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    _wait(io.StringIO(), 25, Clock())
    assert [r.getMessage() for r in caplog.records] == [
        "waiting for peers (waited 0s, 300s of patience left): blocks without a server yet: 0:15,15:30",
        "waiting for peers (waited 10s, 290s of patience left): blocks without a server yet: 0:15,15:30",
        "waiting for peers (waited 20s, 280s of patience left): blocks without a server yet: 15:30",
        "waiting for peers: ready at step 0 after 24s",
    ]


def test_a_terminal_gets_one_line_redrawn_in_place_and_the_log_nothing(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOG.name)
    monkeypatch.setenv("COLUMNS", "60")  # a line wider than the terminal is cut: a wrapped one cannot be redrawn
    terminal = Terminal()
    _wait(terminal, 25, Clock())
    text = terminal.getvalue()
    assert caplog.records == [] and text.count("\n") == 1 and text.endswith("ready at step 0 after 24s\n")
    drawn = [line.removeprefix("\x1b[K") for line in text.split("\r")[1:]]
    assert len(drawn) == 26 and all(len(line) < 60 for line in drawn)
    assert drawn[-2].startswith("waiting for peers (waited 24s, 276s of patience left): bl")


@pytest.mark.parametrize("stream", [io.StringIO, Terminal])
def test_a_wait_that_never_waited_or_is_not_wanted_shows_nothing(caplog, stream):
    caplog.set_level(logging.INFO, logger=LOG.name)
    shown = stream()
    WaitLine("waiting for peers", Deadline(300), LOG, stream=shown).done()  # the first look found everything
    caplog.set_level(logging.WARNING, logger=LOG.name)
    _wait(shown, 5, Clock())  # an INFO wait, with the logger at WARNING
    assert caplog.records == [] and shown.getvalue() == ""


def test_a_record_logged_to_the_terminal_during_the_wait_starts_a_line_of_its_own(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOG.name)
    monkeypatch.setenv("COLUMNS", "200")
    terminal, clock = Terminal(), Clock()
    handler = logging.StreamHandler(terminal)
    LOG.addHandler(handler)
    try:
        waiting = WaitLine("waiting for peers", Deadline(300, clock), LOG, stream=terminal)
        waiting.update("blocks without a server yet: 0:30")
        LOG.warning("peer X failed")
        waiting.update("blocks without a server yet: 0:30")
        waiting.done("ready at step 0")
        LOG.warning("after the wait")
    finally:
        LOG.removeHandler(handler)
    text = terminal.getvalue()
    assert "0:30\r\x1b[Kpeer X failed\n\r\x1b[Kwaiting for peers (waited 0s" in text, repr(text)
    assert text.endswith("ready at step 0 after 0s\nafter the wait\n") and handler.filters == [], repr(text)
