"""Pipelined micro-batches: several micro-batches of one step in flight at once, so that while the peers of one span
compute micro-batch 2, those of the next compute micro-batch 1 (SWARM's pipeline). Exact: every micro-batch gets its
id (and so its place in the canonical sum on the peers) in the order it was given, whatever order they finish in."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

MicroBatch = Mapping[str, torch.Tensor]


def run_pipelined(
    micro_batches: Iterable[MicroBatch],
    start: Callable[[MicroBatch], Callable[[], torch.Tensor]],
    max_in_flight: int,
) -> list[torch.Tensor]:
    """Run ``start(batch)()`` for each micro-batch in worker threads, at most ``max_in_flight`` at once; ``start``
    runs in the caller's thread, in order (it takes the micro-batch's id), and returns the work for a worker.
    Returns the results in the order of ``micro_batches``; the first failure is raised once every started
    micro-batch has finished (none is left running)."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    results: list[torch.Tensor] = []
    in_flight: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="swarm-micro-batch") as pool:
        try:
            for batch in micro_batches:
                if len(in_flight) >= max_in_flight:
                    results.append(in_flight.popleft().result())
                in_flight.append(pool.submit(start(batch)))
            while in_flight:
                results.append(in_flight.popleft().result())
        except BaseException:
            for future in in_flight:
                future.cancel()
            raise
    return results
