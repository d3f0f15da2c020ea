"""Each supported family trains through the swarm like it does locally (loss, adapter, logits, greedy generation);
'all-linear' names the projections peft names; nf4 blocks of each family run; quantized peers train on CPU. The peers
are real, in this process."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import swarm
from peers.layers import run_layers
from swarm import weights
from swarm.blocks import load_block
from swarm.lora_options import resolve_lora_config
from swarm.net.errors import AdapterConfigError, ModelFolderError
from swarm.spec import load_spec
from swarm.testing.parity import HPARAMS, local_peft, make_batches, train

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
# Phi-3 fuses q/k/v and gate/up into one projection each: LoRA targets them as peft names them.
# Mixtral / Qwen3-MoE: LoRA on the attention (peft adapts the experts' and router's names as bare parameters, which the
# swarm refuses).
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {"phi3": ["qkv_proj", "gate_up_proj", "down_proj"], "mixtral": ATTENTION, "qwen3_moe": ATTENTION}
# Gemma 2 / Gemma 3: scaled embeddings, final (and Gemma 2's attention) soft-capping, (1 + weight) norms, sliding
# layers with a window shorter than the batch, Gemma 3's local and global rotary (swarm/testing/tiny.py GEMMA).
DENSE = ["mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3_text"]
# Mixture-of-experts: 4 experts, top-2, routers wide enough that routing decides the output; Qwen3-MoE's block 0
# dense (swarm/testing/tiny.py MOE).
MOE = ["mixtral", "qwen3_moe"]
FAMILIES = DENSE + MOE
NEW_TOKENS = 4


def one_step(model, optimizer, batch: dict[str, torch.Tensor]) -> float:
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss.item()


def batch_for(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(3))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_one_step_like_local_peft(family, inprocess_swarm, tiny_models, tmp_path):
    model_dir = tiny_models[family]
    local = inprocess_swarm(family)
    local.start_peers({"a": "0:3", "b": "3:4"})
    lora = peft.LoraConfig(**{**LORA, "target_modules": TARGETS.get(family, LORA["target_modules"])})
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=local.initial_peers, adapter=f"{family}-lora", lora_config=lora
    )
    try:
        model.save_adapter(tmp_path / "initial")
        batch = batch_for(model.spec.config.vocab_size)
        swarm_loss = one_step(model, swarm.RemoteOptimizer(model, **HPARAMS), batch)
        model.save_adapter(tmp_path / "final")
        assert model.step == 1
        with torch.no_grad():
            swarm_logits = model(batch["input_ids"]).logits
        swarm_tokens = model.generate(batch["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False)
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
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(swarm_logits, reference(batch["input_ids"]).logits, rtol=1e-4, atol=1e-5)
    # greedy generation equals local transformers with the swarm's own adapter, token for token
    exported = local_peft(model_dir, tmp_path / "final").eval()
    with torch.no_grad():
        local_tokens = exported.generate(input_ids=batch["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(swarm_tokens, local_tokens), (swarm_tokens, local_tokens)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_with_padding_trains_and_generates_like_local(family, inprocess_swarm, tiny_models, tmp_path):
    """Padding beside sliding windows shorter than the sequences: a step of two accumulated right-padded
    micro-batches equals local peft (losses, adapter), and left-padded prompts of different lengths generate, past
    the window, what local transformers generates with the swarm's adapter."""
    model_dir = tiny_models[family]
    local = inprocess_swarm(family)
    local.start_peers({"a": "0:2", "b": "2:4"})
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=local.initial_peers, adapter=f"{family}-padded", lora_config=peft.LoraConfig(**LORA)
    )
    step = make_batches(model.spec.config.vocab_size)[:1]
    prompts = torch.tensor([[0, 0, 0, 9, 33, 120, 7], [14, 2, 77, 5, 61, 200, 3]])
    prompt_mask = (torch.arange(7) >= torch.tensor([[3], [0]])).long()
    try:
        model.save_adapter(tmp_path / "initial")
        swarm_losses = train(model, swarm.RemoteOptimizer(model, **HPARAMS), step)
        model.save_adapter(tmp_path / "final")
        swarm_tokens = model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False)
    finally:
        model.shutdown()
    reference = local_peft(model_dir, tmp_path / "initial")
    local_losses = train(
        reference, torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **HPARAMS), step
    )
    reference.save_pretrained(tmp_path / "local")
    assert swarm_losses == pytest.approx(local_losses, rel=1e-5)
    swarm_state = load_file(tmp_path / "final" / "adapter_model.safetensors")
    local_state = load_file(tmp_path / "local" / "adapter_model.safetensors")
    for key in local_state:
        torch.testing.assert_close(swarm_state[key], local_state[key], rtol=1e-4, atol=1e-5, msg=key)
    exported = local_peft(model_dir, tmp_path / "final").eval()
    with torch.no_grad():
        local_tokens = exported.generate(
            input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False
        )
    assert torch.equal(swarm_tokens, local_tokens), (swarm_tokens, local_tokens)


