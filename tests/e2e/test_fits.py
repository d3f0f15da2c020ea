"""Promise 15 as a peer lives it: a ``swarm peer`` process held by the kernel to less memory than the whole span's
graph of one micro-batch needs, but more than per-block recompute does (swarm/memory.py's figures), trains to
parity with local peft and is never killed. With a whole-span graph it would pass its limit at the first backward."""

from __future__ import annotations

from collections.abc import Iterator

import peft
import pytest
import torch
from safetensors.torch import load_file

import swarm
from swarm.memory import ALL_SEVEN, Lora, MemoryInputs, ModelShape, breakdown, graph_bytes_per_token
from swarm.testing.localswarm import LocalSwarm
from swarm.testing.memcgroup import TIGHT_MALLOC, MemoryGroup, unavailable
from swarm.testing.parity import HPARAMS, LORA, local_peft, train
from swarm.testing.tiny import make_tiny_model

BLOCKS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 8, 256, 896, 4, 2
BATCH, LENGTH = 4, 512  # 2048 tokens a micro-batch: the tiny model's longest sequences, four of them
MiB = 1 << 20


@pytest.fixture
def memory_group() -> Iterator[MemoryGroup]:
    why_not = unavailable()
    if why_not:
        pytest.skip(f"cannot limit a peer's memory here: {why_not}")
    group = MemoryGroup("fits")
    try:
        yield group
    finally:
        group.close()


def _batches(vocab: int, steps: int) -> list[list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    return [[dict(input_ids=ids, attention_mask=mask, labels=ids)]] * steps


def test_a_peer_held_below_the_whole_span_graph_trains_to_parity(tmp_path, memory_group):
    model_dir = make_tiny_model(
        tmp_path / "model",
        layers=BLOCKS,
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        intermediate=INTERMEDIATE,
        seed=5,
    )
    shape = ModelShape("tiny", HIDDEN, INTERMEDIATE, BLOCKS, HEADS, KV_HEADS, 256, HIDDEN // HEADS)
    lora = Lora(LORA["r"], ALL_SEVEN)
    tokens = BATCH * LENGTH
    one_block = MemoryInputs(
        shape, "none", 4, lora, blocks=BLOCKS, tokens=tokens, in_flight=1, micro_batches=1, replication=1
    )
    parts = breakdown(one_block)
    recompute = parts.block_inputs + parts.graph + parts.workspace + parts.span_inputs  # what a micro-batch adds
    whole_span = BLOCKS * graph_bytes_per_token(shape, lora, 4) * tokens + parts.workspace + parts.span_inputs
    room = int(recompute + (whole_span - recompute) / 2)  # halfway: per-block fits with room to spare, whole-span not
    assert whole_span - room > 100 * MiB and room - recompute > 100 * MiB, (whole_span, recompute)

    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        peer = local.start_peer(
            model_dir, f"0:{BLOCKS}", name="held", launcher=memory_group.launcher(), env=dict(TIGHT_MALLOC)
        )
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter="fits",
            lora_config=peft.LoraConfig(**LORA),
            dtype=torch.float32,
            seed=7,
            patience=60.0,
        )
        try:
            model.save_adapter(tmp_path / "initial")
            with torch.no_grad():  # the adapter opened on the peer before the limit: its state is not the point
                model(torch.zeros(1, 4, dtype=torch.long))
            loaded = memory_group.usage()
            memory_group.limit(loaded + room)
            memory_group.reset_peak()
            batches = _batches(model.spec.config.vocab_size, steps=2)
            try:
                swarm_losses = train(model, swarm.RemoteOptimizer(model, **HPARAMS), batches, accumulation=1)
            except swarm.SwarmError as e:
                pytest.fail(
                    f"training failed ({e}); the peer {'died' if peer.popen.poll() is not None else 'lives'}, its "
                    f"group hit its limit of {(loaded + room) // MiB} MiB {memory_group.failures()} times"
                )
            model.save_adapter(tmp_path / "final")
        finally:
            model.shutdown()
        grown = memory_group.peak() - loaded
        assert peer.popen.poll() is None, f"the peer died under its limit of {(loaded + room) // MiB} MiB"
    assert grown <= room, (grown // MiB, room // MiB)
    assert grown < whole_span, "the peer's peak leaves no room for a whole-span graph: the test proves nothing"

    reference = local_peft(model_dir, tmp_path / "initial")
    trainable = [p for p in reference.parameters() if p.requires_grad]
    local_losses = train(reference, torch.optim.AdamW(trainable, **HPARAMS), batches, accumulation=1)
    reference.save_pretrained(tmp_path / "local")
    assert swarm_losses == pytest.approx(local_losses, rel=1e-4)
    ours = load_file(tmp_path / "final" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "local" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:  # fp32 sums over 2048 tokens a micro-batch: AdamW's first steps lift their last bits to 1e-4
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
