"""One identity, one process (issue 24): a second peer process started with an identity already serving, at the same
moment or later, on this machine or from a copy of the identity file elsewhere, exits with one clear line naming the
identity and where the other process serves; the running one serves on."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from failover_helpers import connect, train

from swarm.testing.localswarm import LocalSwarm, Process

EXIT_USAGE = 2  # what `swarm` exits with on an error the user can fix


def refused(peer: Process, timeout: float = 120.0) -> str:
    """The one line the refused process printed, once it exited (with the user-error code)."""
    assert peer.popen.wait(timeout) == EXIT_USAGE, peer.tail()
    lines = [line for line in peer.log.read_text().splitlines() if "already in use" in line]
    assert len(lines) == 1, peer.tail()
    return lines[0]


@pytest.mark.slow
def test_two_processes_with_one_identity_never_both_serve_and_the_first_serves_on(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    identity, checkpoints = tmp_path / "peer.key", tmp_path / "checkpoints"
    extra = ["--identity", str(identity), "--checkpoint-dir", str(checkpoints)]
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        local.start_peer(model_dir, "0:4", name="warm-up", extra=["--identity", str(tmp_path / "warm.key")])
        # Started together, as a service manager restarting a unit twice would: exactly one of them serves.
        twins = [local.start_peer(model_dir, "0:4", name=f"twin{i}", extra=extra, wait=False) for i in range(2)]
        deadline = time.monotonic() + 120
        while all(twin.popen.poll() is None for twin in twins) and time.monotonic() < deadline:
            time.sleep(0.2)
        loser = next((twin for twin in twins if twin.popen.poll() is not None), None)
        assert loser is not None, "both processes with one identity kept running"
        winner = twins[1 - twins.index(loser)]
        line = refused(loser)
        assert "identity " in line and f"process {winner.pid}" in line, line
        winner.wait_for_line("serving blocks", 120)

        # Later, from a copy of the identity file (another machine): hivemind finds the live peer id in the swarm,
        # and the error names the blocks and addresses it serves from its records.
        copied = tmp_path / "elsewhere" / "peer.key"
        copied.parent.mkdir()
        shutil.copy(identity, copied)
        elsewhere = ["--identity", str(copied), "--checkpoint-dir", str(tmp_path / "elsewhere" / "checkpoints")]
        late = local.start_peer(model_dir, "0:4", name="late", extra=elsewhere, wait=False)
        line = refused(late)
        assert winner.peer_id in line and "serving blocks 0:4" in line and "/ip4/127.0.0.1/" in line, line

        assert winner.popen.poll() is None, winner.tail()
        model = connect(local, model_dir, adapter="one-identity")
        try:
            train(model, steps=1)  # both servers of 0:4 still answer: neither refusal disturbed the winner
        finally:
            model.shutdown()


def test_a_client_without_an_identity_file_leaves_no_key_behind(tmp_path):
    """Each client (and peer) started without --identity gets a fresh key in a temporary folder: it goes when the
    process exits, or every run left one in the temporary directory."""
    code = "from swarm.net.security import Identity; print(Identity.load_or_create(None).path)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    key = Path(out.stdout.strip().splitlines()[-1])
    assert key.name == "identity.key" and not key.parent.exists()
