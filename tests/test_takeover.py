"""Promises 3-4 beyond replicas: blocks whose every server died are taken over by peers holding standby copies of
their adapter state; peers joining fill uncovered or under-replicated spans; training never restarts."""

from __future__ import annotations

import signal
import time

from failover_helpers import STEPS, assert_same_adapter, connect, reference_adapter, train
from hivemind.p2p import PeerID

from swarm.localswarm import LocalSwarm, Process
from swarm.wire import Message

FAST = ["--balance-interval", "1"]


def standby_steps(model, peer: Process, adapter: str) -> dict[int, int]:
    reply = model.transport.call(PeerID.from_base58(peer.peer_id), Message({"method": "info"}, []), 10)
    entry = reply.meta["adapters"].get(adapter, {})
    return {int(b): s for b, s in entry.get("standby", {}).items()}


def wait_standby_current(model, holders: list[Process], blocks: list[int], timeout: float = 60) -> None:
    """Until every block of ``blocks`` has a standby copy at the model's step on one of ``holders``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [standby_steps(model, peer, model.adapter) for peer in holders]
        if all(any(h.get(b) == model.step for h in held) for b in blocks):
            return
        time.sleep(0.2)
    raise AssertionError(f"no current standby copy of blocks {blocks} at step {model.step}: {held}")


def moved_to(*peers: Process, span: str, timeout: float = 30) -> list[Process]:
    """The peers that finished moving to ``span`` (a move completes a grace period after it is announced)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        movers = [p for p in peers if f"now serving blocks {span}" in p.log.read_text()]
        if movers:
            return movers
        time.sleep(0.2)
    return []


def test_only_server_of_a_span_killed_is_taken_over(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        spans = (("a1", "0:2"), ("a2", "0:2"), ("c", "2:4"))
        peers = {name: local.start_peer(model_dir, blocks, name=name, extra=FAST, wait=False) for name, blocks in spans}
        for peer in peers.values():
            peer.wait_for_line("serving blocks", 180)
        model = connect(local, model_dir, adapter="takeover", patience=120)
        try:
            model.save_adapter(tmp_path / "initial")
            train(model, steps=2)
            wait_standby_current(model, [peers["a1"], peers["a2"]], [2, 3])
            peers["c"].signal(signal.SIGKILL)
            train(model, steps=STEPS)
            assert model.steps_lost == []
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
        assert len(moved_to(peers["a1"], peers["a2"], span="2:4")) == 1, "one replica of 0:2 should have moved"
    reference = reference_adapter(model_dir, tmp_path / "initial", tmp_path / "reference")
    assert_same_adapter(tmp_path / "final", reference)
