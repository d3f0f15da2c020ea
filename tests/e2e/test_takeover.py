"""Promises 3-4 beyond replicas: blocks whose every server died are taken over by peers holding standby copies of
their adapter state; peers joining fill uncovered or under-replicated spans; training never restarts."""

from __future__ import annotations

import signal
import time

from failover_helpers import (
    STEPS,
    assert_matches_local_peft,
    connect,
    instrument,
    moved_to,
    start_swarm,
    status_groups,
    swarm_status,
    train,
)
from hivemind.p2p import PeerID

from swarm.net.wire import Message
from swarm.testing.faults import CallTap
from swarm.testing.localswarm import LocalSwarm, Process

FAST = ["--balance-interval", "1"]


def standby_steps(model, peer: Process, adapter: str) -> dict[int, int]:
    reply = model.session.transport.call(PeerID.from_base58(peer.peer_id), Message({"method": "info"}, []), 10)
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


def test_only_server_of_a_span_killed_is_taken_over(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        peers = start_swarm(local, model_dir, {"a1": "0:2", "a2": "0:2", "c": "2:4"}, FAST)
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
    assert_matches_local_peft(model_dir, tmp_path)


def test_two_peers_killed_at_once_including_every_replica_of_a_span(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        peers = start_swarm(local, model_dir, {"a1": "0:2", "a2": "0:2", "b1": "2:4", "b2": "2:4"}, FAST)
        tap = CallTap()
        model = connect(local, model_dir, adapter="double-kill", patience=120, call_hook=tap)
        try:
            model.save_adapter(tmp_path / "initial")
            train(model, steps=1)
            wait_standby_current(model, [peers["a1"], peers["a2"]], [2, 3])
            victims = [peers["b1"], peers["b2"]]

            def hook(method: str, peer_id: str, step: int) -> None:
                if victims and method == "backward" and step == 1:  # mid-step: their gradients die with them
                    for victim in victims:
                        victim.signal(signal.SIGKILL)
                    victims.clear()

            instrument(tap, model, hook)
            train(model, steps=STEPS)
            assert not victims, "the fault was never injected"
            assert model.steps_lost == []
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
        assert len(moved_to(peers["a1"], peers["a2"], span="2:4")) == 1
    assert_matches_local_peft(model_dir, tmp_path)


def test_joining_peers_fill_uncovered_then_under_replicated_blocks(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    pinned = [*FAST, "--no-rebalance"]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        for name in ("a1", "a2"):
            local.start_peer(model_dir, "0:2", name=name, extra=pinned, wait=False)
        # Two peers with room for one block each start at the same moment: they must not pick the same block.
        joiners = [
            local.start_peer(model_dir, None, name=n, extra=[*FAST, "--num-blocks", "1"], wait=False)
            for n in ("d", "e")
        ]
        chosen = sorted(p.wait_for_line("serving blocks", 180).split("serving blocks ")[1].split()[0] for p in joiners)
        assert chosen == ["2:3", "3:4"], chosen
        model = connect(local, model_dir, adapter="joiners", patience=120)
        try:
            model.save_adapter(tmp_path / "initial")
            train(model, steps=2)
            # Every block is covered; 2 and 3 have one server each: a peer with room for two fills 2:4.
            late = local.start_peer(model_dir, None, name="f", extra=[*FAST, "--num-blocks", "2"])
            assert "serving blocks 2:4" in late.wait_for_line("serving blocks", 1)
            late_id = PeerID.from_base58(late.peer_id)
            train(model, steps=3, check_replicas=False)  # the step during which it announced itself
            train(model, steps=4, check_replicas=False)
            assert model.session.current.get(late_id) == model.step, "a joined peer is current within one step"
            digests = model.replica_digests()
            assert all(late_id in digests[b] for b in (2, 3)), "the new peer is not used"
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
        status = swarm_status(local)
        groups = status_groups(status)
        assert all(groups[b].split()[1] == "2" for b in range(4)), status
        assert "UNCOVERED" not in status
    assert_matches_local_peft(model_dir, tmp_path)
