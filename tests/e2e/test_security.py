"""Promise 7 and part of 6: closed private swarms, unforgeable records, peers that survive bad input."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

import peft
import psutil
import pytest
import torch
from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

import swarm
from swarm.net import lanes
from swarm.net.errors import RemoteError, SwarmAccessError
from swarm.net.network import join_dht
from swarm.net.records import ServerRecord, ServerState, announce, block_key, read_servers
from swarm.net.security import Identity, SwarmKey, keygen
from swarm.net.transport import Transport
from swarm.net.wire import Message, PeerDoors, decode, encode
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


def test_sealed_values_do_not_contain_the_plaintext():
    key = SwarmKey(os.urandom(32))
    plaintext = MSGPackSerializer.dumps({"kind": "server", "state": "online"})
    sealed = key.encrypt(plaintext, b"k|s")
    assert b"online" not in sealed and key.decrypt(sealed, b"k|s") == plaintext
    assert key.decrypt(sealed, b"k|other") is None and SwarmKey(os.urandom(32)).decrypt(sealed, b"k|s") is None


def _malformed_requests(rng: random.Random, hidden: int) -> list[list[runtime_pb2.ExpertRequest]]:
    """A few hundred bad requests: garbage bytes, wrong shapes/dtypes, NaN/Inf, huge claims, wrong adapter/step."""
    good = {"method": "forward", "adapter": "fuzzed", "start": 0, "end": 2, "step": 0, "has_mask": False}
    infer = {"method": "infer", "adapter": "fuzzed", "session": "s1", "start": 0, "end": 2, "position": 0}
    infer |= {"max_length": 8, "step": 0}
    cases: list[list[runtime_pb2.ExpertRequest]] = []
    for _ in range(80):
        cases.append([runtime_pb2.ExpertRequest(metadata=rng.randbytes(rng.randint(0, 64)))])
        junk_tensor = runtime_pb2.Tensor(
            buffer=rng.randbytes(rng.randint(0, 256)),
            size=[rng.randint(0, 10**9)],
            dtype=rng.choice(["float32", "int64", "nonsense"]),
        )
        cases.append([runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps(good), tensors=[junk_tensor])])
    bad_hidden = [
        torch.randn(2, 3, hidden + 1),
        torch.randn(3, hidden),
        torch.randint(0, 9, (2, 3, hidden)),
        torch.full((2, 3, hidden), float("nan")),
        torch.full((2, 3, hidden), float("inf")),
        torch.randn(1, 70000, hidden // 64),
    ]
    for tensor in bad_hidden:
        cases.extend([encode(Message(good, [tensor]))] * 5)
    wrong_meta = [
        {**good, "adapter": "nobody"},
        {**good, "step": 99},
        {**good, "start": 3, "end": 9},
        {**good, "method": "x"},
        {**good, "step": -1},
        {**good, "adapter": 7},
        {**good, "has_mask": True},
        {"method": "backward", "adapter": "fuzzed", "start": 0, "end": 2, "step": 0, "micro_batch": "x:0:1"},
        {"method": "commit", "adapter": "fuzzed", "step": 0, "ledger": {"0": {"mb": "nobody"}}, "hparams": {}},
        {"method": "commit", "adapter": "fuzzed", "step": 0, "ledger": "nope"},
        {"method": "revert", "adapter": "fuzzed", "step": "nope"},
        {"method": "sync", "adapter": "fuzzed", "start": 0, "end": 2, "source": "not-a-peer"},
        {"method": "grads", "adapter": "fuzzed", "step": 0, "wanted": ["not", "a", "map"]},
        {"method": "replicate", "adapter": "fuzzed", "lora": {}, "seed": 0, "step": 0, "sources": [[0, 10**9, "x"]]},
        {"method": "replicate", "adapter": "fuzzed", "lora": {}, "seed": 0, "step": 0, "sources": "nope"},
        {"method": "replicate", "adapter": "fuzzed", "lora": {}, "seed": 0, "step": 0, "sources": [[0, 2]]},
        {**infer, "session": "../../etc"},
        {**infer, "position": 5},  # a session that was never opened
        {**infer, "max_length": 10**9},  # more keys and values than the peer's limits
        {**infer, "max_length": 2},  # shorter than the tokens sent
        {**infer, "has_mask": True},  # a mask that is not there
        {**infer, "start": 1, "end": 9},
        {**infer, "adapter": "nobody"},
        {"method": "end_session", "session": 7},
    ]
    for meta in wrong_meta:
        cases.extend([encode(Message(meta, [torch.randn(2, 3, hidden)]))] * 10)
    return cases


def _malformed_lanes(rng: random.Random, hidden: int) -> list[list[runtime_pb2.ExpertRequest]]:
    """Lane calls that must be refused: not lanes at all, and the lanes of one message that disagree."""
    cases = [[runtime_pb2.ExpertRequest(uid="x", metadata=rng.randbytes(rng.randint(0, 64)))] for _ in range(20)]
    cases.append([runtime_pb2.ExpertRequest(uid="", metadata=lanes.pack([runtime_pb2.ExpertRequest()], 1)[0].metadata)])
    good = {"method": "forward", "adapter": "fuzzed", "start": 0, "end": 2, "step": 0, "has_mask": False}
    parts = encode(Message(good, [torch.randn(2, 3, hidden)]), chunk_bytes=256)
    first, second = lanes.pack(parts, 2, "twice"), lanes.pack(parts, 3, "twice")
    cases.append([first[0], second[1]])  # one message, two different lane counts
    return cases


def test_a_peer_survives_a_fuzz_of_malformed_requests_and_still_trains(tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    rng = random.Random(0)
    with LocalSwarm(tmp_path) as local:
        local.start_dht()
        peer = local.start_peer(model_dir, "0:4", extra=["--max-payload-mb", "16"])
        peer_id = PeerID.from_base58(peer.peer_id)
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir, initial_peers=local.initial_peers, adapter="fuzzed", lora_config=LORA
        )
        try:
            stub = PeerDoors.get_stub(model.session.transport.p2p, peer_id)
            process = psutil.Process(peer.pid)
            ids = torch.randint(0, 256, (2, 8))
            rss = []
            for _ in range(2):
                refused = 0
                for parts in _malformed_requests(rng, 64):
                    reply = RemoteExpertWorker.run_coroutine(stub.rpc_call(parts[0], timeout=30))
                    meta = decode([reply]).meta
                    assert "error" in meta, f"accepted a malformed request: {parts[0].metadata[:80]!r}"
                    refused += 1
                for parts in _malformed_lanes(rng, 64):  # the lane door: garbage, and lanes that disagree

                    async def send(parts=parts):
                        return await asyncio.wait_for(asyncio.gather(*(stub.rpc_lane(lane) for lane in parts)), 90)

                    replies = RemoteExpertWorker.run_coroutine(send())
                    assert all("error" in decode(lanes.unpack([reply])).meta for reply in replies)
                # Oversized payload on the stream door: refused, not buffered without bound.
                big = Message({"method": "forward"}, [torch.zeros(5, 1024, 1024)])
                with pytest.raises(RemoteError, match="too_large|limit"):
                    model.session.transport.call(peer_id, big, 60)
                assert refused >= 300
                rss.append(process.memory_info().rss)
            assert rss[1] < rss[0] * 1.25, f"peer memory grew from {rss[0] >> 20} to {rss[1] >> 20} MiB"
            losses = []
            optimizer = swarm.RemoteOptimizer(model, lr=1e-2)
            for _ in range(3):
                out = model(ids, labels=ids)
                out.loss.backward()
                optimizer.step()
                losses.append(out.loss.item())
            assert losses[-1] < losses[0] and model.step == 3
            assert peer.popen.poll() is None
        finally:
            model.shutdown()


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
