"""One client configuration: ``swarm.SwarmConfig`` holds every option of ``from_pretrained`` beyond the model and
its peers, under the same names and defaults; the keywords stay the documented way to pass them. No swarm needed."""

from __future__ import annotations

import dataclasses
import inspect

import peft
import pytest
import torch

import swarm
from swarm.client.commit import LOST_GRACE
from swarm.client.config import OPTIONS, SwarmConfig
from swarm.net.compression import WireFormat
from swarm.net.errors import AdapterConfigError

LORA = peft.LoraConfig(r=4, target_modules=["q_proj"])
NOWHERE = ["/ip4/127.0.0.1/tcp/1"]


def test_from_pretrained_keywords_are_the_config_fields_with_the_same_defaults():
    parameters = inspect.signature(swarm.SwarmModelForCausalLM.from_pretrained).parameters
    keywords = {name: p.default for name, p in parameters.items() if name not in ("model_dir", "initial_peers")}
    assert keywords.pop("config") is None
    fields = {f.name: f.default for f in dataclasses.fields(SwarmConfig)}
    assert list(keywords) == list(fields)  # same names, same order
    assert keywords == fields
    assert OPTIONS == set(fields)
    assert len(fields) == 21 and fields["lost_grace"] == LOST_GRACE  # 23 keywords with model_dir and initial_peers


def test_the_config_is_exported_and_frozen():
    config = swarm.SwarmConfig(lora_config=LORA)
    assert swarm.SwarmConfig is SwarmConfig and "SwarmConfig" in swarm.__all__
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.patience = 1.0
    assert dataclasses.replace(config, patience=5.0).patience == 5.0


def test_a_config_is_checked_when_it_is_made():
    with pytest.raises(ValueError, match="pass lora_config"):
        SwarmConfig()
    assert SwarmConfig(is_trainable=False).lora_config is None  # a reader takes the adapter's
    with pytest.raises(AdapterConfigError, match="letters, digits"):
        SwarmConfig(adapter="run.1", lora_config=LORA)
    with pytest.raises(ValueError, match="resume must be one of"):
        SwarmConfig(lora_config=LORA, resume="newest")
    with pytest.raises(ValueError, match="min_copies must be at least 1"):
        SwarmConfig(lora_config=LORA, min_copies=0)
    with pytest.raises(ValueError, match="compression must be one of"):
        SwarmConfig(lora_config=LORA, compression="zip")
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        SwarmConfig(lora_config=LORA, wire_dtype="int3")


def test_the_parts_of_the_client_take_what_the_config_says():
    assert SwarmConfig(lora_config=LORA).wire == WireFormat()
    assert SwarmConfig(lora_config=LORA, dtype=torch.bfloat16).wire == WireFormat("bfloat16")  # bf16 already
    assert SwarmConfig(lora_config=LORA, dtype=torch.bfloat16, wire_dtype="float16").wire == WireFormat("float16")
    compressed = SwarmConfig(lora_config=LORA, compression="hadamard4", grad_compression="blockwise8")
    assert compressed.wire == WireFormat(None, "hadamard4", "blockwise8")
    routing = SwarmConfig(lora_config=LORA, unreachable_wait=7.0, chain=False).router_options(hidden_size=64)
    assert (routing.unreachable_wait, routing.chained, routing.bytes_per_token) == (7.0, False, 64 * 4)
    half = SwarmConfig(lora_config=LORA, dtype=torch.bfloat16).router_options(hidden_size=64)
    assert half.bytes_per_token == 64 * 2 and half.chained
    assert SwarmConfig(lora_config=LORA, trainer="me@there").trainer_name() == "me@there"
    assert "@" in SwarmConfig(lora_config=LORA).trainer_name()
    assert SwarmConfig(is_trainable=False, trainer="me@there").trainer_name() is None


def test_a_config_or_keywords_not_both():
    config = SwarmConfig(lora_config=LORA, patience=5.0)
    keywords = {f.name: f.default for f in dataclasses.fields(SwarmConfig)}
    assert SwarmConfig.given(config, keywords) is config
    assert SwarmConfig.given(None, {**keywords, "lora_config": LORA, "patience": 5.0}) == config
    with pytest.raises(TypeError, match="patience, min_copies"):
        SwarmConfig.given(config, {**keywords, "patience": 1.0, "min_copies": 3})
    # from_pretrained refuses it before reading the model or joining anything
    with pytest.raises(TypeError, match="keywords adapter"):
        swarm.SwarmModelForCausalLM.from_pretrained("no/such-model", NOWHERE, adapter="other", config=config)
    with pytest.raises(ValueError, match="pass lora_config"):
        swarm.SwarmModelForCausalLM.from_pretrained("no/such-model", NOWHERE)
