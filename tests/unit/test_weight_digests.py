"""Block digests (swarm/weights.py): a model is its weights. Stable across restarts (from the cache, not hashed again),
changed by one byte of one tensor, recomputed when a shard changes, and the same whatever dtype a peer computes in."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from swarm import weights
from swarm.net.records import CommittedRecord, ServerRecord, ServerState, announcement, valid_value
from swarm.spec import load_spec
from swarm.testing.tiny import make_tiny_model


@pytest.fixture
def model(tiny_models, tmp_path) -> Path:
    """A private copy of the tiny llama (its shards are edited here)."""
    copy = tmp_path / "tiny-llama"
    shutil.copytree(tiny_models["llama"], copy, ignore=shutil.ignore_patterns(weights.CACHE_FILE))
    return copy


def _no_hashing(*args):
    raise AssertionError("hashed again: the cache was not used")


def test_digests_are_stable_across_restarts_from_the_cache(model, monkeypatch):
    first = weights.block_digests(load_spec(model))
    assert sorted(first) == [0, 1, 2, 3] and len(set(first.values())) == 4
    assert (model / weights.CACHE_FILE).is_file()
    monkeypatch.setattr(weights, "_hash_block", _no_hashing)
    assert weights.block_digests(load_spec(model)) == first  # a restart: read from the cache


def _flip_a_byte_of(model: Path, tensor: str) -> None:
    """Change one byte of ``tensor`` in its shard in place (same size), and move the shard's mtime on."""
    spec = load_spec(model)
    path = spec.weight_files[tensor]
    start, header = weights._header(path)
    offset = start + header[tensor]["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_one_changed_byte_changes_that_block_only_and_invalidates_the_cache(model):
    before = weights.block_digests(load_spec(model))
    _flip_a_byte_of(model, "model.layers.2.mlp.up_proj.weight")
    after = weights.block_digests(load_spec(model))
    assert after[2] != before[2]
    assert {b: d for b, d in after.items() if b != 2} == {b: d for b, d in before.items() if b != 2}
    assert json.loads((model / weights.CACHE_FILE).read_text())["digests"]["2"] == after[2]


def test_a_shard_rewritten_with_the_same_bytes_keeps_its_digest(model, monkeypatch):
    """A changed mtime invalidates the cache; hashing again gives the same digests for the same bytes."""
    before = weights.block_digests(load_spec(model))
    shard = load_spec(model).weight_files["model.layers.0.self_attn.q_proj.weight"]
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    hashed = []
    real = weights._hash_block
    monkeypatch.setattr(weights, "_hash_block", lambda *a: hashed.append(a[1]) or real(*a))
    assert weights.block_digests(load_spec(model)) == before
    assert hashed == [0, 1, 2, 3]


def test_a_folder_it_cannot_write_caches_per_user(model, tmp_path, monkeypatch):
    """Beside the folder fails (here: its place is under a file, which even root cannot write into); the per-user
    cache holds the digests instead, and a restart reads them from there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = weights._cache_paths
    monkeypatch.setattr(weights, "_cache_paths", lambda spec: [model / "config.json" / "cache", *real(spec)[1:]])
    first = weights.block_digests(load_spec(model))
    assert len(list((tmp_path / "cache" / "swarm" / "digests").glob("*.json"))) == 1
    monkeypatch.setattr(weights, "_hash_block", _no_hashing)
    assert weights.block_digests(load_spec(model)) == first


def test_a_look_alike_has_other_digests_and_the_same_config(model, tmp_path):
    """Same folder name, same config, other random weights: every block differs."""
    other = make_tiny_model(tmp_path / "elsewhere" / "tiny-llama", family="llama", layers=4, seed=2)
    ours, theirs = load_spec(model), load_spec(other)
    assert ours.name == theirs.name and weights.block_config(ours, 0) == weights.block_config(theirs, 0)
    mine, others = weights.block_digests(ours), weights.block_digests(theirs)
    assert weights.differing(mine, others, range(4)) == [0, 1, 2, 3]
    assert weights.differing(mine, {}, range(4)) == []


def test_records_carry_digests_and_refuse_malformed_ones():
    digests = {2: "a" * 64, 3: "b" * 64}
    record = ServerRecord(b"x", ServerState.ONLINE, 2, 4, 1.0, digests=digests)
    value = record.to_value()
    said = announcement([(record, range(2, 4))], 0.0)
    assert valid_value(said) and ServerRecord.from_value(b"x", value).digests == digests
    assert not record.conflicts(digests) and record.conflicts({3: "c" * 64}) and not record.conflicts({0: "c" * 64})
    assert ServerRecord(b"x", ServerState.ONLINE, 2, 4, 1.0).conflicts(digests)  # announcing none: other weights
    assert not valid_value({**said, "entries": [{**said["entries"][0], "digests": {"2": "not hex"}}]})
    committed = CommittedRecord(3, {}, 1, "me", weights=digests)
    assert CommittedRecord.from_value(committed.to_value()) == committed
    assert not valid_value({**committed.to_value(), "weights": {"x": "a" * 64}})


def test_a_client_without_block_tensors_pins_what_most_peers_announce_and_keeps_it():
    """The router pins each block once, when it first sees it served, to the digest most online peers announce;
    a look-alike appearing later, however many, changes nothing."""
    from swarm.client.routing import Router

    honest, other = "a" * 64, "b" * 64

    def record(peer: int, digest: str) -> ServerRecord:
        return ServerRecord(bytes([peer]) * 8, ServerState.ONLINE, 0, 1, 1.0, digests={0: digest})

    router = Router(None, None, "m", 2)
    router._pin({0: [record(1, honest), record(2, honest), record(3, other)], 1: []})
    assert router.weights == {0: honest}
    router._pin({0: [record(4, other), record(5, other), record(6, other)], 1: []})
    assert router.weights == {0: honest}
