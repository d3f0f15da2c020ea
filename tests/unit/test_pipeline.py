"""The pipeline of micro-batches: order kept, a slow micro-batch does not hold the others' places, failures wait."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarm.client.pipeline import run_pipelined


def test_a_slow_micro_batch_does_not_hold_the_others_places():
    last_started = threading.Event()
    started: list[int] = []

    def start(batch):
        index = int(batch["i"])
        started.append(index)

        def work() -> torch.Tensor:
            if index == 0:  # the first micro-batch is on a slow replica: it ends only after the last one started
                return torch.tensor(float(last_started.wait(timeout=10)))
            if index == 5:
                last_started.set()
            return torch.tensor(float(index))

        return work

    results = run_pipelined(({"i": torch.tensor(i)} for i in range(6)), start, max_in_flight=2)
    assert started == list(range(6))
    assert [r.item() for r in results] == [1.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # in order; micro-batch 0 saw 5 start


def test_results_come_in_the_order_given_whatever_order_they_finish_in():
    def start(batch):
        index = int(batch["i"])
        return lambda: (time.sleep(0.01 * (5 - index)), torch.tensor(float(index)))[1]

    results = run_pipelined(({"i": torch.tensor(i)} for i in range(6)), start, max_in_flight=3)
    assert [r.item() for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_failure_is_raised_after_the_started_micro_batches_finished():
    finished: list[int] = []

    def start(batch):
        index = int(batch["i"])

        def work() -> torch.Tensor:
            if index == 1:
                raise ConnectionError("peer gone")
            time.sleep(0.2)
            finished.append(index)
            return torch.tensor(0.0)

        return work

    with pytest.raises(ConnectionError, match="peer gone"):
        run_pipelined(({"i": torch.tensor(i)} for i in range(8)), start, max_in_flight=3)
    assert 0 in finished and len(finished) <= 3  # what had started ran to its end; nothing new started after


def test_max_in_flight_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        run_pipelined([], lambda batch: lambda: torch.tensor(0.0), max_in_flight=0)
