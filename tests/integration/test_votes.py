"""Promise 10 at the commit, on real peers in this process: replicas vote with their state digests; a replica that
corrupts its update is outvoted by two that agree (or by a standby copy holder breaking a two-replica tie), named in
``model.dishonest`` and never used again, and training ends equal to local peft; two that disagree with nobody to
break the tie stop the step with an error naming both, the step taken back on both."""

from __future__ import annotations

import pytest

import swarm
from swarm.ops.status import status
from swarm.testing.dishonest import CorruptUpdates
from swarm.testing.recipe import HPARAMS, assert_matches_local_peft, batches_for_step, connect, train

STEPS = 3


def _train_and_export(model, tmp_path, liar) -> None:
    model.save_adapter(tmp_path / "initial")
    train(model, steps=1)
    assert list(model.dishonest) == [liar], "caught at the first step it corrupts"
    train(model, steps=STEPS)
    assert list(model.dishonest) == [liar]
    model.save_adapter(tmp_path / "final")


def test_a_replica_corrupting_its_update_is_outvoted_by_two(inprocess_swarm, tiny_models, tmp_path, cpu_load):
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    spans = {"honest-1": "0:2", "honest-2": "0:2", "liar": "0:2", "honest-3": "2:4"}
    peers = local.start_peers(spans, behaviours={"liar": CorruptUpdates()})
    model = connect(local, model_dir, adapter="outvoted")
    try:
        _train_and_export(model, tmp_path, peers["liar"].peer_id)
        shown = status(local.initial_peers, None, None, replication=2)
        assert f"DISHONEST peer {peers['liar'].peer_id.to_base58()} (adapter outvoted" in shown, shown
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=STEPS)


def test_two_replicas_that_disagree_are_judged_by_a_standby_copy(inprocess_swarm, tiny_models, tmp_path, cpu_load):
    """Blocks 0:2 have two replicas; min_copies=3 has the third peer keep a copy of them, which breaks the tie."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    peers = local.start_peers({"honest": "0:2", "liar": "0:2", "keeper": "2:4"}, behaviours={"liar": CorruptUpdates()})
    model = connect(local, model_dir, adapter="tie-broken", min_copies=3)
    try:
        _train_and_export(model, tmp_path, peers["liar"].peer_id)
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=STEPS)


def test_two_replicas_that_disagree_with_nobody_to_break_the_tie_stop_the_step(inprocess_swarm, tiny_models, cpu_load):
    local = inprocess_swarm(standby_blocks=0)  # no copies of 0:2 anywhere but its two replicas
    peers = local.start_peers({"honest": "0:2", "liar": "0:2", "other": "2:4"}, behaviours={"liar": CorruptUpdates()})
    model = connect(local, tiny_models["llama"], adapter="undecided")
    try:
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        for batch in batches_for_step(0):
            model(**batch).loss.backward()
        with pytest.raises(swarm.ReplicasDisagreeError) as caught:
            optimizer.step()
        message = str(caught.value)
        assert "block 0" in message and "Add a peer" in message
        for name in ("honest", "liar"):
            assert peers[name].peer_id.to_base58() in message
        assert model.step == 0 and list(model.dishonest) == []
        for name in ("honest", "liar"):  # taken back on both: the swarm is where it was before the step
            assert set(peers[name].adapters.adapter("undecided").steps().values()) == {0}
        digests = model.replica_digests()
        assert all(len(set(by_peer.values())) == 1 for by_peer in digests.values()), digests
        # The user stops the peer they do not trust; the same step then commits on the other.
        peers["liar"].stop()
        optimizer.step()
        assert model.step == 1
    finally:
        model.shutdown()
