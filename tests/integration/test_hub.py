"""Models by hub id (swarm/hub.py) against a local hub (swarm/testing/hubserver.py) through huggingface_hub's own
client: a span fetches only its shards, a move only the new ones, gated repositories, resumed transfers, offline from
the cache, and peers and a client started from the hub id training like local peft."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

import swarm
from peers.config import PeerConfig
from peers.daemon import PeerDaemon
from peers.movecost import ASSUMED_DOWNLOAD_RATE
from peers.placement import Move
from swarm.hub import model_name, resolve_model, shards_for_blocks, shards_for_client
from swarm.net.errors import ModelHubError
from swarm.spec import load_spec, load_tokenizer
from swarm.testing.hubserver import HubServer
from swarm.testing.parity import HPARAMS, local_peft
from swarm.testing.tiny import make_tiny_chat_tokenizer, make_tiny_model
from swarm.weights import block_digests

REPO = "org/tiny"
SMALL = {"config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json"}
SHARD_BYTES = 150_000  # about one block of the tiny llama per shard (blocks straddle two)


def shards(hub: HubServer) -> set[str]:
    """The shards whose transfer the hub began."""
    return {file for file in hub.fetched() if file.endswith(".safetensors")}


@pytest.fixture(scope="module")
def repo_folder(tmp_path_factory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("hub") / "tiny", layers=4, seed=1, max_shard_size=SHARD_BYTES)
    make_tiny_chat_tokenizer(folder)
    return folder


@pytest.fixture
def weight_map(repo_folder) -> dict[str, str]:
    return json.loads((repo_folder / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.fixture
def hub(repo_folder, tmp_path, monkeypatch):
    """A local hub serving the tiny llama as org/tiny; this test's own HF cache, endpoint and no token or offline."""
    with HubServer() as server:
        server.add_repo(REPO, repo_folder)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        yield server


def test_a_span_fetches_the_small_files_and_only_its_shards(hub, weight_map):
    source = resolve_model(REPO)
    assert source.commit == hub.repos[REPO].refs["main"]
    assert source.name == model_name(REPO, source.commit) == f"org--tiny@{source.commit[:12]}"
    assert set(hub.fetched()) >= SMALL and set(hub.fetched()).isdisjoint(weight_map.values())  # no shard yet
    spec = load_spec(source.folder, name=source.name)
    assert spec.name == source.name and spec.num_blocks == 4
    assert load_tokenizer(REPO).convert_tokens_to_ids("w9") == 9  # from the cache: the tokenizer came along

    hub.clear()
    fetched = source.fetch_blocks(spec.weight_files, range(2, 4))
    needed = shards_for_blocks(weight_map, range(2, 4))
    assert sorted(fetched) == needed and set(hub.fetched()) == set(needed)
    assert all(count == 1 for count in hub.fetched().values())
    assert len(needed) < len(set(weight_map.values()))  # the other blocks' shards stayed on the hub
    local = block_digests(load_spec(hub.repos[REPO].commits[source.commit].folder))
    assert block_digests(spec) == {2: local[2], 3: local[3]}


def test_a_move_fetches_just_the_new_shards_and_refreshes_the_digests(hub, weight_map, tmp_path):
    """The peer's own fetch (its loader's): before loading a span (start or move) it downloads that span's shards,
    then holds the digests of every block now here, as it announces them."""
    daemon = PeerDaemon(
        PeerConfig(model=REPO, initial_peers=[], blocks=range(2, 4), identity=str(tmp_path / "peer.key"))
    )
    assert daemon.spec.name == model_name(REPO, hub.repos[REPO].refs["main"])
    loader, now = daemon.loader, daemon.standing
    now.digests = block_digests(daemon.spec)
    assert now.digests == {}  # only the small files so far
    local = block_digests(load_spec(hub.repos[REPO].commits[daemon.source.commit].folder))

    before = loader.timer.cost()  # what it would announce: every block downloaded first, none on disk
    assert before.on_disk == () and before.fetch > before.load
    assert before.fetch == pytest.approx(daemon.source.bytes_per_block(4) / ASSUMED_DOWNLOAD_RATE)

    hub.clear()
    now.digests = loader.fetch(range(2, 4))
    first = set(hub.fetched())
    assert first == set(shards_for_blocks(weight_map, range(2, 4)))
    assert now.digests_of(range(2, 4)) == {2: local[2], 3: local[3]}
    whole = {b for b in range(4) if set(shards_for_blocks(weight_map, [b])) <= first}
    assert {2, 3} <= whole and set(daemon.source.blocks_on_disk(daemon.spec.weight_files, 4)) == whole
    after = loader.timer.cost()
    assert after.seconds(range(0, 2), range(2, 4)) == 2 * after.load < before.seconds(range(0, 2), range(2, 4))

    hub.clear()
    now.digests = loader.fetch(range(0, 2))
    assert set(hub.fetched()) == set(shards_for_blocks(weight_map, range(0, 2))) - first
    assert now.digests == local
    hub.clear()
    assert loader.fetch(range(1, 3)) is None and hub.fetched() == {}  # all here: nothing fetched or hashed


