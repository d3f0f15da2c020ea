"""Each supported family trains through the swarm like it does locally; quantized peers train on CPU. The peers
are real, in this process."""

from __future__ import annotations

import peft
import pytest
import torch
from safetensors.torch import load_file

import swarm
from swarm.testing.parity import HPARAMS, local_peft

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def one_step(model, optimizer, batch: dict[str, torch.Tensor]) -> float:
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss.item()


def batch_for(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_family_trains_one_step_like_local_peft(family, inprocess_swarm, tiny_models, tmp_path):
    model_dir = tiny_models[family]
    local = inprocess_swarm(family)
    local.start_peers({"a": "0:3", "b": "3:4"})
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=local.initial_peers, adapter=f"{family}-lora", lora_config=peft.LoraConfig(**LORA)
    )
    try:
        model.save_adapter(tmp_path / "initial")
        batch = batch_for(model.spec.config.vocab_size)
        swarm_loss = one_step(model, swarm.RemoteOptimizer(model, **HPARAMS), batch)
        model.save_adapter(tmp_path / "final")
        assert model.step == 1
    finally:
        model.shutdown()
    reference = local_peft(model_dir, tmp_path / "initial")
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **HPARAMS)
    local_loss = one_step(reference, optimizer, batch)
    reference.save_pretrained(tmp_path / "local")
    assert swarm_loss == pytest.approx(local_loss, rel=1e-5)
    swarm_state = load_file(tmp_path / "final" / "adapter_model.safetensors")
    local_state = load_file(tmp_path / "local" / "adapter_model.safetensors")
    assert swarm_state.keys() == local_state.keys()
    for key in swarm_state:
        torch.testing.assert_close(swarm_state[key], local_state[key], rtol=1e-4, atol=1e-5, msg=key)


def test_nf4_and_int8_peers_train_on_cpu(inprocess_swarm, tiny_models):
    """An nf4 peer and an int8 peer train a step; their outputs are quantized (close to, not equal to, fp32)."""
    model_dir = tiny_models["llama"]
    batch = batch_for(256)
    exact = inprocess_swarm()
    exact.start_peers({"a": "0:2", "b": "2:4"})
    fp32 = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=exact.initial_peers, adapter="fp32-probe", lora_config=peft.LoraConfig(**LORA)
    )
    try:
        with torch.no_grad():
            fp32_logits = fp32(batch["input_ids"]).logits
    finally:
        fp32.shutdown()
    exact.close()
    quantized = inprocess_swarm()
    quantized.add_peer("0:2", "nf4", wait=False, quant="nf4")
    quantized.add_peer("2:4", "int8", wait=False, quant="int8")
    for peer in quantized.peers.values():
        peer.wait_serving()
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=quantized.initial_peers, adapter="quantized", lora_config=peft.LoraConfig(**LORA)
    )
    try:
        with torch.no_grad():
            quant_logits = model(batch["input_ids"]).logits
        before = model.adapter_state()
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        losses = [one_step(model, optimizer, batch) for _ in range(3)]
        after = model.adapter_state()
    finally:
        model.shutdown()
    difference = (quant_logits - fp32_logits).abs().max().item()
    assert 0 < difference < 0.5 * fp32_logits.abs().max().item(), f"quantized logits off by {difference}"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert set(after) == {0, 1, 2, 3}
    for block in after:
        assert any(not torch.equal(after[block][k], before[block][k]) for k in after[block]), block
