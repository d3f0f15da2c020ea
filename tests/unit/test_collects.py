"""The client's collect of a chain's output (swarm/client/collects.py): it asks the last hop beside the forward,
takes the output from the chain's reply where the reply carries one (and then lets its own call go), and its call
in flight is cancelled when the output is not needed."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.client.collects import Collect
from swarm.net.chain import MAX_HOLD, ChainFailure
from swarm.net.protocol import CollectReply, CollectRequest, HiddenReply

PEER = PeerID(b"c" * 8)
OUTPUT = torch.randn(2, 3, 8)


class Calls:
    """``PeerCalls.ask`` as a collect uses it: the call in flight is a future, answered by the test or cancelled."""

    def __init__(self) -> None:
        self.asked: list[CollectRequest] = []
        self.call: Future = Future()
        self.started = threading.Event()

    def ask(self, peer, request, floor=0.0, measured=True, started=None):
        self.asked.append(request)
        started(self.call)
        self.started.set()
        return self.call.result(timeout=10)


def test_the_collect_asks_the_last_hop_and_brings_its_output():
    calls, pool = Calls(), ThreadPoolExecutor(1)
    collect = Collect(calls, pool, PEER, wait=12.0, reply_bytes=192)
    assert calls.started.wait(5)
    (request,) = calls.asked
    assert (request.token, request.wait, request.reply_bytes) == (collect.delivery.token, 12.0, 192)
    calls.call.set_result(CollectReply(OUTPUT))
    assert torch.equal(collect.outputs(HiddenReply(None)), OUTPUT)
    assert Collect(calls, pool, PEER, wait=1e6, reply_bytes=0).delivery.hold == MAX_HOLD


@pytest.mark.parametrize(
    "reply", [HiddenReply(OUTPUT), HiddenReply(OUTPUT, failure=ChainFailure("x", "timeout", "no answer"))]
)
def test_an_output_in_the_chains_reply_lets_the_collect_go(reply):
    """A broken chain's output (the last hop that ran), or a last hop that could not hold its output."""
    calls, pool = Calls(), ThreadPoolExecutor(1)
    collect = Collect(calls, pool, PEER, wait=12.0, reply_bytes=0)
    assert calls.started.wait(5)
    assert collect.outputs(reply) is OUTPUT
    assert calls.call.cancelled()


def test_a_collect_let_go_before_its_call_starts_cancels_it_as_it_starts():
    calls, pool = Calls(), ThreadPoolExecutor(1)
    blocker = threading.Event()
    pool.submit(blocker.wait, 5)  # the only worker is busy: the collect waits in the queue
    collect = Collect(calls, pool, PEER, wait=12.0, reply_bytes=0)
    collect.abandon()
    blocker.set()
    pool.shutdown(wait=True)
    assert calls.asked == [], "a collect let go is never sent"
