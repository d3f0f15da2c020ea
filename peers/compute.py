"""The peer's one compute thread: every access to the backend's blocks and adapter state, reads included, runs on
it, one at a time, so requests never interleave on the blocks and no reader sees a change half made."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Compute:
    """``await compute(fn, *args)`` runs ``fn(*args)`` on the compute thread. ``after`` runs there after every job
    (its failures too): it publishes what readers off the thread may see, so that they never queue behind the work.
    A liveness ping that waited for the forwards queued before it took a busy peer for a dead one (issue 56)."""

    def __init__(self, after: Callable[[], None] | None = None) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.after = after

    async def __call__(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._run, fn, args)

    def _run(self, fn: Callable[..., T], args: tuple) -> T:
        try:
            return fn(*args)
        finally:
            if self.after is not None:
                self.after()

    async def timed(self, fn: Callable[..., T], *args) -> tuple[T, float]:
        """``fn(*args)`` on the compute thread, and the seconds it ran there (the wait for the thread left out): what
        a client routes by, since the wait is work it or others gave this peer, which they count on their own."""

        def run() -> tuple[T, float]:
            started = time.monotonic()
            return fn(*args), time.monotonic() - started

        return await self(run)

    def shutdown(self) -> None:
        """Drop queued work and stop (a peer that is killed or left does not finish what it had not started)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
