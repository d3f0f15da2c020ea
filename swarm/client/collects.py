"""The client's end of direct outputs: beside a chained forward, a ``collect`` goes to the chain's last hop, which
hands it the chain's output (peers/deliveries.py), so that the output crosses one link instead of travelling back
through every hop; the acks still come back along the chain. The collect runs in a thread of its own, through the
same ``PeerCalls.ask`` as every request (its call hook, bans and timeouts), and is cancelled once its output is
not needed (the chain broke before its end, or answered with the output itself)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from hivemind.p2p import PeerID

from swarm.client.calls import PeerCalls
from swarm.net.chain import HOP_SLACK, MAX_HOLD, Delivery
from swarm.net.deltas import Delta
from swarm.net.protocol import CollectReply, CollectRequest, HiddenReply

WORKERS = 64  # collects at once (a pipeline has at most 32 micro-batches in flight)


class Collect:
    """One chain's output, asked of its last hop: named in the forward by ``delivery``."""

    def __init__(self, calls: PeerCalls, pool: ThreadPoolExecutor, peer: PeerID, wait: float, reply_bytes: int):
        self.calls, self.peer, self.reply_bytes = calls, peer, reply_bytes
        self.delivery = Delivery(uuid.uuid4().hex, min(wait, MAX_HOLD))
        self._lock = threading.Lock()
        self._call: Future | None = None  # the transport's call in flight, to cancel
        self._abandoned = False
        self._task = pool.submit(self._ask)

    def _ask(self) -> CollectReply:
        request = CollectRequest(token=self.delivery.token, wait=self.delivery.hold, reply_bytes=self.reply_bytes)
        floor = self.delivery.hold + HOP_SLACK  # the peer refuses once its wait is over: that answer must come back
        return self.calls.ask(self.peer, request, floor=floor, measured=False, started=self._started)

    def _started(self, call: Future) -> None:
        with self._lock:
            self._call = call
            if self._abandoned:
                call.cancel()

    def outputs(self, reply: HiddenReply) -> torch.Tensor | Delta | None:
        """The chain's output: the reply's own where it carries one or the chain broke (the output of the last hop
        that ran), else what the collect brings (its failure raises, as the last hop's: ``PeerFailure``)."""
        if reply.outputs is not None or reply.failure is not None:
            self.abandon()
            return reply.outputs
        return self._task.result().outputs

    def abandon(self) -> None:
        """The output is not needed (or came another way): stop asking."""
        with self._lock:
            self._abandoned = True
            if self._call is not None:
                self._call.cancel()
        self._task.cancel()


class Collects:
    """Starts the collects of chained forwards, each in a worker thread."""

    def __init__(self, calls: PeerCalls):
        self.calls = calls
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="swarm-collect")

    def start(self, last: PeerID, wait: float, reply_bytes: int) -> Collect:
        """Ask ``last`` for the output (about ``reply_bytes`` on the wire) of the forward that names the returned
        collect's ``delivery``."""
        return Collect(self.calls, self._pool, last, wait, reply_bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
