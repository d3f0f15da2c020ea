"""Unit tests of the pure logic: wire format, ledger, routing, LoRA init, per-block loading."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace

import peft
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

import swarm
from swarm.blocks import add_lora, load_block, lora_config_from_wire, lora_config_to_wire
from swarm.client.copies import CopyKeeper
from swarm.client.ledger import Segment, StepLedger
from swarm.client.routing import NoRouteError, PeerHealth, Router, RouterOptions
from swarm.net.errors import AdapterConfigError, ModelFolderError, RequestError
from swarm.net.protocol import Held, OpenRequest, StepsReply
from swarm.net.records import CommittedRecord, ServerRecord, ServerState, valid_value
from swarm.net.transport import Transport
from swarm.net.wire import Message, WireError, decode, encode
from swarm.spec import load_spec


def test_wire_round_trips_small_and_large_messages():
    small = Message({"method": "forward", "step": 3}, [torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64)])
    parts = encode(small)
    assert len(parts) == 1
    back = decode(parts)
    assert back.meta == small.meta and all(torch.equal(a, b) for a, b in zip(back.tensors, small.tensors, strict=True))
    large = Message({"method": "state"}, [torch.randn(1024, 1024), torch.randn(7)])
    parts = encode(large)
    assert len(parts) > 2
    back = decode(parts)
    assert all(torch.equal(a, b) for a, b in zip(back.tensors, large.tensors, strict=True))


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [runtime_pb2.ExpertRequest(metadata=b"\xc1\xff garbage")],
        [runtime_pb2.ExpertRequest(metadata=b"\x93\x01\x02\x03")],
        [runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=b"xyz", size=[5, 5], dtype="float32")])],
        [runtime_pb2.ExpertRequest(uid="2"), runtime_pb2.ExpertRequest(uid="7")],
    ],
)
def test_wire_rejects_malformed_messages(parts):
    with pytest.raises(WireError):
        decode(parts)


def test_ledger_tracks_holders_and_plans_replays():
    ledger = StepLedger(step=4)
    peer_a, peer_b = PeerID(b"\x00" * 34), PeerID(b"\x01" * 34)
    first, second = ledger.new_micro_batch(), ledger.new_micro_batch()
    assert sorted([second, first]) == [first, second]
    hidden = grad = torch.zeros(1, 2, 3)
    hashes = {block: f"{block:x}" * 64 for block in range(4)}
    ledger.acknowledge(second, range(2, 4), peer_b, hashes)
    ledger.keep(second, Segment(2, 4, hidden, grad), None)
    ledger.acknowledge(second, range(0, 2), peer_a, hashes)
    ledger.keep(second, Segment(0, 2, hidden, grad), None)
    ledger.acknowledge(first, range(0, 4), peer_a, hashes)
    ledger.keep(first, Segment(0, 4, hidden, grad), None)
    a, b = peer_a.to_base58(), peer_b.to_base58()
    assert ledger.wire_holders(range(1, 3)) == {
        1: {second: Held(a, hashes[1]), first: Held(a, hashes[1])},
        2: {second: Held(b, hashes[2]), first: Held(a, hashes[2])},
    }
    assert ledger.held_by(peer_b) == {2: [second], 3: [second]}
    plan = ledger.replay_plan({3: [second]})
    assert [(mb, s.start, s.end) for mb, s in plan] == [(second, 2, 4)]
    assert ledger.next().step == 5 and ledger.next().empty and ledger.discarded().step == 4


def _record(peer: int, start: int, end: int, throughput: float = 1.0, state=ServerState.ONLINE) -> ServerRecord:
    return ServerRecord(PeerID(bytes([peer]) * 34), state, start, end, throughput)


def test_route_covers_all_blocks_with_fewest_hops_and_avoids_banned_or_leaving_peers():
    router = Router(dht=None, transport=Transport(p2p=None), model="m", num_blocks=6)
    records = [
        _record(1, 0, 3),
        _record(2, 0, 6, throughput=0.5),
        _record(3, 3, 6),
        _record(4, 0, 6, state=ServerState.LEAVING),
    ]
    router.servers = {b: [r for r in records if r.start <= b < r.end] for b in range(6)}
    assert [(h.peer_id, h.start, h.end) for h in router.route()] == [(records[1].peer_id, 0, 6)]
    router.ban(records[1].peer_id, 60)
    assert [(h.start, h.end) for h in router.route()] == [(0, 3), (3, 6)]
    router.ban(records[2].peer_id, 60)
    with pytest.raises(NoRouteError, match=r"\[3, 4, 5\]"):
        router.route()


def test_gone_peers_are_skipped_at_once_and_unreachable_ones_waited_for_a_bound():
    transport = Transport(p2p=None)
    router = Router(dht=None, transport=transport, model="m", num_blocks=2, options=RouterOptions(unreachable_wait=5.0))
    dead, frozen, fine = _record(1, 0, 2), _record(2, 0, 2), _record(3, 0, 2)
    router.servers = {b: [dead, frozen, fine] for b in range(2)}
    transport.gone[dead.peer_id] = 100.0  # its connection closed at t=100
    router.ban(frozen.peer_id, "timeout")
    assert router.announced()[0] == [frozen.peer_id, fine.peer_id]  # the frozen one may still hold state
    assert list(router.live_servers(eligible_only=False)) == [fine.peer_id]
    router.health[frozen.peer_id].failing_since -= 6.0  # silent for longer than unreachable_wait
    assert router.announced()[0] == [fine.peer_id]
    transport.learn([replace(dead, announced_at=99.0)])  # an old announcement does not bring it back
    assert transport.is_gone(dead.peer_id)
    transport.learn([replace(dead, announced_at=101.0)])  # announced again after it was gone (restarted)
    assert not transport.is_gone(dead.peer_id) and dead.peer_id in router.live_servers(eligible_only=False)
    router.succeeded(frozen.peer_id, "open", 1.0, 0.01)
    assert frozen.peer_id in router.announced()[0]


def test_copy_plan_spreads_holders_keeps_previous_ones_and_skips_servers():
    keeper = CopyKeeper(calls=None, replicas=None, min_copies=2, lora={}, seed=0)
    a, b, c = (PeerID(bytes([i]) * 34) for i in (1, 2, 3))
    servers = {0: [a], 1: [a], 2: [b], 3: [b, c]}
    confirmed = {block: [] for block in servers}
    plan = keeper._plan(servers, confirmed, [a, b, c])
    assert plan == {b: [0], c: [1], a: [2]}, "block 3 has two servers; each other block gets one more holder"
    keeper.holders = {0: [c], 1: [c]}
    assert keeper._plan(servers, confirmed, [a, b, c]) == {c: [0, 1], a: [2]}
    assert keeper._plan(servers, confirmed, [a]) == {a: [2]}, "a server of a block never holds its standby copy"
    with pytest.raises(ValueError, match="min_copies"):
        CopyKeeper(calls=None, replicas=None, min_copies=0, lora={}, seed=0)


def test_blocks_no_holder_could_copy_died_when_none_of_their_servers_answers():
    """After a step, blocks no holder could copy are checked: only their servers are asked whether they answer,
    and the blocks whose every server is silent died with the step (it is committed again); one answering server
    keeps them."""
    a, b, c = (PeerID(bytes([i]) * 34) for i in (1, 2, 3))
    pinged: list[PeerID] = []

    class Calls:
        def answers(self, peer: PeerID) -> bool:
            pinged.append(peer)
            return peer == c

    keeper = CopyKeeper(calls=Calls(), replicas=None, min_copies=2, lora={}, seed=0)
    try:
        applied = {a: range(0, 2), b: range(2, 3), c: range(3, 4)}
        keeper.unconfirmed = {0, 1, 3}
        assert keeper.died_uncopied(applied) == [0, 1], "block 3 lives on c"
        assert sorted(pinged, key=lambda p: p.to_bytes()) == [a, c], "b's blocks were copied: b is not asked"
        keeper.unconfirmed = set()
        assert keeper.died_uncopied(applied) == []
        assert len(pinged) == 2
    finally:
        keeper.close()


def test_a_durable_ack_counts_no_copy_on_a_peer_banned_when_it_acknowledged():
    """min_copies=2 over a (0:2) and b (0:2), with c and d free to hold copies. b is banned for good: its state is
    not counted, so a holder is asked for each block (c for block 0, d for 1). c is banned as it answers with its
    copy (caught lying meanwhile): its copy is not counted, and d is asked for block 0 too. A peer banned for
    failing that answered a call since counts again."""
    a, b, c, d = (PeerID(bytes([i]) * 34) for i in (1, 2, 3, 4))
    for_good = PeerHealth(banned_until=float("inf"))

    class Swarm:
        num_blocks, health = 2, {b: for_good}

        def live_servers(self, eligible_only: bool = True) -> dict[PeerID, range]:
            return {p: range(0, 2) for p in (a, b, c, d) if p not in self.health}

    class Calls:
        router, adapter, asked = Swarm(), "n", []

        def ask(self, peer: PeerID, request, units: int = 1) -> StepsReply:
            self.asked.append(peer)
            if peer == c:
                self.router.health[c] = for_good
            return StepsReply(steps={block: request.step for source, _ in request.sources for block in source})

    class Replicas:
        def note_standby(self, peer: PeerID, steps: dict[int, int]) -> None:
            pass

    calls = Calls()
    keeper = CopyKeeper(calls=calls, replicas=Replicas(), min_copies=2, lora={}, seed=0)
    try:
        assert keeper.ensure(3, {a: range(0, 2), b: range(0, 2)}) == {0: 2, 1: 2}
        assert calls.asked == [c, d, d], "block 0 to c, block 1 to d; then block 0 to d"
        assert keeper.holders == {0: [d], 1: [d]}
        calls.router.health.clear()
        calls.asked.clear()
        assert keeper.ensure(4, {a: range(0, 2), b: range(0, 2)}) == {0: 2, 1: 2} and calls.asked == []
    finally:
        keeper.close()

    router = Router(dht=None, transport=Transport(p2p=None), model="m", num_blocks=2)
    router.ban(a, "a timeout")
    assert router.health[a].written_off(time.monotonic())
    router.succeeded(a, "commit", 1.0, 0.1)  # it answered since: alive
    assert not router.health[a].written_off(time.monotonic())
    router.distrust(a, "caught")
    router.succeeded(a, "commit", 1.0, 0.1)
    assert router.health[a].written_off(time.monotonic())


def test_committed_records_are_schema_checked():
    record = CommittedRecord(step=3, lora={"r": 4}, seed=11, trainer="me@host")
    assert CommittedRecord.from_value(record.to_value()) == record
    assert valid_value(record.to_value())
    for broken in ({**record.to_value(), "step": -1}, {**record.to_value(), "step": "3"}, {"kind": "committed"}):
        assert CommittedRecord.from_value(broken) is None and not valid_value(broken)


def test_lora_init_is_deterministic_per_seed_and_block(tiny_models):
    spec = load_spec(tiny_models["llama"])
    config = lora_config_from_wire(lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])))

    def init(block: int, seed: int) -> dict[str, torch.Tensor]:
        layer = load_block(spec, block, torch.device("cpu"), torch.float32, "none")
        return {lp.name: lp.param.detach().clone() for lp in add_lora(layer, spec, block, "a", config, seed)}

    first, again = init(1, seed=5), init(1, seed=5)
    assert first.keys() == {"self_attn.q_proj.lora_A.weight", "self_attn.q_proj.lora_B.weight"}
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["self_attn.q_proj.lora_A.weight"], init(2, seed=5)["self_attn.q_proj.lora_A.weight"])
    assert not torch.equal(first["self_attn.q_proj.lora_A.weight"], init(1, seed=6)["self_attn.q_proj.lora_A.weight"])
    assert torch.count_nonzero(first["self_attn.q_proj.lora_B.weight"]) == 0


def test_lora_configs_that_cannot_replay_are_refused():
    with pytest.raises(AdapterConfigError, match="use_dora with lora_dropout"):
        lora_config_to_wire(peft.LoraConfig(r=4, lora_dropout=0.1, use_dora=True, target_modules=["q_proj"]))
    with pytest.raises(AdapterConfigError, match="unknown"):
        lora_config_from_wire({"r": 4, "evil": 1})


def test_adapter_names_that_cannot_name_modules_or_folders_are_refused(tiny_models):
    """A name with a dot once reached peft on the peers (internal error) and the client waited out its patience."""
    assert OpenRequest.from_meta({"adapter": "my-run_2", "lora": {}, "seed": 0}).adapter == "my-run_2"
    for name in ("run.1", "", "a/b", "x" * 65, 7):
        with pytest.raises(RequestError, match="adapter name"):
            OpenRequest.from_meta({"adapter": name, "lora": {}, "seed": 0})
    with pytest.raises(AdapterConfigError, match="letters, digits"):
        swarm.SwarmModelForCausalLM.from_pretrained(
            tiny_models["llama"], adapter="run.1", lora_config=peft.LoraConfig(r=4), initial_peers=["/ip4/1.2.3.4"]
        )


def test_a_block_loads_from_its_own_tensors_only(tiny_models, tmp_path):
    """Every other tensor points at a file that does not exist: loading block 1 must not touch them."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        name: file if name.startswith("model.layers.1.") else "absent.safetensors"
        for name, file in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    spec = load_spec(model_dir)
    layer = load_block(spec, 1, torch.device("cpu"), torch.float32, "none")
    assert all(not p.is_meta for p in layer.parameters())
    with pytest.raises(Exception, match="absent"):
        load_block(spec, 0, torch.device("cpu"), torch.float32, "none")


def test_model_folder_errors_say_what_to_do(tmp_path):
    with pytest.raises(ModelFolderError, match="config.json"):
        load_spec(tmp_path)
