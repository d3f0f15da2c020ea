"""Every peft LoraConfig option is honoured or refused by name (swarm/lora_options.py), the client resolves
'all-linear' and checks targets before joining, blocks that layers_to_transform leaves out train nothing without
breaking a peer, and LoRA dropout draws the same masks whenever a forward is recomputed."""

from __future__ import annotations

import dataclasses

import peft
import pytest
import torch

import swarm
from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.checkpoints import CheckpointStore
from peers.commits import Commits
from peers.state import pack_states, unpack_states
from peers.transfer import StateTransfer
from swarm.blocks import lora_config_from_wire, lora_config_to_wire
from swarm.lora_options import HONOURED, METADATA, OPTIONAL_ON_WIRE, REFUSED, resolve_lora_config, undecided_fields
from swarm.net.errors import AdapterConfigError
from swarm.net.protocol import OptimizerHParams
from swarm.spec import load_spec

HPARAMS = OptimizerHParams(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
TARGETS = ["q_proj", "v_proj"]

# A non-default value for every refused field (the table must name what to do for each).
REFUSED_VALUES = {
    "modules_to_save": ["lm_head"],
    "init_lora_weights": "gaussian",
    "megatron_config": {"tensor_model_parallel_size": 1},
    "trainable_token_indices": [1, 2],
    "loftq_config": {"loftq_bits": 4},
    "eva_config": {"rho": 2.0},
    "corda_config": {"corda_method": "kpm"},
    "lora_ga_config": {"direction": "ArB2r"},
    "velora_config": {"rank": 4},
    "alora_invocation_tokens": [5, 6],
    "use_qalora": True,
    "monteclora_config": {"n": 2},
    "layer_replication": [[0, 2], [1, 3]],
    "lora_bias": True,
    "target_parameters": ["mlp.experts.down_proj"],
    "use_bdlora": {"r": 2},
    "arrow_config": {"top_k": 2},
    "kasa_config": {"k": 2},
    "astra_config": {"rank": 2},
    "ensure_weight_tying": True,
}


def test_every_lora_config_field_of_the_installed_peft_is_decided():
    """A peft that grows a field fails here until someone decides whether the swarm honours or refuses it."""
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert undecided_fields() == set(), f"decide these LoraConfig fields in swarm/lora_options.py: {undecided_fields()}"
    tables = [set(HONOURED), set(METADATA), set(REFUSED)]
    assert sum(len(t) for t in tables) == len(set().union(*tables)), "a field is decided twice"
    assert set().union(*tables) == fields, "the tables name fields this peft does not have"
    assert set(OPTIONAL_ON_WIRE) <= set(HONOURED)
    assert set(REFUSED_VALUES) == set(REFUSED), "every refused field has a refusal test"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_option_is_refused_by_name(name):
    config = peft.LoraConfig(r=4, target_modules=TARGETS)
    object.__setattr__(config, name, REFUSED_VALUES[name])  # some values would trip peft's own checks first
    with pytest.raises(AdapterConfigError, match=f"LoraConfig.{name}=") as caught:
        lora_config_to_wire(config)
    assert REFUSED[name] in str(caught.value)


def test_bias_other_than_none_and_dora_with_dropout_are_refused_by_name():
    with pytest.raises(AdapterConfigError, match="LoraConfig.bias='all'"):
        lora_config_to_wire(peft.LoraConfig(r=4, target_modules=TARGETS, bias="all"))
    with pytest.raises(AdapterConfigError, match="LoraConfig.use_dora with lora_dropout"):
        lora_config_to_wire(peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True, lora_dropout=0.1))


