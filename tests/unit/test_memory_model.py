"""A peer's memory on paper (swarm/memory.py, issue 57): its parts add up, its activations stay one block's graph
whatever the span, the graph is what autograd really saves, and the daemon's default span is the model's. The
measured peaks beside the model are scripts/bench_memory.py's (BENCHMARKS.md)."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from types import SimpleNamespace

import peft
import pytest
import torch
from transformers import LlamaConfig

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.config import PeerConfig, blocks_that_fit
from peers.state import SavedBytes
from swarm.blocks import lora_config_to_wire
from swarm.client.routing import MIN_IN_FLIGHT
from swarm.memory import (
    ACTIVATION_CACHE_MB,
    ALL_SEVEN,
    DEFAULT_IN_FLIGHT,
    FREE_SHARE,
    GIB,
    KEPT_INPUTS_MB,
    MAX_INFERENCE_MB,
    Breakdown,
    Lora,
    MemoryInputs,
    ModelShape,
    block_weight_bytes,
    breakdown,
    card_free_bytes,
    default_num_blocks,
    graph_bytes_per_token,
    load_shape,
    tokens_in_flight_bound,
)
from swarm.planning import CONFIGS
from swarm.spec import load_spec
from swarm.testing.tiny import make_tiny_model

LLAMA_70B = load_shape(CONFIGS / "llama-3-70b.json")
# A peer on a 24 GiB card as the daemon sizes it by default: NF4, bf16, its own bounds on the activation cache and
# generation sessions.
SEED_PEER = MemoryInputs(
    LLAMA_70B,
    "nf4",
    dtype_bytes=2,
    cache_bytes=ACTIVATION_CACHE_MB << 20,
    inference_bytes=MAX_INFERENCE_MB << 20,
)


def test_the_parts_add_up_to_the_total_on_a_gpu_and_on_a_cpu():
    for on_host in (False, True):
        memory = breakdown(replace(SEED_PEER, blocks=27, in_flight=6, on_host=on_host))
        parts = memory.parts()
        assert set(parts) == {f.name for f in fields(Breakdown)} - {"on_host"}
        assert all(nbytes > 0 for nbytes in parts.values())
        host = sum(parts[name] for name in Breakdown.HOST)
        assert memory.device + host == pytest.approx(sum(parts.values()))
        assert memory.host == pytest.approx(host)
        assert memory.total == pytest.approx(sum(parts.values()) if on_host else memory.device)
    # the seed's peer by hand: 27 blocks, 16 micro-batches a step over 2 pipelines, 6 in flight through it
    grad = 2_588_672 * 4  # one block's LoRA gradient, fp32
    memory = breakdown(replace(SEED_PEER, blocks=27, in_flight=6))
    assert memory.adapters == 27 * 3 * grad
    assert memory.grads == 27 * 2 * 8 * grad  # this step's 8 micro-batches here, and the last step's
    assert memory.block_inputs == 2 * 27 * 8192 * 2048 * 2  # the 1 GiB cache holds one, the one computing beside it
    assert memory.weights == pytest.approx(27 * 855_638_016 * 0.5159, rel=1e-3)
    assert memory.device / GIB == pytest.approx(20.73, abs=0.01)


def test_activations_stay_one_blocks_graph_while_the_state_grows_with_the_span():
    one = breakdown(replace(SEED_PEER, blocks=1, cache_bytes=None))
    for blocks in (2, 27, 80):
        many = breakdown(replace(SEED_PEER, blocks=blocks, cache_bytes=None))
        assert (many.graph, many.workspace, many.inference) == (one.graph, one.workspace, one.inference)
        for part in ("weights", "adapters", "grads", "block_inputs", "applied"):
            assert getattr(many, part) == pytest.approx(blocks * getattr(one, part))
    # the activation cache holds whole micro-batches up to its bound; the one computing is beside it
    span = 27 * LLAMA_70B.hidden * 2048 * 2
    capped = breakdown(replace(SEED_PEER, blocks=27, in_flight=6, cache_bytes=span * 2.5))
    assert capped.block_inputs == 3 * span
    assert breakdown(replace(SEED_PEER, blocks=27, in_flight=2, cache_bytes=span * 2.5)).block_inputs == 2 * span


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("memory") / "tiny", layers=1, hidden=64, heads=4, intermediate=160)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("targets", [ALL_SEVEN, ("q_proj", "v_proj", "up_proj"), ("o_proj", "down_proj")])
def test_a_blocks_graph_is_what_autograd_saves(model_dir, dtype, targets):
    spec = load_spec(model_dir)
    backend = SpanBackend(spec, range(0, 1), torch.device("cpu"), dtype, "none", AdapterStore(spec))
    wire = lora_config_to_wire(peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
    backend.adapters.open_adapter("a", wire, seed=1, session="s")
    backend._activate("a")
    weights = {p.untyped_storage().data_ptr() for p in backend.layers[0].parameters()}
    hidden = torch.randn(1, 48, 64, dtype=dtype, requires_grad=True)
    with torch.enable_grad(), SavedBytes(weights) as saved:
        backend.run(hidden, None, range(0, 1))
    shape = ModelShape.from_config(spec.config.to_dict())
    dtype_bytes = torch.finfo(dtype).bits // 8
    assert saved.bytes == graph_bytes_per_token(shape, Lora(8, targets), dtype_bytes) * 48


def test_the_daemons_default_span_is_the_models(monkeypatch):
    """Llama-3-70B in NF4 with 24 GiB free: 28 blocks (35 by the estimate before, base weights x 1.25 in 80 %)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (24 * GIB, 24 * GIB))
    config = json.loads((CONFIGS / "llama-3-70b.json").read_text())
    spec = SimpleNamespace(config=LlamaConfig(**config), num_blocks=80)
    peer = PeerConfig(model="llama-3-70b", initial_peers=[], device="cuda:0", quant="nf4", dtype="bfloat16")
    assert blocks_that_fit(spec, peer) == default_num_blocks(SEED_PEER, 24 * GIB) == 28
    defaults = PeerConfig(model="m", initial_peers=[])
    assert (defaults.activation_cache_mb, defaults.max_inference_mb, defaults.kept_inputs_mb) == (
        ACTIVATION_CACHE_MB,
        MAX_INFERENCE_MB,
        KEPT_INPUTS_MB,
    )
    assert (defaults.replication, defaults.standby_blocks, DEFAULT_IN_FLIGHT) == (2, None, MIN_IN_FLIGHT)


