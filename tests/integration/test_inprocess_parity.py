"""Promise 1 on real peers in this process: training through two peers (blocks 0:2 and 2:4) equals local peft on
the same data, seed, LoRA config and AdamW; also for a client that connects while the peers are still starting."""

from __future__ import annotations

from swarm.net.records import ServerState
from swarm.testing.recipe import assert_matches_local_peft, connect, train


def test_training_through_two_in_process_peers_equals_local_peft(inprocess_swarm, tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    swarm = inprocess_swarm()
    swarm.start_peers({"a": "0:2", "b": "2:4"})
    model = connect(swarm, model_dir, "parity", patience=30.0)
    try:
        model.save_adapter(tmp_path / "initial")
        losses = train(model)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert losses[-1] < losses[0], "the loss did not fall"
    assert_matches_local_peft(model_dir, tmp_path)


def test_a_client_that_connects_while_peers_start_waits_for_them_and_trains_equal(
    inprocess_swarm, tiny_models, tmp_path
):
    """Impatient: the client joins as soon as the bootstrap node is up; it waits (within its patience) for every
    block to have a server and trains as if they had been there all along."""
    model_dir = tiny_models["llama"]
    swarm = inprocess_swarm()
    peers = [swarm.add_peer("0:2", "a", wait=False), swarm.add_peer("2:4", "b", wait=False)]
    assert not any(peer.daemon.state is ServerState.ONLINE for peer in peers)
    model = connect(swarm, model_dir, "impatient", patience=60.0)
    try:
        assert all(peer.daemon.state is ServerState.ONLINE for peer in peers)
        model.save_adapter(tmp_path / "initial")
        train(model, steps=2)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=2)
