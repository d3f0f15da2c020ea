"""Promise 6, the doors' part: a real peer in this process refuses every malformed request (garbage bytes, wrong
shapes, dtypes and values, lies about sizes, wrong adapters and steps, lanes that disagree) with a clear error, does
not buffer without bound, and trains on afterwards."""

from __future__ import annotations

import asyncio
import gc
import random

import peft
import psutil
import pytest
import torch
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

import swarm
from swarm.net import lanes
from swarm.net.errors import RemoteError
from swarm.net.wire import Message, PeerDoors, decode, encode

LORA = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


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
    uid = f"twice-{rng.getrandbits(32)}"  # each round its own message: a reused id would meet the last round's lanes
    first, second = lanes.pack(parts, 2, uid), lanes.pack(parts, 3, uid)
    cases.append([first[0], second[1]])  # one message, two different lane counts
    return cases


def test_a_peer_survives_a_fuzz_of_malformed_requests_and_still_trains(inprocess_swarm, tiny_models):
    """Hundreds of malformed requests at each door are refused with an error, twice over, without the peer's
    memory growing (the peer runs in this process: its memory is the process's); then it trains as if nothing
    happened."""
    model_dir = tiny_models["llama"]
    rng = random.Random(0)
    local = inprocess_swarm()
    peer = local.add_peer("0:4", "fuzzed", max_payload_mb=16)
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=local.initial_peers, adapter="fuzzed", lora_config=LORA
    )
    try:
        stub = PeerDoors.get_stub(model.session.transport.p2p, peer.peer_id)
        process = psutil.Process()
        ids = torch.randint(0, 256, (2, 8))
        rss = []
        for _ in range(3):  # the first round warms up the allocator; the last two must not grow
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
                model.session.transport.call(peer.peer_id, big, 60)
            assert refused >= 300
            gc.collect()  # garbage of earlier tests in this process is not the peer's growth
            rss.append(process.memory_info().rss)
        assert rss[2] < rss[1] * 1.25, f"peer memory grew from {rss[1] >> 20} to {rss[2] >> 20} MiB"
        losses = []
        optimizer = swarm.RemoteOptimizer(model, lr=1e-2)
        for _ in range(3):
            out = model(ids, labels=ids)
            out.loss.backward()
            optimizer.step()
            losses.append(out.loss.item())
        assert losses[-1] < losses[0] and model.step == 3
        assert peer.alive
    finally:
        model.shutdown()
