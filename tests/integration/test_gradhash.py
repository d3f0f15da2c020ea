"""Part of promise 10 on real peers in this process: gradients cannot be swapped after the fact. A holder that hands
other replicas other gradients than those it reported with its backward is caught at commit, and so is a replica
that falsely accuses an honest holder; either is named in ``model.dishonest`` and the adapter equals local peft.
(Wrong LoRA gradients computed in a backward are caught by spot checks: tests/integration/test_security.py.) Under
two busy processes (``cpu_load``)."""

from __future__ import annotations

import time

from hivemind.p2p import PeerID

import swarm
from swarm.testing.dishonest import CorruptPartialSums, CorruptServedGrads, FrameHolders
from swarm.testing.recipe import (
    HPARAMS,
    MAX_GRAD_NORM,
    MICRO_BATCHES,
    assert_matches_local_peft,
    batches_for_step,
    connect,
    train,
)


def _wait_seen(model: swarm.SwarmModelForCausalLM, peer: PeerID, timeout: float = 30.0) -> None:
    """Until the client's view holds ``peer`` (so that the next commit asks it)."""
    router, deadline = model.session.calls.router, time.monotonic() + timeout
    while peer not in router.live_servers(eligible_only=False):
        assert time.monotonic() < deadline, f"the client did not see {peer} in {timeout:.0f}s"
        time.sleep(0.2)
        router.refresh()


def _accumulate(model: swarm.SwarmModelForCausalLM) -> None:
    """The backwards of the recipe's micro-batches of the model's step (as ``train`` runs them)."""
    for batch in batches_for_step(model.step):
        (model(**batch).loss / MICRO_BATCHES).backward()


def test_a_holder_handing_on_other_gradients_than_it_reported_is_caught_at_commit(
    inprocess_swarm, tiny_models, tmp_path, cpu_load
):
    """The dishonest peer is the only server of blocks 0:2 while step 0's backwards run, so it holds all of their
    gradients; an honest replica joins before the commit and fetches them from it: the hashes do not match."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    peers = local.start_peers({"dishonest": "0:2", "honest-2": "2:4"}, behaviours={"dishonest": CorruptServedGrads()})
    model = connect(local, model_dir, adapter="hashed")
    try:
        model.save_adapter(tmp_path / "initial")
        _accumulate(model)
        joined = local.start_peers({"honest-1": "0:2"})["honest-1"].peer_id
        _wait_seen(model, joined)
        model.clip_grad_norm_(MAX_GRAD_NORM)
        swarm.RemoteOptimizer(model, **HPARAMS).step()
        assert model.step == 1
        assert list(model.dishonest) == [peers["dishonest"].peer_id]
        train(model, steps=3)
        assert list(model.dishonest) == [peers["dishonest"].peer_id]
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=3)


def test_a_holder_handing_on_a_partial_sum_other_than_its_gradients_sum_is_caught_before_the_vote(
    inprocess_swarm, tiny_models, tmp_path, cpu_load
):
    """The dishonest peer holds all of step 0's gradients of blocks 0:2 and hands the two replicas that join before
    the commit a perturbed partial sum (its micro-batch gradients, and what it applies, are honest). Both apply the
    same wrong sum, so a vote would outvote the liar and keep the poisoned step; instead the disagreement sends the
    step round again with every partial sum audited, the liar is named, its micro-batches are replayed, and the
    adapter equals local peft."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    peers = local.start_peers({"dishonest": "0:2", "tail": "2:4"}, behaviours={"dishonest": CorruptPartialSums()})
    model = connect(local, model_dir, adapter="summed")
    try:
        model.save_adapter(tmp_path / "initial")
        _accumulate(model)
        joined = local.start_peers({"honest-1": "0:2", "honest-2": "0:2"})
        for peer in joined.values():
            _wait_seen(model, peer.peer_id)
        model.clip_grad_norm_(MAX_GRAD_NORM)
        swarm.RemoteOptimizer(model, **HPARAMS).step()
        assert model.step == 1
        assert list(model.dishonest) == [peers["dishonest"].peer_id]
        train(model, steps=3)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=3)


def test_a_replica_accusing_an_honest_holder_is_itself_caught(inprocess_swarm, tiny_models, tmp_path, cpu_load):
    """The honest peer holds all of step 0's gradients of blocks 0:2; a replica that joins before the commit claims
    they do not match their hashes. The client fetches them from the holder itself: they do, so the accuser is the
    one banned, and the holder trains on."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    peers = local.start_peers({"holder": "0:2", "honest-2": "2:4"})
    model = connect(local, model_dir, adapter="framed")
    try:
        model.save_adapter(tmp_path / "initial")
        _accumulate(model)
        accuser = local.start_peers({"accuser": "0:2"}, behaviours={"accuser": FrameHolders()})["accuser"]
        _wait_seen(model, accuser.peer_id)
        model.clip_grad_norm_(MAX_GRAD_NORM)
        swarm.RemoteOptimizer(model, **HPARAMS).step()
        assert model.step == 1
        assert list(model.dishonest) == [accuser.peer_id]
        assert peers["holder"].peer_id in model.session.calls.router.live_servers()
        train(model, steps=3)
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=3)
