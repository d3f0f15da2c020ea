"""Promise 3 from the first step, tried the way a newcomer runs it: the client connects while the peers still load,
steps take a fraction of a second, and peers die in the first seconds. An acknowledged step (``opt.step()``
returned) is held by two peers, so it survives any single failure; the committed step lives in the DHT, so a
client restarted against a long-lived bootstrap node finds it.

Peers here announce records that live 300 s: a step that waited for a dead peer's record to expire would take
minutes, so each failure step is checked to take well under that.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from failover_helpers import (
    STEPS,
    assert_matches_local_peft,
    connect,
    finish_client,
    instrument,
    moved_to,
    start_client,
    status_groups,
    swarm_status,
    train,
    wait_for_text,
)

from peers.checkpoints import CheckpointStore
from swarm.net.errors import AdapterStateLostError, SwarmUnavailableError
from swarm.testing.faults import CallTap
from swarm.testing.localswarm import LocalSwarm, Process

EXTRA = ["--balance-interval", "1", "--record-ttl", "300"]
RECORD_EXPIRY = 300.0


def start_impatiently(local: LocalSwarm, model_dir, spans: dict[str, str], extra: list[str]) -> dict[str, Process]:
    """The bootstrap node, then the peers without waiting for them: the caller connects a client at once."""
    local.start_dht()
    return {
        name: local.start_peer(model_dir, blocks, name=name, extra=extra, wait=False) for name, blocks in spans.items()
    }


# (when the only server of blocks 2:4 is SIGKILLed, at which step)
KILLS = {
    "after-step-1": ("after", 1),
    "mid-backward-of-step-2": ("backward", 2),
    "after-step-3": ("after", 3),
}


@pytest.mark.parametrize("case", list(KILLS))
def test_the_only_server_of_a_span_killed_in_the_first_steps_loses_nothing(case, tiny_models, tmp_path):
    when, at_step = KILLS[case]
    steps = max(STEPS, at_step + 2)
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        peers = start_impatiently(local, model_dir, {"a1": "0:2", "a2": "0:2", "c": "2:4"}, EXTRA)
        tap = CallTap()
        model = connect(local, model_dir, adapter=f"first-steps-{case}", patience=120, call_hook=tap)
        killed_at: list[float] = []

        def kill(*_) -> None:
            if not killed_at:
                peers["c"].signal(signal.SIGKILL)
                killed_at.append(time.monotonic())

        try:
            model.save_adapter(tmp_path / "initial")
            if when == "backward":
                instrument(
                    tap, model, lambda method, peer, step: kill() if method == "backward" and step == at_step else None
                )
                train(model, steps=at_step + 1)
            else:
                train(model, steps=at_step)
                assert all(count >= 2 for count in model.copies.values()), model.copies
                kill()
                train(model, steps=at_step + 1)
            assert killed_at, "the fault was never injected"
            assert time.monotonic() - killed_at[0] < RECORD_EXPIRY / 5, "the step after the kill waited for a record"
            train(model, steps=steps)
            assert model.steps_lost == []
            assert all(count >= 2 for count in model.copies.values()), model.copies
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
        assert len(moved_to(peers["a1"], peers["a2"], span="2:4")) == 1, "one replica of 0:2 should have moved"
    assert_matches_local_peft(model_dir, tmp_path, steps=steps)


def test_a_replica_killed_right_after_a_step_is_acknowledged(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        spans = {"a1": "0:2", "a2": "0:2", "b1": "2:4", "b2": "2:4"}
        peers = start_impatiently(local, model_dir, spans, EXTRA)
        model = connect(local, model_dir, adapter="replica-after-ack", patience=120)
        try:
            model.save_adapter(tmp_path / "initial")
            train(model, steps=1)
            killed = time.monotonic()
            peers["b1"].signal(signal.SIGKILL)
            train(model, steps=2)
            assert time.monotonic() - killed < RECORD_EXPIRY / 5
            train(model, steps=STEPS)
            assert model.steps_lost == []
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
        status = swarm_status(local)
        groups = status_groups(status)
        assert sorted(groups) == [0, 1, 2, 3], status
        assert all("copies: replica-after-ack@4:" in groups[b] for b in range(4)), status
        assert "one failure would lose it" not in status and "no live copy" not in status, status
    assert_matches_local_peft(model_dir, tmp_path)


def test_whole_swarm_restart_behind_a_long_lived_bootstrap_resumes_at_the_committed_step(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    dirs = {"p1": tmp_path / "ckpt-p1", "p2": tmp_path / "ckpt-p2"}
    spans = {"p1": "0:2", "p2": "2:4"}

    def start_peers(local: LocalSwarm, suffix: str) -> dict[str, Process]:
        return {
            name: local.start_peer(
                model_dir, blocks, name=name + suffix, extra=[*EXTRA, "--checkpoint-dir", str(dirs[name])], wait=False
            )
            for name, blocks in spans.items()
        }

    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        first_peers = start_peers(local, "")
        first = start_client(local, model_dir, tmp_path, "first", "restart", "--hang-in-step", "3")
        try:
            wait_for_text(tmp_path / "first.log", "hanging mid-step", first)
            deadline = time.monotonic() + 120
            for name in spans:  # step 3 on disk for every block (served and standby) on both peers
                while any(CheckpointStore(dirs[name]).steps().get("restart", {}).get(b) != 3 for b in range(4)):
                    assert time.monotonic() < deadline, CheckpointStore(dirs[name]).steps()
                    time.sleep(0.2)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            for peer in first_peers.values():  # every peer at once; the bootstrap node lives on
                peer.signal(signal.SIGKILL)
        start_peers(local, "-again")  # fresh identities; the old records still name the dead peers
        started = time.monotonic()
        log = finish_client(start_client(local, model_dir, tmp_path, "second", "restart"), tmp_path / "second.log")
        assert "resumed at step 3" in log and "steps lost: []" in log, log[-3000:]
        assert time.monotonic() - started < RECORD_EXPIRY / 2, "the restarted client waited for stale records"
    assert_matches_local_peft(model_dir, tmp_path)


def test_failed_connect_releases_everything_and_a_lost_committed_step_is_an_error(tiny_models, tmp_path, caplog):
    model_dir = tiny_models["llama"]
    caplog.set_level(logging.INFO)
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        with pytest.raises(SwarmUnavailableError, match=r"blocks \[0, 1, 2, 3\]"):
            connect(local, model_dir, adapter="lonely", patience=3)  # no peer yet
        assert not [t for t in threading.enumerate() if t.name in ("swarm-lease", "swarm-router")]

        peer = local.start_peer(model_dir, "0:4", name="p", extra=EXTRA)  # a swarm of one: a single copy per block
        model = connect(local, model_dir, adapter="lonely", patience=60)  # a retry in the same process works
        try:
            train(model, steps=2, check_replicas=False)
            assert model.copies == {0: 1, 1: 1, 2: 1, 3: 1}
        finally:
            model.shutdown()
        short = [r for r in caplog.records if "fewer than min_copies=2" in r.getMessage()]
        assert len(short) == 1, "the shortfall is warned about once"
        assert "start more peers" in short[0].getMessage()
        assert not [r for r in caplog.records if "could not renew the adapter lease" in r.getMessage()]

        peer.signal(signal.SIGKILL)  # the only holder of step 2 dies; a fresh peer knows nothing of the adapter
        local.start_peer(model_dir, "0:4", name="q", extra=EXTRA)
        with pytest.raises(AdapterStateLostError, match=r'step 2.*blocks \[0, 1, 2, 3\].*resume="latest"'):
            connect(local, model_dir, adapter="lonely", patience=5)
        with connect(local, model_dir, adapter="lonely", patience=60, resume="latest") as model:  # shuts down on exit
            assert model.step == 2
            assert sorted(b for event in model.steps_lost for b in event.blocks) == [0, 1, 2, 3]
            assert all(event.steps == 2 for event in model.steps_lost)
            train(model, steps=3, check_replicas=False)
        assert not [t for t in threading.enumerate() if t.name in ("swarm-lease", "swarm-router")]
