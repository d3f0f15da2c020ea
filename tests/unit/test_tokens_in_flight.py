"""The bound on tokens in flight (issue 57): how a peer counts and refuses, what its default is at the seed's case,
how it is announced, and how a client sizes its pipeline by the bounds announced."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from transformers import LlamaConfig

from peers.config import PeerConfig, max_tokens_in_flight
from peers.state import TokensInFlight
from swarm.client.routing import MIN_IN_FLIGHT, Router, RouterOptions
from swarm.memory import (
    ACTIVATION_CACHE_MB,
    GIB,
    MAX_INFERENCE_MB,
    MemoryInputs,
    ModelShape,
    breakdown,
    default_tokens_in_flight,
    load_shape,
    tokens_in_flight_bound,
)
from swarm.net.errors import ErrorKind, RemoteError, TokensInFlightError
from swarm.net.protocol import PEER_STATE_ERRORS
from swarm.net.records import ServerRecord, ServerState
from swarm.net.transport import Transport
from swarm.planning import CONFIGS

# Llama-3-70B on a 24 GiB card as the daemon sizes it by default (tests/unit/test_memory_model.py's seed peer)
SEED_PEER = MemoryInputs(
    load_shape(CONFIGS / "llama-3-70b.json"),
    "nf4",
    dtype_bytes=2,
    cache_bytes=ACTIVATION_CACHE_MB << 20,
    inference_bytes=MAX_INFERENCE_MB << 20,
)


def test_a_peer_admits_up_to_its_bound_and_refuses_past_it():
    ledger = TokensInFlight(bound=100)
    ledger.admit(("a", "mb0", 0, 4), 60)
    ledger.admit(("a", "mb0", 0, 4), 60)  # the same forward again counts once
    ledger.admit(("a", "mb1", 0, 4), 40)
    assert ledger.tokens == 100
    with pytest.raises(TokensInFlightError) as refused:
        ledger.admit(("a", "mb2", 0, 4), 1)
    assert refused.value.kind == ErrorKind.TOKENS_IN_FLIGHT == "tokens_in_flight"
    assert "--max-tokens-in-flight of 100" in str(refused.value) and "max_in_flight" in str(refused.value)
    ledger.end(("a", "mb0", 0, 4))  # its backward ran
    ledger.admit(("a", "mb2", 0, 4), 60)
    assert (ledger.tokens, ledger.peak) == (100, 100)


def test_one_micro_batch_always_goes_and_entries_end_with_their_step_or_blocks():
    ledger = TokensInFlight(bound=10)
    ledger.admit(("a", "mb0", 0, 4), 500)  # nothing in flight: a bound below one micro-batch does not lock the peer
    with pytest.raises(TokensInFlightError):
        ledger.admit(("b", "mb0", 4, 8), 1)
    ledger.drop_adapter("a")  # its step applied or taken back
    ledger.admit(("b", "mb0", 4, 8), 5)
    ledger.drop_touching({7})  # blocks no longer served
    assert ledger.tokens == 0 and not ledger.entries


def test_the_refusal_travels_as_its_own_kind():
    error = RemoteError(TokensInFlightError.kind, "past the bound")
    assert error.kind == "tokens_in_flight"
    assert ErrorKind.TOKENS_IN_FLIGHT in PEER_STATE_ERRORS  # the client routes around it: the peer is busy


def test_the_default_bound_is_the_memory_models_at_the_seeds_case():
    """Llama-3-70B in NF4 and bf16 on a card with 24 GiB free, 27 blocks. The activation cache (1 GiB) and the
    micro-batch computing fit in what the span leaves for block inputs, and block inputs past the cache are
    recomputed from span inputs in host memory: in-flight micro-batches never fill the card, the host's
    --kept-inputs-mb (4 GiB, fp32 span inputs) does first: 131,072 tokens. With a cache larger than the card's room,
    the room bounds them: every block input of that many tokens on the card beside the rest. Told, the told one."""
    config = json.loads((CONFIGS / "llama-3-70b.json").read_text())
    spec = SimpleNamespace(config=LlamaConfig(**config), num_blocks=80)
    peer = PeerConfig(model="llama-3-70b", initial_peers=[], device="cuda:0", quant="nf4", dtype="bfloat16")
    free = 24 * GIB
    hidden = ModelShape.from_config(config).hidden
    assert max_tokens_in_flight(spec, peer, 27, free) == (4096 << 20) // (hidden * 4) == 131_072
    assert max_tokens_in_flight(spec, peer, 27, free) == default_tokens_in_flight(_seed(27), free, 4096 << 20)

    roomy_cache = replace(peer, activation_cache_mb=8192)
    bound = max_tokens_in_flight(spec, roomy_cache, 27, free)
    assert bound == tokens_in_flight_bound(_seed(27), free)
    assert 2 * 2048 <= bound < 40 * 2048
    per_token = 27 * hidden * 2
    idle = breakdown(_seed(27, in_flight=0, cache_bytes=None))
    assert idle.total + bound * per_token <= 0.9 * free < idle.total + (bound + 1) * per_token
    assert max_tokens_in_flight(spec, roomy_cache, 30, free) < bound  # a longer span leaves less room
    assert max_tokens_in_flight(spec, peer, 80, free) == 2048  # nothing left: one micro-batch at a time
    told = PeerConfig(model="m", initial_peers=[], max_tokens_in_flight=4096)
    assert max_tokens_in_flight(spec, told, 27, free) == 4096


def _seed(blocks: int, **changes) -> MemoryInputs:
    return replace(SEED_PEER, blocks=blocks, **changes)


def test_the_bound_is_announced_in_the_record():
    record = ServerRecord(PeerID(b"\x01" * 34), ServerState.ONLINE, 0, 4, 1.0, max_tokens_in_flight=4096)
    assert ServerRecord.from_value(record.peer_id, record.to_value()).max_tokens_in_flight == 4096
    silent = ServerRecord(record.peer_id, ServerState.ONLINE, 0, 4, 1.0)
    assert "max_tokens_in_flight" not in silent.to_value()
    assert ServerRecord.from_value(record.peer_id, silent.to_value()).max_tokens_in_flight == 0


def _router(bounds: dict[int, tuple[int, int, int]]) -> Router:
    """Peers i -> (start, end, their announced bound) of a 4-block model."""
    router = Router(None, Transport(p2p=None), "m", 4, RouterOptions(seed=0))
    records = [
        ServerRecord(PeerID(bytes([i]) * 34), ServerState.ONLINE, s, e, 1.0, max_tokens_in_flight=b)
        for i, (s, e, b) in bounds.items()
    ]
    router.servers = {block: [r for r in records if r.start <= block < r.end] for block in range(4)}
    return router


def test_the_client_sends_no_more_at_once_than_the_tightest_blocks_servers_admit():
    # blocks 0:2 have two servers admitting 3 and 2 micro-batches of 1000 tokens; 2:4 one admitting 4
    router = _router({1: (0, 2, 3000), 2: (0, 2, 2500), 3: (2, 4, 4000)})
    assert router.in_flight() == max(MIN_IN_FLIGHT, 6)  # micro-batches of unknown size: two per server
    assert router.in_flight(1000) == 4  # 0:2 admits 3 + 2, 2:4 admits 4
    assert router.in_flight(2000) == 2  # 1 + 1 on 0:2, 2 on 2:4
    assert router.in_flight(10_000) == 1  # none admits one: one at a time, which every peer takes
    assert _router({1: (0, 4, 0)}).in_flight(1000) == MIN_IN_FLIGHT  # a peer that says nothing bounds nothing
