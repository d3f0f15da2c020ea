"""Promise 7 and part of 6 on real peers in this process: closed private swarms (calls, DHT reads and writes
refused without the key, a wrong key told apart), records nobody can forge or overwrite, and a dishonest peer caught
by spot checks while training ends equal to local peft."""

from __future__ import annotations

import peft
import pytest
import torch
from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.utils import get_dht_time

import swarm
from swarm.net.errors import RemoteError, SwarmAccessError
from swarm.net.network import join_dht
from swarm.net.records import ServerRecord, ServerState, announce, read_servers, servers_key
from swarm.net.security import Identity, SwarmKey, keygen
from swarm.net.transport import Transport
from swarm.net.wire import Message
from swarm.testing.dishonest import CorruptBackwardGrads, CorruptForwards
from swarm.testing.inprocess import InProcessSwarm
from swarm.testing.recipe import assert_matches_local_peft, connect, train

LORA = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _observer(local: InProcessSwarm, key: SwarmKey | None = None) -> DHT:
    return join_dht(local.initial_peers, Identity.load_or_create(None), key, client_mode=True)


def test_records_of_another_identity_cannot_be_forged_or_overwritten(inprocess_swarm):
    local = inprocess_swarm()
    victim_id = local.add_peer("0:2", "victim").peer_id
    honest = _observer(local)
    # The attacker speaks plain hivemind (no validators), so it can try to write anything anywhere.
    attacker = DHT(initial_peers=local.initial_peers, client_mode=True, start=True)
    attacker_identity = Identity.load_or_create(None)
    try:
        (record,) = read_servers(honest, "tiny-llama", 4)[0]
        assert record.peer_id == victim_id and record.state == ServerState.ONLINE
        owner = next(iter(honest.get(servers_key("tiny-llama"), latest=True).value))  # public: it's the subkey
        entry = {"state": "leaving", "start": 0, "end": 4, "throughput": 1e9, "adapters": {}, "blocks": [0, 4]}
        forged = {"kind": "servers", "entries": [entry]}
        expiration = get_dht_time() + 60
        # 1. overwrite the victim's subkey without its signature; 2. sign with another key under its subkey
        assert not attacker.store(servers_key("tiny-llama"), forged, expiration, subkey=owner)
        signed_elsewhere = join_dht(local.initial_peers, attacker_identity, None, client_mode=True)
        try:
            assert not signed_elsewhere.store(servers_key("tiny-llama"), forged, expiration, subkey=owner)
            # 3. its own record is accepted, but it is bound to its own identity, not the victim's
            announce(
                signed_elsewhere,
                "tiny-llama",
                attacker_identity.owner,
                [(ServerRecord(victim_id, ServerState.ONLINE, 0, 4, 1.0), range(0, 1))],
            )
        finally:
            signed_elsewhere.shutdown()
        records = {r.peer_id: r for r in read_servers(honest, "tiny-llama", 4)[0]}
        assert records[victim_id].state == ServerState.ONLINE and records[victim_id].end == 2
        assert records[attacker_identity.peer_id].end == 4  # the attacker's claim is its own
    finally:
        attacker.shutdown()
        honest.shutdown()


@pytest.fixture(scope="module")
def private_swarm(tiny_models, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("private")
    key_path = keygen(workdir / "swarm.key")
    with InProcessSwarm(tiny_models["llama"], workdir, swarm_key=str(key_path)) as local:
        peer = local.add_peer("0:4", "member")
        yield local, key_path, peer


def test_a_member_with_the_key_trains(private_swarm, tiny_models):
    local, key_path, _ = private_swarm
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        tiny_models["llama"],
        initial_peers=local.initial_peers,
        adapter="members",
        lora_config=LORA,
        swarm_key=key_path,
    )
    try:
        ids = torch.randint(0, 256, (2, 8))
        model(ids, labels=ids).loss.backward()
        swarm.RemoteOptimizer(model).step()
        assert model.step == 1
    finally:
        model.shutdown()


def test_without_the_key_or_with_a_wrong_one_the_client_is_told_so(private_swarm, tiny_models, tmp_path):
    local, _, _ = private_swarm
    with pytest.raises(SwarmAccessError, match="private swarm: pass its swarm key"):
        swarm.SwarmModelForCausalLM.from_pretrained(
            tiny_models["llama"], initial_peers=local.initial_peers, adapter="outsider", lora_config=LORA
        )
    wrong = keygen(tmp_path / "wrong.key")
    with pytest.raises(SwarmAccessError, match="wrong swarm key"):
        swarm.SwarmModelForCausalLM.from_pretrained(
            tiny_models["llama"],
            initial_peers=local.initial_peers,
            adapter="outsider",
            lora_config=LORA,
            swarm_key=wrong,
        )


def test_an_outsider_can_neither_call_nor_read_nor_write(private_swarm, tmp_path):
    local, key_path, peer = private_swarm
    member = _observer(local, SwarmKey.load(key_path))
    outsider = _observer(local)
    transports: list[Transport] = []
    try:
        # RPC door: refused with a clear error, for no key and for a wrong key alike.
        for key in (None, SwarmKey.load(keygen(tmp_path / "other.key"))):
            transports.append(Transport.for_dht(outsider, key))
            with pytest.raises(RemoteError, match="unauthorized.*swarm key"):
                transports[-1].call(peer.peer_id, Message({"method": "info"}, []), 10)
        # DHT read: the records exist, but an outsider cannot read them.
        assert [len(v) for v in read_servers(member, "tiny-llama", 4).values()] == [1, 1, 1, 1]
        assert not any(read_servers(outsider, "tiny-llama", 4).values())
        # DHT write: an outsider's announcement is not accepted by members.
        intruder = Identity.load_or_create(None)
        outsider_writer = join_dht(local.initial_peers, intruder, None, client_mode=True)
        try:
            announce(
                outsider_writer,
                "tiny-llama",
                intruder.owner,
                [(ServerRecord(intruder.peer_id, ServerState.ONLINE, 0, 4, 1e9), range(0, 4))],
            )
        finally:
            outsider_writer.shutdown()
        seen = {r.peer_id for records in read_servers(member, "tiny-llama", 4).values() for r in records}
        assert seen == {peer.peer_id}
    finally:
        for transport in transports:  # closed here, in order: not by the garbage collector, from no event loop
            RemoteExpertWorker.run_coroutine(transport.shutdown())
        member.shutdown()
        outsider.shutdown()


@pytest.mark.parametrize("corrupt", [CorruptForwards, CorruptBackwardGrads], ids=["activations", "lora-gradients"])
def test_a_peer_computing_wrong_results_is_caught_by_spot_checks_and_training_matches_the_honest_run(
    inprocess_swarm, tiny_models, tmp_path, cpu_load, corrupt
):
    """Wrong activations (outputs), or wrong LoRA gradients accumulated in its backward (reported and handed on
    consistently, so only a recomputation shows them): three replicas of 0:2, every micro-batch checked."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    spans = {"honest-1": "0:2", "honest-2": "0:2", "dishonest": "0:2", "honest-3": "2:4"}
    peers = local.start_peers(spans, behaviours={"dishonest": corrupt()})
    model = connect(local, model_dir, adapter="spot-checked", spot_check=1.0)
    try:
        model.save_adapter(tmp_path / "initial")
        train(model, steps=3)
        assert list(model.dishonest) == [peers["dishonest"].peer_id]
        model.save_adapter(tmp_path / "final")
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=3)