@pytest.mark.parametrize("family", ["llama", *DENSE])
def test_all_linear_names_what_peft_names(family, tiny_models):
    """``target_modules='all-linear'`` resolves to the projections local peft puts LoRA on (Phi-3: the fused ones)."""
    spec = load_spec(tiny_models[family])
    resolved = resolve_lora_config(peft.LoraConfig(r=2, target_modules="all-linear"), spec).target_modules
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    local = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear"))
    names = {name.rsplit(".", 1)[-1] for name, module in local.named_modules() if hasattr(module, "lora_A")}
    assert set(resolved) == names, (resolved, names)


@pytest.mark.parametrize("family", MOE)
def test_moe_lora_on_experts_or_router_is_refused_naming_what_peft_would_adapt(family, tiny_models):
    """On Mixtral and Qwen3-MoE, local peft (transformers 5) adapts 'all-linear', the experts' names and ``gate`` as
    bare parameters (the fused experts' ``gate_up_proj`` / ``down_proj``, the router's ``gate.weight``): the swarm
    refuses them, naming those parameters, as it refuses ``target_parameters``; attention targets resolve as given."""
    spec = load_spec(tiny_models[family])
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    local = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear"))
    assert set(local.peft_config["default"].target_parameters) == {"gate_up_proj", "down_proj", "gate.weight"}
    expert = {"mixtral": "w2", "qwen3_moe": "down_proj"}[family]
    for targets, named in [
        ("all-linear", "gate_up_proj"),
        (["q_proj", expert], "down_proj"),
        (["gate"], "gate.weight"),
    ]:
        with pytest.raises(AdapterConfigError, match=f"on {family} is not supported: .*'{named}'.*target_parameters"):
            resolve_lora_config(peft.LoraConfig(r=2, target_modules=targets), spec)
    with pytest.raises(AdapterConfigError, match="target_parameters=.*is not supported: .*nn.Linear projections"):
        resolve_lora_config(
            peft.LoraConfig(r=2, target_modules=ATTENTION, target_parameters=["mlp.experts.gate_up_proj"]), spec
        )
    assert set(resolve_lora_config(peft.LoraConfig(r=2, target_modules=ATTENTION), spec).target_modules) == set(
        ATTENTION
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_nf4_blocks_of_each_family_run_close_to_fp32(family, tiny_models):
    """A family's blocks load with ``--quant nf4`` (its every nn.Linear projection quantized, norms kept; a
    mixture-of-experts block's fused experts and router, bare parameters, as stored) and compute what the fp32 blocks
    compute, up to quantization."""
    spec = load_spec(tiny_models[family])
    rotary = spec.family_class("RotaryEmbedding")(config=spec.config)
    hidden = torch.randn(1, 6, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for quant in ("none", "nf4"):
        layers = {block: load_block(spec, block, torch.device("cpu"), torch.float32, quant) for block in range(2)}
        with torch.no_grad():
            outputs[quant] = run_layers(spec, layers, rotary, hidden, None, range(2))
        if family in MOE and quant == "nf4":
            moe = layers[1].mlp
            assert type(layers[1].self_attn.q_proj).__name__ == "Linear4bit"
            assert (
                moe.experts.gate_up_proj.dtype == moe.experts.down_proj.dtype == moe.gate.weight.dtype == torch.float32
            )
    difference = (outputs["nf4"] - outputs["none"]).abs().max().item()
    assert 0 < difference < 0.5 * outputs["none"].abs().max().item(), difference


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "phi3", "gemma2", "gemma3_text", *MOE, "qwen3_moe-router"])
def test_block_digests_of_each_family_cover_its_own_tensors(family, tiny_models, tmp_path):
    """Each block's weight digest covers the family's own tensors (Qwen3's and OLMo 2's q/k norms, OLMo 2's
    post-norms, Phi-3's fused projections, Gemma's pre-feedforward norms and Gemma 3's q norms, one expert of a
    mixture-of-experts block, its router): one byte changed in one of them changes that block's digest only."""
    import shutil

    case, family = family, family.removesuffix("-router")
    folder = shutil.copytree(tiny_models[family], tmp_path / case, ignore=shutil.ignore_patterns(weights.CACHE_FILE))
    before = weights.block_digests(load_spec(folder))
    assert len(set(before.values())) == 4 and family in weights.block_config(load_spec(folder), 0)
    name = {
        "qwen3": "self_attn.k_norm",
        "olmo2": "post_feedforward_layernorm",
        "phi3": "mlp.gate_up_proj",
        "gemma2": "pre_feedforward_layernorm",
        "gemma3_text": "self_attn.q_norm",
        "mixtral": "block_sparse_moe.experts.1.w2",  # as stored: one nn.Linear per expert
        "qwen3_moe": "mlp.experts.3.up_proj",
        "qwen3_moe-router": "mlp.gate",
    }[case]
    spec = load_spec(folder)
    shard = spec.weight_files[f"model.layers.2.{name}.weight"]
    state = load_file(shard)
    state[f"model.layers.2.{name}.weight"][0] += 1.0
    save_file(state, shard, metadata={"format": "pt"})
    after = weights.block_digests(load_spec(folder))
    assert [block for block in before if before[block] != after[block]] == [2]


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("mixtral", "num_experts_per_tok", 1),
        ("qwen3_moe", "norm_topk_prob", False),
        ("qwen3_moe", "mlp_only_layers", []),
    ],
)
def test_moe_block_digests_cover_the_routing_config(family, field, value, tiny_models, tmp_path):
    """How many experts a token goes to, whether their weights are renormalised and which blocks are sparse change
    what a block computes from the same tensors: they change the digests (every block's), and no other family's
    block config names them."""
    import shutil

    folder = shutil.copytree(tiny_models[family], tmp_path / family, ignore=shutil.ignore_patterns(weights.CACHE_FILE))
    before = weights.block_digests(load_spec(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    after = weights.block_digests(load_spec(folder))
    assert all(before[block] != after[block] for block in before)
    assert field not in weights.block_config(load_spec(tiny_models["llama"]), 0)


def test_phi3_with_dropout_is_refused_with_why(tiny_models, tmp_path):
    """Peers run blocks in eval mode: a Phi-3 folder whose blocks drop out in training is refused, saying so."""
    import shutil

    folder = shutil.copytree(tiny_models["phi3"], tmp_path / "phi3-dropout")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "resid_pdrop": 0.1}))
    with pytest.raises(ModelFolderError, match="phi3 with resid_pdrop=0.1 is not supported"):
        load_spec(folder)