def test_a_client_fetches_only_the_shards_outside_the_blocks(hub, weight_map):
    source = resolve_model(REPO)
    hub.clear()
    spec = load_spec(source.folder, name=source.name)
    source.fetch_client(spec.weight_files)
    assert set(hub.fetched()) == set(shards_for_client(weight_map))
    assert set(hub.fetched()) != set(weight_map.values())


def test_a_gated_repo_says_what_to_do_without_a_token_and_works_with_one(hub, repo_folder, weight_map, monkeypatch):
    hub.add_repo("org/gated", repo_folder, gated=True, token="hf_secret")
    with pytest.raises(ModelHubError, match=r"pass --token or set HF_TOKEN, and accept the license at .*/org/gated"):
        resolve_model("org/gated")
    with pytest.raises(ModelHubError, match="pass --token or set HF_TOKEN"):
        resolve_model("org/gated", token="hf_wrong")
    source = resolve_model("org/gated", token="hf_secret")
    spec = load_spec(source.folder, name=source.name)
    assert source.fetch_blocks(spec.weight_files, [0])
    assert hub.of(shards_for_blocks(weight_map, [0])[0])[0].authorized  # its HEAD on the hub carried the token
    # the token stays on the hub: the CDN's signed URLs get none
    assert not any(entry.authorized for entry in hub.requests if entry.server == "cdn")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert resolve_model("org/gated").commit == source.commit


def test_an_unknown_repo_or_revision_says_so(hub):
    with pytest.raises(ModelHubError, match="no model repository org/nothing"):
        resolve_model("org/nothing")
    with pytest.raises(ModelHubError, match="has no revision 'v9'"):
        resolve_model(f"{REPO}@v9")
    with pytest.raises(ModelHubError, match="two revisions given"):
        resolve_model(f"{REPO}@main", revision="v2")


def test_two_revisions_are_two_models(hub, repo_folder, tmp_path):
    import shutil

    other = shutil.copytree(repo_folder, tmp_path / "v2")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    second = hub.add_repo(REPO, other, revision="v2")
    first = resolve_model(REPO)
    by_id, by_argument = resolve_model(f"{REPO}@v2"), resolve_model(REPO, revision="v2")
    assert by_id.commit == by_argument.commit == second != first.commit
    assert by_id.name == by_argument.name != first.name
    assert resolve_model(f"{REPO}@{second}").name == by_id.name  # a commit given names the same model


def test_a_cut_transfer_resumes_where_it_stopped(hub, tmp_path):
    """A transfer cut midway goes on from where it stopped (huggingface_hub yields what it received in chunks of 10
    MB: the file must be larger than that for a resumption to have a start). A single-file checkpoint has no index:
    it comes whole at resolve."""
    folder = make_tiny_model(
        tmp_path / "big", layers=1, hidden=512, heads=8, kv_heads=8, intermediate=4096, max_shard_size="1GB"
    )
    single = folder / "model.safetensors"
    size = single.stat().st_size
    assert size > 20 << 20 and not (folder / "model.safetensors.index.json").exists()
    hub.add_repo("org/big", folder)
    hub.cut_once("model.safetensors")
    source = resolve_model("org/big")
    transfers = [entry for entry in hub.of("model.safetensors") if entry.server == "cdn" and entry.method == "GET"]
    assert [entry.cut for entry in transfers] == [True, False]
    assert transfers[0].range is None and transfers[1].status == 206
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", transfers[1].range)[1])
    assert 0 < resumed_at < size
    assert (source.folder / "model.safetensors").read_bytes() == single.read_bytes()
    assert load_spec(source.folder, name=source.name).num_blocks == 1