def test_refusals_come_before_joining_anything(tiny_models):
    """initial_peers points nowhere: the refusal must come from the config check, not from a failed join."""
    with pytest.raises(AdapterConfigError, match="LoraConfig.modules_to_save"):
        swarm.SwarmModelForCausalLM.from_pretrained(
            tiny_models["llama"],
            initial_peers=["/ip4/127.0.0.1/tcp/1"],
            lora_config=peft.LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["lm_head"]),
        )
    with pytest.raises(AdapterConfigError, match="target_modules"):
        swarm.SwarmModelForCausalLM.from_pretrained(
            tiny_models["llama"],
            initial_peers=["/ip4/127.0.0.1/tcp/1"],
            lora_config=peft.LoraConfig(r=4, target_modules=["nope"]),
        )
    with pytest.raises(AdapterConfigError, match="target_modules"):  # layers_pattern naming no layer list of a llama
        swarm.SwarmModelForCausalLM.from_pretrained(
            tiny_models["llama"],
            initial_peers=["/ip4/127.0.0.1/tcp/1"],
            lora_config=peft.LoraConfig(r=4, target_modules=TARGETS, layers_to_transform=[1], layers_pattern="h"),
        )


def test_all_linear_and_default_targets_resolve_as_local_peft_resolves_them(tiny_models, tmp_path):
    import transformers

    spec = load_spec(tiny_models["llama"])
    for targets in ("all-linear", None):
        resolved = resolve_lora_config(peft.LoraConfig(r=4, target_modules=targets), spec)
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
        local = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets)).peft_config["default"]
        assert set(resolved.target_modules) == set(local.target_modules), targets
        with pytest.raises(AdapterConfigError, match="needs the model"):  # peers cannot resolve it
            lora_config_to_wire(peft.LoraConfig(r=4, target_modules=targets))
    assert "lm_head" not in resolved.target_modules


def test_options_travel_only_when_set_so_old_adapters_keep_their_identity():
    plain = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    assert set(plain) == {"r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora", "fan_in_fan_out"}
    config = peft.LoraConfig(
        r=4,
        target_modules=TARGETS,
        use_dora=True,
        layers_to_transform=[1, 2],
        layers_pattern="layers",
        rank_pattern={"v_proj": 2},
        alpha_pattern={"q_proj": 3},
        exclude_modules=["model.layers.2.self_attn.q_proj"],
    )
    back = lora_config_from_wire(lora_config_to_wire(config))
    for name in OPTIONAL_ON_WIRE:
        assert getattr(back, name) == getattr(config, name), name


def _backend(model_dir, blocks: range) -> SpanBackend:
    spec = load_spec(model_dir)
    return SpanBackend(spec, blocks, torch.device("cpu"), torch.float32, "none", AdapterStore(spec))


def test_a_block_that_layers_to_transform_leaves_out_serves_trains_and_moves(tiny_models, tmp_path):
    """Block 0 has no LoRA: forwards, backwards, commits, digests, exports, transfers, standby copies and checkpoints
    still work."""
    wire = lora_config_to_wire(peft.LoraConfig(r=4, target_modules=TARGETS, layers_to_transform=[1]))
    backend = _backend(tiny_models["llama"], range(0, 2))
    backend.adapters.open_adapter("a", wire, seed=3, session="s")
    assert [len(state.params) for _, state in sorted(backend.adapters.adapter("a").blocks.items())] == [0, 4]
    hidden = torch.randn(1, 6, backend.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for blocks, input_grad in ((range(0, 1), False), (range(0, 2), True)):
        mb = f"s:0:{blocks.stop}"
        backend.forward("a", blocks, 0, hidden, None, mb)
        backend.backward("a", blocks, 0, mb, hidden, None, torch.ones_like(hidden), input_grad=input_grad)
    Commits(backend.adapters).apply("a", 0, {0: [("s:0:1", "s:0:2")], 1: [("s:0:2",)]}, HPARAMS)
    assert backend.adapters.adapter("a").steps() == {0: 1, 1: 1} and len(backend.adapters.digests("a")) == 2
    assert StateTransfer(backend.adapters).lora_state("a")[0] == {}
    exported = unpack_states(*pack_states(StateTransfer(backend.adapters).export_state("a", range(0, 2))[0]))
    assert exported[0].step == 1 and exported[0].tensors == {}, "a block without LoRA must travel too"
    other = _backend(tiny_models["llama"], range(2, 3))
    other.adapters.keep_standby("a", {"lora": wire, "seed": 3}, exported, keep={0, 1})
    assert other.adapters.adapter("a").standby_steps() == {0: 1, 1: 1}
    store = CheckpointStore(tmp_path)
    store.save_block("a", 0, exported[0], backend.adapters.adapter("a").meta)
    assert store.load()["a"][1][0].step == 1


def _grads(backend: SpanBackend, mb: str, hidden: torch.Tensor, drop_graph: bool) -> list[torch.Tensor]:
    backend.forward("a", range(0, 2), 0, hidden, None, mb)
    if drop_graph:
        backend.adapters.cache.drop_adapter("a")  # the backward recomputes from the kept input
    grad_in = backend.backward("a", range(0, 2), 0, mb, None, None, torch.ones_like(hidden))
    state = backend.adapters.adapter("a").blocks[1]
    return [grad_in, *state.grads.pop(mb)]


def _dropout_backend(model_dir, session: str) -> SpanBackend:
    backend = _backend(model_dir, range(0, 2))
    wire = lora_config_to_wire(peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.5))
    backend.adapters.open_adapter("a", wire, seed=3, session=session)
    with torch.no_grad():  # B is zero at init: give LoRA an effect on the outputs
        for state in backend.adapters.adapter("a").blocks.values():
            for lp in state.params:
                lp.param.normal_(generator=torch.Generator().manual_seed(1))
    return backend


