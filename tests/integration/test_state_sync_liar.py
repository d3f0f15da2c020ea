"""Issue 59, item 3: state sync never trusts one peer. A liar that alters its adapter after each step (its activations
and gradients honest) is the first and only server of blocks 2:4 and commits step 0 alone; two honest peers join
after it. They take the span over one step behind it, so they apply its last update to the deterministic init
themselves instead of taking its state (``Replicator.take_state``), find its state is not its own update applied
(``BlockUpdate.reaches``) and name it in their logs. With the liar gone, the adapter the client saves is local
peft's after one step: the liar seeded nobody. (Before: both took the liar's state, and kept its corruption.)

With the liar still there, the client compares the joiners' states with the liar's at the next step's start and bans
it, outvoted, before any micro-batch runs through its altered blocks (swarm/client/joiners.py); so does a client that
connects while the three replicas load."""

from __future__ import annotations

import logging
from pathlib import Path

from hivemind.p2p import PeerID

from swarm import SwarmModelForCausalLM as SwarmModel
from swarm.testing.dishonest import CorruptUpdates
from swarm.testing.inprocess import InProcessSwarm
from swarm.testing.recipe import assert_matches_local_peft, connect, train

REFUSED = "is not its own last update applied"
STEPS = 3


def _a_liar_alone_on_2_4(local: InProcessSwarm, model_dir: Path) -> tuple[InProcessSwarm, PeerID, SwarmModel]:
    """A head on 0:2, a liar alone on 2:4, and a trainer connected to them."""
    local.start_peers({"head": "0:2", "liar": "2:4"}, behaviours={"liar": CorruptUpdates()})
    return local, local.peers["liar"].peer_id, connect(local, model_dir, adapter="poison")


def _two_honest_join(local: InProcessSwarm) -> None:
    for name in ("honest-1", "honest-2"):
        local.add_peer("2:4", name, wait=False)
    for name in ("honest-1", "honest-2"):
        local.peers[name].wait_serving()


def test_replicas_joining_a_liar_one_step_behind_apply_its_update_themselves(
    inprocess_swarm, tiny_models, tmp_path, caplog
):
    model_dir = tiny_models["llama"]
    local, liar, model = _a_liar_alone_on_2_4(inprocess_swarm(), model_dir)
    try:
        model.save_adapter(tmp_path / "initial")
        with caplog.at_level(logging.ERROR, logger="peers.transfer"):
            train(model, steps=1)  # step 0, committed by the liar alone on 2:4
            _two_honest_join(local)
        refusals = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
        assert any(str(liar) in message for message in refusals), refusals
        for name in ("honest-1", "honest-2"):
            assert local.peers[name].adapters.adapter("poison").steps() == {2: 1, 3: 1}
        local.peers["liar"].stop()
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=1)


def test_a_liar_first_and_alone_on_a_span_is_banned_before_the_next_step_runs_through_it(
    inprocess_swarm, tiny_models, tmp_path
):
    """The issue's scenario, in order: the liar commits step 0 alone, two honest replicas join before step 1. At
    step 1's start the client sees them, compares their states with the liar's and bans the liar, outvoted, before
    any micro-batch runs through its altered blocks (before: step 1 ran through them and a vote banned it after)."""
    model_dir = tiny_models["llama"]
    local, liar, model = _a_liar_alone_on_2_4(inprocess_swarm(), model_dir)
    try:
        model.save_adapter(tmp_path / "initial")
        train(model, steps=1)
        _two_honest_join(local)
        train(model, steps=STEPS)
        assert list(model.dishonest) == [liar]
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=STEPS)


def test_a_liar_among_replicas_started_together_is_banned_when_the_client_does_not_wait(
    inprocess_swarm, tiny_models, tmp_path
):
    """The impatient variant: the three replicas of 2:4 start together, the liar first, and the client connects while
    they load and trains at once. Whichever serves first and whenever the others join (the test waits for them only
    after the first step, so that the liar takes part at all), the liar ends banned and the exported adapter is local
    peft's."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    local.add_peer("0:2", "head", wait=False)
    local.add_peer("2:4", "liar", wait=False, behaviour=CorruptUpdates())
    for name in ("honest-1", "honest-2"):
        local.add_peer("2:4", name, wait=False)
    model = connect(local, model_dir, adapter="impatient", patience=120.0)
    try:
        model.save_adapter(tmp_path / "initial")
        train(model, steps=1)
        for peer in local.peers.values():
            peer.wait_serving(120.0)
        train(model, steps=STEPS)
        assert list(model.dishonest) == [local.peers["liar"].peer_id]
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=STEPS)
