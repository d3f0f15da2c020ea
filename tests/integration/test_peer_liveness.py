"""Telling a frozen peer from a busy one, and a restarted one from a dead one, over real P2P: calls watch their peer
(``Transport.acall(watch=True)``: hello every second while the reply is awaited), and a peer found gone is dialed
again once it may have restarted under the same id; a peer found frozen is kept out of this process's DHT lookups."""

from __future__ import annotations

import shutil
import threading
import time
from functools import partial
from pathlib import Path

import peft
import pytest
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.utils.mpfuture import MPFuture

import swarm
from swarm.net.addresses import hang_up
from swarm.net.message import Message
from swarm.net.suspects import is_suspected
from swarm.net.transport import GONE_RECHECK, PROBE_EVERY, PROBE_TIMEOUT, PeerFrozenError, PeerGoneError
from swarm.testing.faults import Action, Fault
from swarm.testing.inprocess import InProcessSwarm

INFO = {"method": "info"}


def serve_two_peers(local: InProcessSwarm, model_dir: Path) -> tuple[swarm.SwarmModelForCausalLM, dict]:
    """Peers a and b, both serving every block of the tiny llama, and a trainer connected to them."""
    peers = local.start_peers({"a": "0:4", "b": "0:4"})
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter="liveness",
        lora_config=peft.LoraConfig(r=4, target_modules=["q_proj"]),
    )
    return model, peers


@pytest.fixture
def two_peers(inprocess_swarm, tiny_models):
    model, peers = serve_two_peers(inprocess_swarm(), tiny_models["llama"])
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


def test_a_peer_found_frozen_is_left_out_of_the_dht_lookups(two_peers, cpu_load):
    # Each DHT lookup that asks a frozen peer waits hivemind's 3 s RPC timeout: in the churn hour a takeover's first
    # announcement waited 6 s on two frozen peers before it loaded anything.
    model, peers = two_peers
    model.session.router.refresher.stop()  # no lookups of its own meanwhile: only the transport may have told the DHT
    session, a, b = model.session, peers["a"].peer_id, peers["b"].peer_id
    assert session.transport.call(a, Message(INFO, []), timeout=60)
    peers["b"].freeze()
    with pytest.raises(TimeoutError):
        session.transport.call(b, Message(INFO, []), timeout=2)
    assert is_suspected(session.dht, b)
    assert not is_suspected(session.dht, a)


async def _hold_reply_lock(_dht, _node, seconds: float, flag: str) -> None:
    """In a DHT process: take hivemind's reply lock, shared by every DHT process forked from the test's, for a while."""
    MPFuture._update_lock.acquire()
    Path(flag).touch()
    threading.Timer(seconds, MPFuture._update_lock.release).start()


async def _answer(_dht, _node) -> bool:
    return True


def test_a_peer_frozen_while_its_dht_replies_hangs_no_other_dht(two_peers, tmp_path):
    # The last test's client once waited forever on its own DHT process: b had been stopped while replying, holding
    # the lock that every DHT process forked from this one shares, so no other could reply. Real peers share none.
    model, peers = two_peers
    flag = tmp_path / "held"
    peers["b"].daemon.dht.run_coroutine(partial(_hold_reply_lock, seconds=1.0, flag=str(flag)), return_future=True)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert time.monotonic() < deadline, "b's DHT process never took the lock"
        time.sleep(0.01)
    peers["b"].freeze()
    assert model.session.dht.run_coroutine(_answer, return_future=True).result(timeout=30)


def test_a_busy_peer_that_still_answers_hello_is_waited_for(two_peers, cpu_load):
    model, peers = two_peers
    busy_for = PROBE_EVERY + 2 * PROBE_TIMEOUT  # several probes come and go while the handler works
    fault = peers["a"].faults.arm(Fault(Action.FREEZE, "info", freeze_for=busy_for))
    started = time.monotonic()
    reply = model.session.transport.call(peers["a"].peer_id, Message(INFO, []), timeout=120, watch=True)
    assert fault.fired.is_set() and reply.meta.get("start") == 0
    assert time.monotonic() - started >= busy_for


def test_a_peer_found_gone_is_dialed_again_once_it_may_have_restarted(two_peers):
    # A replica fetching gradients from a holder that restarted under the same id, before the holder's new record
    # reached it: the churn hour's commit failed 8 rounds in a row on "peer ... is gone" while the holder served.
    model, peers = two_peers
    model.session.router.refresher.stop()  # no new records learned meanwhile: only the call itself may bring b back
    transport, b = model.session.transport, peers["b"].peer_id
    transport.gone[b] = time.time()  # just found gone: calls fail at once, no dial
    with pytest.raises(PeerGoneError):
        transport.call(b, Message(INFO, []), timeout=30)
    transport.gone[b] = time.time() - GONE_RECHECK - 1  # found gone a while ago; b answers (it restarted)
    assert transport.call(b, Message(INFO, []), timeout=30).meta.get("start") == 0
    assert not transport.is_gone(b)


def test_a_peer_that_restarted_unseen_is_called_not_found_gone(inprocess_swarm, tiny_models, cpu_load):
    # A churn run: a peer left cleanly (no call failed on it), came back under the same id on another port, and the
    # client's first call found the old connection closed and called the peer gone; it stayed out of every route
    # until its next announcement (10 s).
    local = inprocess_swarm()
    model, peers = serve_two_peers(local, tiny_models["llama"])
    try:
        session, b = model.session, peers["b"].peer_id
        assert session.transport.call(b, Message(INFO, []), timeout=60)  # answered: the client knows its connection
        peers["b"].stop()  # a clean leave: nothing the client sends fails meanwhile
        # the same key under another name: the client's DHT process, forked while b ran, inherited b's lock on
        # b.key (in one process only; peers are processes of their own)
        again = shutil.copy(local.workdir / "b.key", local.workdir / "b-again.key")
        assert local.add_peer("0:4", "b-again", identity=str(again)).peer_id == b
        session.router.refresh()  # its new record, with its new address
        # no connection to it yet (its DHT may have dialed this client's meanwhile: not in the churn run)
        RemoteExpertWorker.run_coroutine(hang_up(session.transport.p2p, b))
        assert not RemoteExpertWorker.run_coroutine(session.transport.connected(b))
        assert session.transport.call(b, Message(INFO, []), timeout=60).meta.get("start") == 0
        assert not session.transport.is_gone(b)
    finally:
        model.shutdown()
