"""A frozen peer is given up as soon as it stops answering at all, a busy one is waited for: calls watch their peer
(``Transport.acall(watch=True)``: hello every second while the reply is awaited)."""

from __future__ import annotations

import time

import peft
import pytest

import swarm
from swarm.net.message import Message
from swarm.net.transport import PROBE_EVERY, PROBE_TIMEOUT, PeerFrozenError
from swarm.testing.faults import Action, Fault

INFO = {"method": "info"}


@pytest.fixture
def two_peers(inprocess_swarm, tiny_models):
    local = inprocess_swarm()
    peers = local.start_peers({"a": "0:4", "b": "0:4"})
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        tiny_models["llama"],
        initial_peers=local.initial_peers,
        adapter="frozen",
        lora_config=peft.LoraConfig(r=4, target_modules=["q_proj"]),
    )
    try:
        yield model, peers
    finally:
        for peer in peers.values():
            peer.thaw()
        model.shutdown()


def test_a_frozen_peer_is_given_up_long_before_the_calls_timeout(two_peers, cpu_load):
    model, peers = two_peers
    transport = model.session.transport
    peers["b"].freeze()
    started = time.monotonic()
    with pytest.raises(PeerFrozenError, match="stopped answering"):
        transport.call(peers["b"].peer_id, Message(INFO, []), timeout=120, watch=True)
    assert time.monotonic() - started < 60  # given up by its probes (~PROBE_EVERY + PROBE_TIMEOUT), not the 120 s
    assert transport.call(peers["a"].peer_id, Message(INFO, []), timeout=60, watch=True)  # the others still answer


def test_a_busy_peer_that_still_answers_hello_is_waited_for(two_peers, cpu_load):
    model, peers = two_peers
    busy_for = PROBE_EVERY + 2 * PROBE_TIMEOUT  # several probes come and go while the handler works
    fault = peers["a"].faults.arm(Fault(Action.FREEZE, "info", freeze_for=busy_for))
    started = time.monotonic()
    reply = model.session.transport.call(peers["a"].peer_id, Message(INFO, []), timeout=120, watch=True)
    assert fault.fired.is_set() and reply.meta.get("start") == 0
    assert time.monotonic() - started >= busy_for
