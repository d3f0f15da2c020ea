"""peft LoraConfig options through real peers in this process: DoRA, layers_to_transform with layers_pattern,
rank_pattern with alpha_pattern, rsLoRA with all-linear and exclude_modules train as local peft trains the same config
from the same initial adapter (losses, exported tensors, adapter_config), and the exported folder loads in plain peft
with the same logits. LoRA dropout draws masks that a peer killed mid-step does not change: the adapter is the same,
bit for bit, as without the failure; local peft draws other masks, so its loss curve is compared loosely."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import swarm
from swarm.net.protocol import Method
from swarm.testing.faults import Action, Fault
from swarm.testing.parity import HPARAMS, make_batches, train

STEPS = 3
ADAPTER = "adapter_model.safetensors"
CONFIGS = {
    "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True),
    "layers": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1, 2], layers_pattern="layers"
    ),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"v_proj": 2, "model.layers.3.mlp.up_proj": 6},
        alpha_pattern={"up_proj": 3},
    ),
    "rslora-all-linear": dict(
        r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True, exclude_modules=["o_proj"]
    ),
}
# adapter_config.json fields that must come out as local peft writes them
CONFIG_FIELDS = (
    "r",
    "lora_alpha",
    "use_dora",
    "use_rslora",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "lora_dropout",
)


def _train_both(swarm_run, model_dir, out, adapter: str, lora: dict, steps: int = STEPS) -> dict:
    """Train ``steps`` steps through the swarm, export, then local peft from the swarm's initial adapter."""
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir, initial_peers=swarm_run.initial_peers, adapter=adapter, lora_config=peft.LoraConfig(**lora), seed=7
    )
    batches = make_batches(model.spec.config.vocab_size)[:steps]
    try:
        model.save_adapter(out / "initial")
        swarm_losses = train(model, swarm.RemoteOptimizer(model, **HPARAMS), batches)
        model.save_adapter(out / "final")
        probe = batches[0][0]
        with torch.no_grad():
            swarm_logits = model(probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    finally:
        model.shutdown()
    # the reference: local peft built from the user's config (not from the swarm's export), trained from the swarm's
    # initial adapter; a fresh copy shows how peft itself initialises what is not drawn from the seed
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    reference = peft.get_peft_model(base, peft.LoraConfig(**lora))
    reference.save_pretrained(out / "fresh")
    loaded = peft.set_peft_model_state_dict(reference, load_file(out / "initial" / ADAPTER))
    assert not loaded.unexpected_keys and not [key for key in loaded.missing_keys if "lora_" in key], loaded
    reference.train()  # LoRA dropout applies locally too
    torch.manual_seed(0)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    local_losses = train(reference, torch.optim.AdamW(trainable, **HPARAMS), batches)
    reference.save_pretrained(out / "local")
    return dict(swarm_losses=swarm_losses, local_losses=local_losses, swarm_logits=swarm_logits, probe=probe)


@pytest.mark.parametrize("option", sorted(CONFIGS))
def test_an_option_trains_as_local_peft_trains_it(option, llama_pair, tiny_models, tmp_path):
    model_dir = tiny_models["llama"]
    run = _train_both(llama_pair, model_dir, tmp_path, f"opt-{option}", CONFIGS[option])
    torch.testing.assert_close(
        torch.tensor(run["swarm_losses"]), torch.tensor(run["local_losses"]), rtol=1e-4, atol=1e-5
    )
    ours, theirs = load_file(tmp_path / "final" / ADAPTER), load_file(tmp_path / "local" / ADAPTER)
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    initial, fresh = load_file(tmp_path / "initial" / ADAPTER), load_file(tmp_path / "fresh" / ADAPTER)
    assert initial.keys() == fresh.keys()
    for key in [k for k in initial if ".lora_A." not in k]:  # A is drawn from (seed, block); B and DoRA's m are not
        if "magnitude" in key:  # from the stored weights in float64, rounded once: within an ulp of peft's fp32 norm
            torch.testing.assert_close(initial[key], fresh[key], rtol=2.4e-7, atol=0, msg=key)
        else:
            assert torch.equal(initial[key], fresh[key]), f"{key} is not initialised as peft initialises it"
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)
    ours_config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    theirs_config = json.loads((tmp_path / "local" / "adapter_config.json").read_text())
    for field in CONFIG_FIELDS:
        assert ours_config[field] == theirs_config[field], field
    for field in ("target_modules", "exclude_modules"):  # sets in peft: written in any order
        assert set(ours_config[field] or ()) == set(theirs_config[field] or ()), field
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "final")  # plain peft: no missing or unexpected keys
    probe = run["probe"]
    with torch.no_grad():
        logits = loaded(probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    torch.testing.assert_close(logits, run["swarm_logits"], rtol=1e-4, atol=1e-4)


DROPOUT = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.1)


def test_lora_dropout_replays_exactly_when_a_peer_dies_mid_step(inprocess_swarm, tiny_models, tmp_path):
    """a and b serve 0:2, c serves 2:4. A run without failures, then one where the second backward that reaches 0:2
    kills its peer: its gradients are recomputed on the other replica, with the same masks, so the adapters are equal
    bit for bit; the masks are real (a run with dropout 0 has other losses); local peft, with masks of its own, falls
    as the swarm does, within a loose band."""
    model_dir = tiny_models["llama"]
    swarm_run = inprocess_swarm()
    peers = swarm_run.start_peers({"a": "0:2", "b": "0:2", "c": "2:4"})
    clean = _train_both(swarm_run, model_dir, tmp_path / "clean", "drop-clean", DROPOUT)
    no_dropout = _train_both(swarm_run, model_dir, tmp_path / "none", "drop-none", {**DROPOUT, "lora_dropout": 0.0})
    dies = Fault(Action.KILL, Method.BACKWARD, nth=2, when=lambda meta: meta["start"] == 0)
    for name in ("a", "b"):
        peers[name].faults.arm(dies)
    broken = _train_both(swarm_run, model_dir, tmp_path / "broken", "drop-broken", DROPOUT)
    assert dies.wait_fired(0) and peers["a"].killed != peers["b"].killed
    assert broken["swarm_losses"] == clean["swarm_losses"]
    final_clean = load_file(tmp_path / "clean" / "final" / ADAPTER)
    final_broken = load_file(tmp_path / "broken" / "final" / ADAPTER)
    assert final_clean.keys() == final_broken.keys()
    assert all(torch.equal(final_clean[key], final_broken[key]) for key in final_clean), "a recompute drew other masks"
    # the masks apply: at step 0 B is zero and they change nothing; from step 1 on they do
    assert clean["swarm_losses"][0] == no_dropout["swarm_losses"][0]
    assert clean["swarm_losses"][2:] != no_dropout["swarm_losses"][2:]
    # local peft draws other masks (its losses differ too): both fall, and stay close
    assert clean["local_losses"][2:] != clean["swarm_losses"][2:]
    for run in (clean["swarm_losses"], clean["local_losses"]):
        assert run[-1] < run[0], run
    torch.testing.assert_close(
        torch.tensor(clean["swarm_losses"]), torch.tensor(clean["local_losses"]), rtol=0.05, atol=0.05
    )