@pytest.mark.parametrize(
    ("family", "field", "value", "why"),
    [
        ("gemma2", "attention_dropout", 0.1, "apply that dropout in training"),
        ("gemma3_text", "attention_dropout", 0.1, "apply that dropout in training"),
        ("gemma2", "use_bidirectional_attention", True, "bidirectional masks"),
        ("gemma3_text", "use_bidirectional_attention", True, "bidirectional masks"),
        ("mixtral", "output_router_logits", True, "load-balancing loss"),
        ("qwen3_moe", "output_router_logits", True, "load-balancing loss"),
        ("mixtral", "router_jitter_noise", 0.1, "apply that dropout in training"),
        ("qwen3_moe", "attention_dropout", 0.1, "apply that dropout in training"),
    ],
)
def test_gemma_configurations_peers_cannot_serve_are_refused_with_why(family, field, value, why, tiny_models, tmp_path):
    """A Gemma folder with attention dropout (peers run blocks in eval mode) or bidirectional attention (peers build
    causal masks) is refused at load, naming the field and why."""
    import shutil

    folder = shutil.copytree(tiny_models[family], tmp_path / f"{family}-{field}")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelFolderError, match=f"{family} with {field}={value} is not supported: .*{why}"):
        load_spec(folder)


def test_gemma_peers_attend_as_the_family_does(tiny_models):
    """Gemma 2 runs eager attention (its model has no sdpa: sdpa cannot soft-cap attention logits), Gemma 3 sdpa;
    a digest tells Gemma blocks apart by their soft-capping and query scaling."""
    assert load_spec(tiny_models["gemma2"]).config._attn_implementation == "eager"
    assert load_spec(tiny_models["gemma3_text"]).config._attn_implementation == "sdpa"
    block = json.loads(weights.block_config(load_spec(tiny_models["gemma2"]), 0))
    assert block["attn_logit_softcapping"] == 0.5 and block["query_pre_attn_scalar"] == 8
    assert "query_pre_attn_scalar" not in weights.block_config(load_spec(tiny_models["llama"]), 0)


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3_text", *MOE])
def test_a_family_with_refused_fields_keeps_its_name(family, tiny_models):
    """The checks of a family's refused fields leave the model's name as the folder's (or the one given)."""
    assert load_spec(tiny_models[family]).name == tiny_models[family].name
    assert load_spec(tiny_models[family], name="given").name == "given"


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
