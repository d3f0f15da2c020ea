"""A large message comes in lanes (``swarm.net.lanes``): the peer waits a bounded time for the lanes still missing,
and never bounds the handling once all are in. A backward chained through busy peers once took longer than the
lanes' wait and its caller got "the other lanes of this message never came" (CI, test_told_spans on two workers)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P

from swarm.net import lanes
from swarm.net.protocol import Method, PingRequest
from swarm.net.servicer import Doorkeeper
from swarm.net.transport import Transport
from swarm.net.wire import PeerDoors, decode, encode
from swarm.testing.faults import Action, Fault, FaultInjector

LANE_WAIT = 1.0
PAYLOAD = 3 * lanes.LANE_BYTES  # a ping this large goes in lanes


@pytest.fixture
def caller_and_server():
    """Two P2P daemons on loopback: a caller, and a server whose doors wait LANE_WAIT for missing lanes and run each
    handler through a fault injector."""
    server = RemoteExpertWorker.run_coroutine(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    faults = FaultInjector(kill=lambda: None)
    doors = Doorkeeper(faults=faults, lane_wait=LANE_WAIT)
    RemoteExpertWorker.run_coroutine(doors.register(server))
    maddrs = RemoteExpertWorker.run_coroutine(server.get_visible_maddrs())
    caller = RemoteExpertWorker.run_coroutine(P2P.create(initial_peers=maddrs))
    transport = Transport(caller)
    try:
        yield transport, server.peer_id, faults
    finally:
        faults.release()
        RemoteExpertWorker.run_coroutine(transport.shutdown())
        RemoteExpertWorker.run_coroutine(caller.shutdown())
        RemoteExpertWorker.run_coroutine(doors.unregister(server))
        RemoteExpertWorker.run_coroutine(server.shutdown())


def test_a_laned_request_whose_handling_outlasts_the_lane_wait_is_answered(caller_and_server):
    transport, server, faults = caller_and_server
    slow = faults.arm(Fault(Action.FREEZE, Method.PING, freeze_for=4 * LANE_WAIT))
    started = time.monotonic()
    reply = transport.ask(server, PingRequest(payload=torch.zeros(PAYLOAD, dtype=torch.uint8)), timeout=60)
    assert slow.fired.is_set() and transport.laned[Method.PING] == 1
    assert reply.received == PAYLOAD
    assert time.monotonic() - started >= 4 * LANE_WAIT


def test_a_message_whose_other_lanes_never_come_is_refused_after_the_lane_wait(caller_and_server):
    transport, server, _ = caller_and_server
    parts = encode(PingRequest(payload=torch.zeros(PAYLOAD, dtype=torch.uint8)).to_message(), None, lanes.LANE_BYTES)
    first, _second = lanes.pack(parts, 2, uuid.uuid4().hex)
    stub = PeerDoors.get_stub(transport.p2p, server)
    started = time.monotonic()
    reply = RemoteExpertWorker.run_coroutine(stub.rpc_lane(first, timeout=30))
    waited = time.monotonic() - started
    assert "never came" in decode(lanes.unpack([reply])).meta["error"]
    assert LANE_WAIT * 0.9 <= waited < 25
