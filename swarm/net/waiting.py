"""Waiting for the swarm: one deadline type and one poll loop, so that every wait has a bound and says what for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Deadline:
    """A wait's bound, from the moment it is made: ``passed`` once ``seconds`` have gone by."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def passed(self) -> bool:
        return self.elapsed > self.seconds

    def pause(self, interval: float) -> None:
        """Sleep ``interval`` seconds, or until the deadline if that comes first."""
        time.sleep(max(0.0, min(interval, self.seconds - self.elapsed)))


def poll(read: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 1.0) -> T:
    """``read()`` until ``done`` says yes or ``timeout`` seconds have passed; the last value read either way (the
    caller says what it waited for: an assertion on it shows what was seen). The first look is immediate."""
    deadline = Deadline(timeout)
    value = read()
    while not done(value) and not deadline.passed:
        deadline.pause(interval)
        value = read()
    return value
