"""``from_pretrained``'s steps, in order: the model folder (or the hub's files the client needs), then the swarm
joined and the adapter's session opened, its LoRA config checked before anything is joined."""

from __future__ import annotations

from pathlib import Path

import peft
from hivemind import DHT

from swarm.blocks import lora_config_from_wire, lora_config_to_wire
from swarm.client.config import SwarmConfig
from swarm.client.session import AdapterIdentity, AdapterSession, committed_or_raise, open_session
from swarm.hub import ModelSource, resolve_model
from swarm.lora_options import resolve_lora_config
from swarm.net.errors import AdapterStateLostError
from swarm.net.network import initial_peers_or_env, join_dht, load_swarm_key
from swarm.net.security import Identity
from swarm.spec import ModelSpec, load_spec


def model_folder(model_dir: str | Path, config: SwarmConfig) -> tuple[ModelSource, ModelSpec]:
    """Where the model comes from and what it is: a folder, or a hub id's config, tokenizer and the shards of the
    client's own tensors fetched into the Hugging Face cache."""
    source = resolve_model(model_dir, config.revision, config.token)
    spec = load_spec(source.folder, name=source.name)
    source.fetch_client(spec.weight_files)
    return source, spec


def open_adapter(spec: ModelSpec, initial_peers: list[str] | None, config: SwarmConfig) -> AdapterSession:
    """Join the swarm's DHT as a client and open (or resume) the adapter on its peers: a trainer's session, or a
    reader's (``is_trainable=False``), whose LoRA config and seed are the adapter's committed ones."""
    lora_config = config.lora_config
    if lora_config is not None:
        lora_config = resolve_lora_config(lora_config, spec)  # refused options fail here, before joining
    peers = initial_peers_or_env(initial_peers)
    if not peers:
        raise ValueError("pass initial_peers=[...] (multiaddrs printed by `swarm dht`) or set SWARM_INITIAL_PEERS")
    key = load_swarm_key(config.swarm_key)
    identity = Identity.load_or_create(None)
    dht = join_dht(peers, identity, key, client_mode=True, join_timeout=config.patience)
    adapter = _adapter_identity(dht, spec, config, lora_config)
    return open_session(spec, dht, identity, key, peers, adapter, config)


def _adapter_identity(
    dht: DHT, spec: ModelSpec, config: SwarmConfig, lora_config: peft.LoraConfig | None
) -> AdapterIdentity:
    """The adapter as the swarm names it: the LoRA config and seed given, else (a reader) its committed record's;
    the DHT is left if there is none."""
    seed = config.seed
    if lora_config is None:
        try:
            recorded = committed_or_raise(dht, spec, config.adapter)
        except AdapterStateLostError:
            dht.shutdown()
            raise
        lora_config, seed = lora_config_from_wire(recorded.lora), recorded.seed
    return AdapterIdentity(config.adapter, lora_config_to_wire(lora_config), seed)
