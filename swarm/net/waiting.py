"""Waiting for the swarm: one deadline type, one poll loop and one way to say what a wait still misses, so that every
wait has a bound and says what for, without flooding the terminal or the log."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO, TypeVar

T = TypeVar("T")


class Deadline:
    """A wait's bound, from the moment it is made: ``passed`` once ``seconds`` have gone by (on ``clock``)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.started = clock()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def left(self) -> float:
        return max(0.0, self.seconds - self.elapsed)

    @property
    def passed(self) -> bool:
        return self.elapsed > self.seconds

    def pause(self, interval: float) -> None:
        """Sleep ``interval`` seconds, or until the deadline if that comes first."""
        time.sleep(max(0.0, min(interval, self.left)))


class _ClearLine(logging.Filter):
    """Clears a wait's line on the terminal before a log record is written there, so that the record starts a line of
    its own instead of running on from the wait's (which the wait's next look redraws under it)."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        self.stream.write("\r\x1b[K")
        return True


class WaitLine:
    """What a wait still misses, as people can follow it: on a terminal one line redrawn in place; elsewhere (a log
    file, CI) a log record at most every ``every`` seconds, so a wait polled every second is not a burst of identical
    lines. ``update`` as often as the wait looks; ``done`` once it is over (a no-op if nothing was shown)."""

    def __init__(
        self,
        what: str,
        deadline: Deadline,
        log: logging.Logger,
        level: int = logging.INFO,
        every: float = 10.0,
        stream: TextIO | None = None,
    ):
        self.what, self.deadline, self.log, self.level, self.every = what, deadline, log, level, every
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.shown = False
        self.logged_at: float | None = None
        self.clear = _ClearLine(self.stream)
        self.clearing: list[logging.Handler] = []  # handlers writing to the terminal, while the line is drawn

    def text(self, missing: str) -> str:
        waited, left = self.deadline.elapsed, self.deadline.left
        return f"{self.what} (waited {waited:.0f}s, {left:.0f}s of patience left): {missing}"

    def update(self, missing: str) -> None:
        """Show what is still missing: redrawn at once on a terminal, logged if ``every`` seconds have passed."""
        if not self.log.isEnabledFor(self.level):
            return
        if self.tty:  # cut to the terminal's width: a wrapped line could not be redrawn in place
            width = shutil.get_terminal_size().columns - 1
            self.stream.write(f"\r\x1b[K{self.text(missing)[:width]}")
            self.stream.flush()
            if not self.shown:
                self._clear_before_records()
            self.shown = True
            return
        now = self.deadline.clock()
        if self.logged_at is None or now - self.logged_at >= self.every:
            self.log.log(self.level, "%s", self.text(missing))
            self.logged_at, self.shown = now, True

    def _clear_before_records(self) -> None:
        """Hook the handlers that write to this terminal (the logger's, up to the root's) for as long as the line is
        drawn."""
        logger: logging.Logger | None = self.log
        while logger is not None:
            self.clearing += [h for h in logger.handlers if getattr(h, "stream", None) is self.stream]
            logger = logger.parent if logger.propagate else None
        for handler in self.clearing:
            handler.addFilter(self.clear)

    def done(self, outcome: str = "done") -> None:
        """End the wait's line (on a terminal) or log its outcome, if anything was shown."""
        if not self.shown:
            return
        self.shown = False
        line = f"{self.what}: {outcome} after {self.deadline.elapsed:.0f}s"
        if self.tty:
            for handler in self.clearing:
                handler.removeFilter(self.clear)
            self.clearing = []
            self.stream.write(f"\r\x1b[K{line}\n")
            self.stream.flush()
        else:
            self.log.log(self.level, "%s", line)


def poll(read: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 1.0) -> T:
    """``read()`` until ``done`` says yes or ``timeout`` seconds have passed; the last value read either way (the
    caller says what it waited for: an assertion on it shows what was seen). The first look is immediate."""
    deadline = Deadline(timeout)
    value = read()
    while not done(value) and not deadline.passed:
        deadline.pause(interval)
        value = read()
    return value
