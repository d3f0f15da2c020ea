"""Issue 25's crowded start, as a newcomer runs it: six peers started together without ``--blocks`` settle their
spans (moving while the client connects), and the client saves the adapter right after ``from_pretrained`` and
trains. The adapter is open only once every block has a serving holder, and every block is found where it is served
now, not where its peer served a moment ago."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from swarm.net.records import ServerState
from swarm.testing.recipe import assert_matches_local_peft, connect, train
from swarm.testing.tiny import make_tiny_model

PEERS, SPAN, LAYERS = 6, 3, 8  # as scripts/bench_churn.py starts them: 18 block copies over 8 blocks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_six_peers_started_at_once_then_save_right_after_from_pretrained(inprocess_swarm, tmp_path, seed):
    model_dir = make_tiny_model(tmp_path / "model", layers=LAYERS, seed=1)
    local = inprocess_swarm(model=model_dir, rebalance=True, balance_interval=1.0, num_blocks=SPAN)
    peers = [local.add_peer(None, f"p{i}", wait=False) for i in range(PEERS)]
    assert not all(peer.daemon.state is ServerState.ONLINE for peer in peers)
    model = connect(local, model_dir, f"crowd-{seed}", patience=90.0)
    try:
        model.save_adapter(tmp_path / "initial")
        saved = load_file(tmp_path / "initial" / "adapter_model.safetensors")
        blocks = {int(key.split(".layers.")[1].split(".")[0]) for key in saved}
        assert blocks == set(range(LAYERS)), f"the saved adapter lacks blocks {set(range(LAYERS)) - blocks}"
        train(model, steps=2)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=2)
