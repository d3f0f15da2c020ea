"""Promise 5: checkpoints survive a kill in the middle of a write, and a swarm whose every process was killed
resumes from its last committed step."""

from __future__ import annotations

import ast
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from failover_helpers import assert_matches_local_peft, connect, finish_client, start_client, train, wait_for_text

from peers.checkpoints import CheckpointStore
from swarm.testing.localswarm import LocalSwarm

TESTS = Path(__file__).resolve().parent


def loaded_steps(log: str) -> dict[int, int]:
    found = re.search(r"loaded checkpoint of adapter '[^']+': steps (\{.*\})", log)
    assert found, log[-3000:]
    return ast.literal_eval(found.group(1))


def test_a_kill_mid_checkpoint_write_leaves_the_previous_checkpoint(tiny_models, tmp_path):
    model_dir, ckpt = tiny_models["llama"], tmp_path / "ckpt"
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        # One peer with all 4 blocks: each commit writes 4 files; write 6 is the second file of step 2's checkpoint.
        local.env["SWARM_TEST_STALL_WRITE"] = "6"
        stalling = [sys.executable, str(TESTS / "stalling_checkpoint_peer.py")]
        # The same identity after the restart: its new record replaces the old one at once.
        extra = ["--checkpoint-dir", str(ckpt), "--identity", str(tmp_path / "identity.key")]
        peer = local.start_peer(model_dir, "0:4", name="p", extra=extra, launcher=stalling)
        del local.env["SWARM_TEST_STALL_WRITE"]
        model = connect(local, model_dir, adapter="ckpt")
        try:
            train(model, steps=2)
        finally:
            model.shutdown()
        stalled = peer.wait_for_line("checkpoint write stalled", 60).rsplit(": ", 1)[1]
        stalled_block = int(re.search(r"block-(\d+)\.safetensors", stalled).group(1))
        peer.signal(signal.SIGKILL)
        peer.popen.wait(10)
        assert Path(stalled).exists(), "the interrupted write should have left its temp file behind"

        restarted = local.start_peer(model_dir, "0:4", name="p-again", extra=extra)
        log = restarted.log.read_text()
        assert "discarding an interrupted checkpoint write" in log, log[-3000:]
        assert not Path(stalled).exists()
        steps = loaded_steps(log)
        assert steps[stalled_block] == 1, f"block {stalled_block} should be back at its previous checkpoint: {steps}"
        assert sorted(set(steps.values())) == [1, 2], steps
        # Step 2 of the stalled block is gone from the swarm (a swarm of one peer holds one copy): accept the loss.
        model = connect(local, model_dir, adapter="ckpt", resume="latest")
        try:
            assert model.step == 2
            lost = {block for event in model.steps_lost for block in event.blocks}
            assert lost == {b for b, s in steps.items() if s == 1}, model.steps_lost
            assert all(event.steps == 1 for event in model.steps_lost)
            train(model, steps=3)  # and training goes on
        finally:
            model.shutdown()


@pytest.mark.slow
def test_the_whole_swarm_killed_resumes_from_its_last_committed_step(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    dirs = {"p1": tmp_path / "ckpt-p1", "p2": tmp_path / "ckpt-p2"}
    spans = {"p1": "0:2", "p2": "2:4"}

    def start_peers(local: LocalSwarm) -> None:
        local.start_dht()
        for name, blocks in spans.items():
            local.start_peers(model_dir, {name: blocks}, ["--checkpoint-dir", str(dirs[name])])

    with LocalSwarm(tmp_path / "first") as local:
        start_peers(local)
        first = start_client(local, model_dir, tmp_path, "first", "restart", "--hang-in-step", "2")
        try:
            wait_for_text(tmp_path / "first.log", "hanging mid-step", first)
            deadline = time.monotonic() + 120
            for name, blocks in spans.items():  # wait until step 2 is on disk for every served block
                served = range(*map(int, blocks.split(":")))
                while any(CheckpointStore(dirs[name]).steps().get("restart", {}).get(b) != 2 for b in served):
                    assert time.monotonic() < deadline, CheckpointStore(dirs[name]).steps()
                    time.sleep(0.2)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            for process in local.processes:  # everything, bootstrap node included, at once
                process.signal(signal.SIGKILL)

    with LocalSwarm(tmp_path / "second") as local:
        start_peers(local)
        log = finish_client(start_client(local, model_dir, tmp_path, "second", "restart"), tmp_path / "second.log")
        assert "resumed at step 2" in log and "steps lost: []" in log, log[-3000:]
    assert_matches_local_peft(model_dir, tmp_path)