def test_lora_dropout_applies_to_training_forwards_and_replays_on_recompute(tiny_models):
    backend = _dropout_backend(tiny_models["llama"], "s")
    hidden = torch.randn(2, 6, backend.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    cached = _grads(backend, "s:0:1", hidden, drop_graph=False)
    recomputed = _grads(backend, "s:0:1", hidden, drop_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(cached, recomputed, strict=True)), "a recompute drew other masks"
    replica = _dropout_backend(tiny_models["llama"], "other")  # another replica, or the same script run again
    replayed = _grads(replica, "other:0:1", hidden, drop_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(cached, replayed, strict=True)), "masks depend on the session"
    other_micro_batch = _grads(backend, "s:0:2", hidden, drop_graph=False)
    assert not torch.equal(cached[0], other_micro_batch[0]), "two micro-batches drew the same masks"
    train_out = backend.forward("a", range(0, 2), 0, hidden, None, "s:0:3")
    eval_out = backend.forward("a", range(0, 2), 0, hidden, None)
    assert torch.equal(eval_out, backend.forward("a", range(0, 2), 0, hidden, None)), "dropout in a no-grad forward"
    assert not torch.equal(train_out, eval_out), "no dropout in a training forward"


def test_resolving_a_config_leaves_modules_built_in_other_threads_alone(tmp_path):
    """The client resolves its LoraConfig on meta blocks while other threads of its process build modules (in tests,
    in-process peers loading their blocks): peft's ``low_cpu_mem_usage`` patched ``nn.Module`` for every thread, and
    a peer's weights assigned meanwhile went to the meta device (its load failed: "Cannot copy out of meta tensor")."""
    import threading

    from swarm.testing.tiny import make_tiny_model

    spec = load_spec(make_tiny_model(tmp_path / "deep", "llama", layers=48))
    resolving = threading.Thread(
        target=lambda: [resolve_lora_config(peft.LoraConfig(r=4, target_modules="all-linear"), spec) for _ in range(3)]
    )
    resolving.start()
    built = on_meta = 0
    while resolving.is_alive() or built == 0:
        layer = torch.nn.Linear(4, 4, device="meta")
        layer.weight = torch.nn.Parameter(torch.ones(4, 4))  # as load_state_dict(assign=True) sets a block's weights
        built += 1
        on_meta += layer.weight.is_meta
    resolving.join()
    assert on_meta == 0, f"{on_meta} of {built} parameters set in another thread went to the meta device"