def test_offline_resolves_from_the_cache_and_says_what_is_missing(hub, weight_map, monkeypatch):
    source = resolve_model(REPO)
    spec = load_spec(source.folder, name=source.name)
    source.fetch_blocks(spec.weight_files, range(2, 4))
    hub.stop()
    with pytest.raises(ModelHubError, match="cannot reach .* set HF_HUB_OFFLINE=1"):
        resolve_model(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = resolve_model(REPO)
    assert (again.folder, again.commit, again.name) == (source.folder, source.commit, source.name)
    assert again.fetch_blocks(spec.weight_files, range(2, 4)) == []
    assert resolve_model(f"{REPO}@{source.commit}").name == source.name
    with pytest.raises(ModelHubError, match="HF_HUB_OFFLINE is set and the cache .* lacks shard"):
        again.fetch_blocks(spec.weight_files, range(0, 2))
    with pytest.raises(ModelHubError, match="HF_HUB_OFFLINE is set and the cache .* holds no org/tiny@v2"):
        resolve_model(REPO, revision="v2")


def test_peers_and_a_client_from_the_hub_id_train_like_local_peft(
    hub, weight_map, repo_folder, inprocess_swarm, tmp_path, monkeypatch
):
    """Two peers start from the hub id on blocks 0:2 (one cache: the shards of 0:2 come once), one moves to 0:4
    and fetches just the shards of 2:4 for it; a client from the hub id (a cache of its own) fetches only the shards
    it reads, agrees with the peers on the model's name, and trains one step exactly as local peft."""
    local = inprocess_swarm(model=REPO)
    peers = local.start_peers({"a": "0:2", "b": "0:2"})
    name = model_name(REPO, hub.repos[REPO].refs["main"])
    assert {peer.daemon.spec.name for peer in peers.values()} == {name}
    assert shards(hub) == set(shards_for_blocks(weight_map, range(0, 2)))

    hub.clear()
    b = peers["b"]
    moved = b.daemon.mover.move(Move(range(0, 4), "a test moves it"))
    asyncio.run_coroutine_threadsafe(moved, b._loop).result(timeout=60)
    now = b.daemon.standing
    assert now.serving == range(0, 4)
    assert shards(hub) == set(shards_for_blocks(weight_map, range(2, 4))) - set(
        shards_for_blocks(weight_map, range(0, 2))
    )
    local_digests = block_digests(load_spec(repo_folder))
    assert now.digests_of(now.serving) == local_digests  # what it announces for its new span
    assert b.adapters.weight_digests == local_digests  # what it checks adapters' pins against
    (announced, _), *_ = asyncio.run_coroutine_threadsafe(b.daemon.announcer.records(), b._loop).result(timeout=10)
    assert announced.cost is not None and announced.cost.on_disk == ((0, 4),)  # a move back downloads nothing

    # the client on a machine of its own: a cache of its own, where only the shards it reads arrive
    hub.clear()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "client-hf"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        REPO, initial_peers=local.initial_peers, adapter="hub-lora", lora_config=lora
    )
    try:
        assert model.spec.name == name
        assert shards(hub) == set(shards_for_client(weight_map)) != set(weight_map.values())
        assert (tmp_path / "client-hf") in model.spec.path.parents
        model.save_adapter(tmp_path / "initial")
        ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
        batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        out = model(**batch)
        out.loss.backward()
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        optimizer.step()
        optimizer.zero_grad()
        swarm_loss = out.loss.item()
        model.save_adapter(tmp_path / "final")
        assert model.step == 1
        saved = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
        assert (saved["base_model_name_or_path"], saved["revision"]) == (REPO, hub.repos[REPO].refs["main"])
    finally:
        model.shutdown()
    reference = local_peft(repo_folder, tmp_path / "initial")
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **HPARAMS)
    local_out = reference(**batch)
    local_out.loss.backward()
    reference_optimizer.step()
    reference.save_pretrained(tmp_path / "local")
    assert swarm_loss == pytest.approx(local_out.loss.item(), rel=1e-5)
    swarm_state = load_file(tmp_path / "final" / "adapter_model.safetensors")
    local_state = load_file(tmp_path / "local" / "adapter_model.safetensors")
    assert swarm_state.keys() == local_state.keys()
    for key in swarm_state:
        torch.testing.assert_close(swarm_state[key], local_state[key], rtol=1e-4, atol=1e-5, msg=key)
