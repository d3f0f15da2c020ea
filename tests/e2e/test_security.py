"""Promise 7 and part of 6 between real processes: closed private swarms, unforgeable records, a dishonest peer
caught. (Malformed requests: tests/integration/test_servicer.py; sealing: tests/unit/test_net_security.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import peft
import pytest
import torch
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

import swarm
from swarm.net.errors import RemoteError, SwarmAccessError
from swarm.net.network import join_dht
from swarm.net.records import ServerRecord, ServerState, announce, block_key, read_servers
from swarm.net.security import Identity, SwarmKey, keygen
from swarm.net.transport import Transport
from swarm.net.wire import Message
from swarm.testing.localswarm import LocalSwarm

LORA = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _observer(local: LocalSwarm, key: SwarmKey | None = None) -> DHT:
    return join_dht(local.initial_peers, Identity.load_or_create(None), key, client_mode=True)


def test_records_of_another_identity_cannot_be_forged_or_overwritten(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    with LocalSwarm(tmp_path) as local:
        local.start_dht()
        victim = local.start_peer(model_dir, "0:2")
        victim_id = PeerID.from_base58(victim.peer_id)
        honest = _observer(local)
        # The attacker speaks plain hivemind (no validators), so it can try to write anything anywhere.
        attacker = DHT(initial_peers=local.initial_peers, client_mode=True, start=True)
        attacker_identity = Identity.load_or_create(None)
        try:
            (record,) = read_servers(honest, "tiny-llama", 4)[0]
            assert record.peer_id == victim_id and record.state == ServerState.ONLINE
            owner = next(iter(honest.get(block_key("tiny-llama", 0), latest=True).value))  # public: it's the subkey
            forged = {"kind": "server", "state": "leaving", "start": 0, "end": 4, "throughput": 1e9, "adapters": {}}
            expiration = get_dht_time() + 60
            # 1. overwrite the victim's subkey without its signature; 2. sign with another key under its subkey
            assert not attacker.store(block_key("tiny-llama", 0), forged, expiration, subkey=owner)
            signed_elsewhere = join_dht(local.initial_peers, attacker_identity, None, client_mode=True)
            try:
                assert not signed_elsewhere.store(block_key("tiny-llama", 0), forged, expiration, subkey=owner)
                # 3. its own record is accepted, but it is bound to its own identity, not the victim's
                announce(
                    signed_elsewhere,
                    "tiny-llama",
                    attacker_identity.owner,
                    ServerRecord(victim_id, ServerState.ONLINE, 0, 4, 1.0),
                    range(0, 1),
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
    with LocalSwarm(workdir) as local:
        local.start_dht(extra=["--swarm-key", str(key_path)])
        peer = local.start_peer(tiny_models["llama"], "0:4", extra=["--swarm-key", str(key_path)])
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
    try:
        # RPC door: refused with a clear error, for no key and for a wrong key alike.
        for key in (None, SwarmKey.load(keygen(tmp_path / "other.key"))):
            transport = Transport.for_dht(outsider, key)
            with pytest.raises(RemoteError, match="unauthorized.*swarm key"):
                transport.call(PeerID.from_base58(peer.peer_id), Message({"method": "info"}, []), 10)
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
                ServerRecord(intruder.peer_id, ServerState.ONLINE, 0, 4, 1e9),
                range(0, 4),
            )
        finally:
            outsider_writer.shutdown()
        seen = {r.peer_id for records in read_servers(member, "tiny-llama", 4).values() for r in records}
        assert seen == {PeerID.from_base58(peer.peer_id)}
    finally:
        member.shutdown()
        outsider.shutdown()


def test_a_peer_returning_wrong_activations_is_caught_and_training_matches_the_honest_run(tiny_models, tmp_path):
    from failover_helpers import assert_matches_local_peft, connect, train

    model_dir = tiny_models["llama"]
    corrupt_launcher = [sys.executable, str(Path(__file__).with_name("corrupt_peer.py"))]
    with LocalSwarm(tmp_path / "swarm", env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}) as local:
        local.start_dht()
        peers = [
            local.start_peer(model_dir, "0:2", name="honest-1", wait=False),
            local.start_peer(model_dir, "0:2", name="honest-2", wait=False),
            local.start_peer(model_dir, "0:2", name="dishonest", wait=False, launcher=corrupt_launcher),
            local.start_peer(model_dir, "2:4", name="honest-3", wait=False),
        ]
        for peer in peers:
            peer.wait_for_line("serving blocks", 180)
        model = connect(local, model_dir, adapter="spot-checked", spot_check=1.0)
        try:
            model.save_adapter(tmp_path / "initial")
            train(model, steps=3)
            assert [p.to_base58() for p in model.dishonest] == [peers[2].peer_id]
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=3)
