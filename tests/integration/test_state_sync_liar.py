"""Issue 59, item 3: state sync never trusts one peer. A liar that alters its adapter after each step (its activations
and gradients honest) is the first and only server of blocks 2:4 and commits step 0 alone; two honest peers join
after it. They take the span over one step behind it, so they apply its last update to the deterministic init
themselves instead of taking its state (``Replicator.take_state``), find its state is not its own update applied
(``BlockUpdate.reaches``) and name it in their logs. With the liar gone, the adapter the client saves is local
peft's after one step: the liar seeded nobody. (Before: both took the liar's state, and kept its corruption.)

What this does not cover yet: the client does not learn of the divergence before the next step, so a step whose
micro-batches ran through the liar's altered blocks before a vote banned it trains on its altered LoRA."""

from __future__ import annotations

import logging

from swarm.testing.dishonest import CorruptUpdates
from swarm.testing.recipe import assert_matches_local_peft, connect, train

REFUSED = "is not its own last update applied"


def test_replicas_joining_a_liar_one_step_behind_apply_its_update_themselves(
    inprocess_swarm, tiny_models, tmp_path, caplog
):
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    local.start_peers({"head": "0:2", "liar": "2:4"}, behaviours={"liar": CorruptUpdates()})
    liar = local.peers["liar"].peer_id
    model = connect(local, model_dir, adapter="poison")
    try:
        model.save_adapter(tmp_path / "initial")
        with caplog.at_level(logging.ERROR, logger="peers.adapters"):
            train(model, steps=1)  # step 0, committed by the liar alone on 2:4
            for name in ("honest-1", "honest-2"):
                local.add_peer("2:4", name, wait=False)
            for name in ("honest-1", "honest-2"):
                local.peers[name].wait_serving()
        refusals = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
        assert any(str(liar) in message for message in refusals), refusals
        for name in ("honest-1", "honest-2"):
            assert local.peers[name].adapters.adapter("poison").steps() == {2: 1, 3: 1}
        local.peers["liar"].stop()
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=1)
