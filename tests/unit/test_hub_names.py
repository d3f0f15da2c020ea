"""A hub model's name, and which shards a span or a client needs (swarm/hub.py), without any server."""

from __future__ import annotations

import pytest

from swarm.hub import model_name, parse_hub_id, resolve_model, shards_for_blocks, shards_for_client
from swarm.net.errors import ModelHubError
from swarm.ops.cli import build_parser
from swarm.spec import load_spec
from swarm.weights import block_digests

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Blocks straddle shards, as transformers' sharding leaves them; the final norm shares a shard with the last block.
WEIGHT_MAP = {
    "model.embed_tokens.weight": "a.safetensors",
    "model.layers.0.self_attn.q_proj.weight": "a.safetensors",
    "model.layers.0.mlp.down_proj.weight": "b.safetensors",
    "model.layers.1.self_attn.q_proj.weight": "b.safetensors",
    "model.layers.1.mlp.down_proj.weight": "c.safetensors",
    "model.layers.2.self_attn.q_proj.weight": "c.safetensors",
    "model.layers.10.self_attn.q_proj.weight": "d.safetensors",
    "model.layers.11.mlp.down_proj.weight": "e.safetensors",
    "model.norm.weight": "e.safetensors",
    "lm_head.weight": "f.safetensors",
}


def test_a_hub_models_name_carries_its_commit_and_is_safe_in_keys_and_paths():
    name = model_name("meta-llama/Llama-3.1-8B", COMMIT)
    assert name == "meta-llama--Llama-3.1-8B@0123456789ab"
    assert "/" not in name and ":" not in name
    assert model_name("meta-llama/Llama-3.1-8B", "f" * 40) != name  # two revisions are two models


def test_hub_ids_are_told_from_folders():
    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_an_id in ("name", "/abs/path", "./org/name", "a/b/c", "../x", "org/..", "org/name@"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_a_span_needs_only_the_shards_holding_its_blocks():
    assert shards_for_blocks(WEIGHT_MAP, range(0, 1)) == ["a.safetensors", "b.safetensors"]
    assert shards_for_blocks(WEIGHT_MAP, range(1, 3)) == ["b.safetensors", "c.safetensors"]
    assert shards_for_blocks(WEIGHT_MAP, [1]) == ["b.safetensors", "c.safetensors"]  # not block 10's or 11's
    assert shards_for_blocks(WEIGHT_MAP, [10, 11]) == ["d.safetensors", "e.safetensors"]
    assert shards_for_blocks(WEIGHT_MAP, []) == []


def test_a_client_needs_only_the_shards_outside_the_blocks():
    assert shards_for_client(WEIGHT_MAP) == ["a.safetensors", "e.safetensors", "f.safetensors"]


def test_a_local_folder_stays_as_it_is(tiny_models):
    source = resolve_model(tiny_models["llama"])
    assert source.folder == tiny_models["llama"] and source.name is None
    assert source.fetch_blocks(load_spec(source.folder).weight_files, range(4)) == []
    assert load_spec(source.folder, name=source.name).name == "tiny-llama"
    assert resolve_model(str(tiny_models["llama"])).repo_id is None
    with pytest.raises(ModelHubError, match="not to a local folder"):
        resolve_model(tiny_models["llama"], revision="main")


def test_a_given_name_is_the_models_name_and_changes_no_digest(tiny_models):
    named = load_spec(tiny_models["llama"], name="org--tiny@0123456789ab")
    assert named.name == "org--tiny@0123456789ab"
    assert block_digests(named) == block_digests(load_spec(tiny_models["llama"]))


def test_swarm_peer_takes_a_hub_id_its_revision_and_a_token():
    args = build_parser().parse_args(["peer", "--model", "org/name@v1", "--token", "hf_x", "--blocks", "0:2"])
    assert (args.model, args.revision, args.token) == ("org/name@v1", None, "hf_x")
    args = build_parser().parse_args(["peer", "--model", "org/name", "--revision", "v2"])
    assert (args.revision, args.token) == ("v2", None)