def test_the_default_span_is_the_longest_that_fits():
    free = card_free_bytes(24)
    span = default_num_blocks(SEED_PEER, free)
    assert span == 27  # the seed's spans: ceil(2 x 80 / 6)
    assert breakdown(replace(SEED_PEER, blocks=span)).total <= FREE_SHARE * free
    assert breakdown(replace(SEED_PEER, blocks=span + 1)).total > FREE_SHARE * free
    assert default_num_blocks(SEED_PEER, 1 * GIB) == 1  # nothing fits: one block all the same
    assert default_num_blocks(SEED_PEER, 1000 * GIB) == 80  # never more than the model
    assert default_num_blocks(replace(SEED_PEER, quant="none"), free) < span  # bf16 weights: four times the bytes


def test_the_tokens_bound_fits_and_falls_as_the_span_grows():
    free = card_free_bytes(24)
    by_span = [tokens_in_flight_bound(replace(SEED_PEER, blocks=n), free) for n in (1, 8, 16, 27, 40)]
    assert by_span == sorted(by_span, reverse=True) and by_span[-1] == 0
    by_free = [tokens_in_flight_bound(replace(SEED_PEER, blocks=27), gib * GIB) for gib in (20, 24, 40)]
    assert by_free == sorted(by_free) and by_free[0] < by_free[-1]
    # the bound's tokens of block inputs fit beside everything else, one token more does not
    idle = breakdown(replace(SEED_PEER, blocks=27, in_flight=0, cache_bytes=None)).total
    per_token = 27 * LLAMA_70B.hidden * 2
    bound = by_span[3]
    assert idle + bound * per_token <= FREE_SHARE * free < idle + (bound + 1) * per_token
    with_bound = replace(SEED_PEER, blocks=27, cache_bytes=None, in_flight=bound // SEED_PEER.tokens)
    assert breakdown(with_bound).total <= FREE_SHARE * free


def test_a_sparse_block_keeps_its_experts_unquantized():
    mixtral = ModelShape.from_config(
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    )
    assert (mixtral.experts, mixtral.expert_intermediate, mixtral.mlp_width()) == (8, 14336, 2 * 14336)
    nf4 = block_weight_bytes(mixtral, "nf4", 2)
    assert nf4 == pytest.approx(mixtral.attention_params() * 0.5159 + mixtral.expert_params() * 2, rel=1e-3)
    assert nf4 > block_weight_bytes(replace(mixtral, experts=0), "nf4", 2)
