"""Promises 2-4: peers killed (SIGKILL), frozen (SIGSTOP) or leaving (SIGTERM) mid-step cost a retry, not the run.

Each case trains the same recipe on a swarm with two replicas of every block, injects one fault at step 1, and
checks: no exception reaches the training loop, replicas agree after every step, and the final adapter equals
the failure-free result (local peft from the same initial adapter, which parity tests tie to the swarm).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from failover_helpers import (
    assert_matches_local_peft,
    assert_replicas_identical,
    connect,
    finish_client,
    instrument,
    start_client,
    start_replicated_swarm,
    start_swarm,
    train,
    wait_for_text,
)

from swarm.net.errors import SwarmUnavailableError
from swarm.testing.faults import CallTap
from swarm.testing.localswarm import LocalSwarm

FAULTS = {
    # name: (signal, method the client is about to send when the fault hits, micro-batches all in flight at once)
    "sigkill-forward": (signal.SIGKILL, "forward", False),
    "sigkill-forward-next-hop": (signal.SIGKILL, "forward", False),
    "sigkill-backward": (signal.SIGKILL, "backward", False),
    "sigkill-commit": (signal.SIGKILL, "commit", False),
    "sigstop-forward": (signal.SIGSTOP, "forward", False),
    "sigterm-forward": (signal.SIGTERM, "forward", False),
    "sigkill-backward-pipelined": (signal.SIGKILL, "backward", True),  # model.train_step: others in flight
}
CLIENT_DRIVEN = {"sigkill-backward-client-driven": (signal.SIGKILL, "backward", False)}  # chain=False: hop by hop
NEXT_HOP = {"sigkill-forward-next-hop"}  # the fault hits the chain's second peer, which the first one calls


@pytest.mark.parametrize("fault", sorted(FAULTS) + sorted(CLIENT_DRIVEN))
def test_training_survives_a_replica_failure(fault, tiny_models, tmp_path):
    """Chained (the default), and one case with client-driven hops."""
    sig, method, pipelined = {**FAULTS, **CLIENT_DRIVEN}[fault]
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        peers = start_replicated_swarm(local, model_dir)
        by_id = {p.peer_id: p for p in peers.values()}
        victim: list = []

        def hook(sent_method: str, peer_id: str, step: int) -> None:
            # Hit the replica the client is about to use for `method` at step 1: the request meets the fault.
            if not victim and step == 1 and sent_method == method and peer_id in by_id:
                victim.append(by_id[peer_id])
                by_id[peer_id].signal(sig)

        tap = CallTap()
        model = connect(local, model_dir, adapter=fault, chain=fault not in CLIENT_DRIVEN, call_hook=tap)
        try:
            model.save_adapter(tmp_path / "initial")
            instrument(tap, model, hook, next_hop=fault in NEXT_HOP)
            train(model, steps=2, pipelined=pipelined)
            assert victim, f"the fault was never injected (no {method} at step 1)"
            if sig == signal.SIGSTOP:
                victim[0].signal(signal.SIGCONT)  # thawed: it must re-sync before it serves again
            train(model, pipelined=pipelined)
            if sig == signal.SIGSTOP:
                deadline = time.monotonic() + 60
                while victim[0].peer_id not in {p.to_base58() for d in model.replica_digests().values() for p in d}:
                    assert time.monotonic() < deadline, "the thawed replica never came back in sync"
                    time.sleep(1)
                assert_replicas_identical(model)
                reasons = [r.reason for r in model.recoveries if r.peer.to_base58() == victim[0].peer_id]
                assert any("stopped answering" in r for r in reasons), model.recoveries  # its probes, not a timeout
            else:
                assert victim[0].popen.wait(30) is not None
            assert model.recoveries or sig == signal.SIGTERM, "no recovery was recorded"
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path)


def test_client_raises_a_clear_error_when_every_replica_of_a_block_is_gone(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        local.start_peer(model_dir, "0:2", extra=["--max-blocks", "2"])  # no room to take 2:4 over
        last = local.start_peer(model_dir, "2:4")
        model = connect(local, model_dir, adapter="orphan", patience=5.0)
        try:
            train(model, steps=1, check_replicas=False)
            last.signal(signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(SwarmUnavailableError, match=r"blocks \[2, 3\]"):
                train(model, steps=2, check_replicas=False)
            assert time.monotonic() - started < 60
        finally:
            model.shutdown()


def test_a_killed_client_restarts_and_resumes_at_the_last_committed_step(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path / "swarm") as local:
        start_swarm(local, model_dir, {"a": "0:2", "b": "2:4"})
        first = start_client(local, model_dir, tmp_path, "first", "restarted", "--hang-in-step", "2")
        try:
            wait_for_text(tmp_path / "first.log", "hanging mid-step", first)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        log = finish_client(start_client(local, model_dir, tmp_path, "second", "restarted"), tmp_path / "second.log")
        assert "resumed at step 2" in log, log[-3000:]
    assert_matches_local_peft(model_dir, tmp_path)
