"""Pipelined micro-batches: several micro-batches of one step in flight at once, so that while the peers of one span
compute micro-batch 2, those of the next compute micro-batch 1 (SWARM's pipeline). Exact: every micro-batch gets its
id (and so its place in the canonical sum on the peers) in the order it was given, whatever order they finish in."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

logger = logging.getLogger(__name__)

MicroBatch = Mapping[str, torch.Tensor]


def run_pipelined(
    micro_batches: Iterable[MicroBatch],
    start: Callable[[MicroBatch], Callable[[], torch.Tensor]],
    max_in_flight: int,
) -> list[torch.Tensor]:
    """Run ``start(batch)()`` for each micro-batch in worker threads, at most ``max_in_flight`` at once; ``start``
    runs in the caller's thread, in order (it takes the micro-batch's id), and returns the work for a worker. A new
    micro-batch starts as soon as any one in flight finishes, not only the oldest: one on a slow replica does not
    hold the others' places. Returns the results in the order of ``micro_batches``; the first failure is raised once
    every started micro-batch has finished (none is left running)."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    results: dict[Future, int] = {}
    in_flight: set[Future] = set()
    with ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="swarm-micro-batch") as pool:
        try:
            for index, batch in enumerate(micro_batches):
                if len(in_flight) >= max_in_flight:
                    in_flight = _settle_one(in_flight)
                future = pool.submit(start(batch))
                results[future], in_flight = index, in_flight | {future}
            while in_flight:
                in_flight = _settle_one(in_flight)
        except BaseException:
            for future in in_flight:
                future.cancel()
            raise
    return [future.result() for future in sorted(results, key=results.__getitem__)]


def _settle_one(in_flight: set[Future]) -> set[Future]:
    """Wait until at least one micro-batch in flight finishes; raise its failure. Returns those still running."""
    done, running = wait(in_flight, return_when=FIRST_COMPLETED)
    for future in done:
        future.result()
    return running
