"""What a block *is*: a digest of its weights, so that peers and clients agree on a model by its bytes, not by its
folder's name (another fine-tune, revision or renamed copy with the same name is another model).

A block's digest is sha256 over the config fields that shape a block (canonical JSON) and its tensors (name, dtype,
shape, bytes, by name) exactly as the safetensors shards store them: before any cast to the compute dtype or
quantization, so that NF4, int8, bf16 and fp32 peers of the same folder agree. Hashing reads every shard once; the
digests are cached beside the folder (``.swarm-digests.json``, or a per-user cache when the folder is read-only),
keyed by the size and mtime of every shard and of config.json, so that a restart does not hash again and an edited
shard is hashed anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from swarm.spec import ModelSpec

logger = logging.getLogger(__name__)

CACHE_FILE = ".swarm-digests.json"
CACHE_VERSION = 1
CHUNK = 16 << 20
# The config fields that change what a block computes (the rest describe the embeddings, the head, the tokenizer).
BLOCK_CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "max_position_embeddings",
)
# Gemma's: its MLP's activation, the attention's query scaling and logit soft-capping. Mixture-of-experts (Mixtral,
# Qwen3-MoE): how many experts a token goes to, whether their weights are renormalised, the experts' width and which
# blocks are sparse.
FAMILY_BLOCK_FIELDS = (
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "num_local_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def block_config(spec: ModelSpec, block: int) -> str:
    """The config of one block as canonical JSON: what two folders must agree on for their blocks to compute alike."""
    fields = {name: getattr(spec.config, name, None) for name in BLOCK_CONFIG_FIELDS}
    # A family's own fields, only where its config has them (the other families' digests stay as they were).
    fields.update({name: getattr(spec.config, name) for name in FAMILY_BLOCK_FIELDS if hasattr(spec.config, name)})
    fields["attention_kind"] = spec.attention_kind(block)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)


def _header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header: where its data starts, and each tensor's dtype, shape and byte offsets."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _hash_block(spec: ModelSpec, block: int, headers: dict[Path, tuple[int, dict]]) -> str:
    """sha256 of one block: its config, then every tensor (name without the block prefix, dtype, shape, bytes)."""
    digest = hashlib.sha256(b"swarm-block-v1\0")
    digest.update(block_config(spec, block).encode())
    prefix = spec.block_prefix(block)
    for name in spec.tensor_names(prefix):
        path = spec.weight_files[name]
        start, header = headers[path]
        entry = header[name]
        begin, end = entry["data_offsets"]
        meta = json.dumps([name.removeprefix(prefix), entry["dtype"], entry["shape"], end - begin])
        digest.update(b"\0" + meta.encode() + b"\0")
        with path.open("rb") as f:
            f.seek(start + begin)
            left = end - begin
            while left:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{path} ends inside tensor {name}; the shard is truncated")
                digest.update(chunk)
                left -= len(chunk)
    return digest.hexdigest()


def _present(spec: ModelSpec, block: int) -> bool:
    names = spec.tensor_names(spec.block_prefix(block))
    return bool(names) and all(spec.weight_files[name].is_file() for name in names)


def _fingerprint(spec: ModelSpec) -> dict[str, list[int]]:
    """What the cache is valid for: size and mtime of config.json and of every shard that exists."""
    files = {*spec.weight_files.values(), spec.path / "config.json"}
    stats = {}
    for path in sorted(files):
        if path.is_file():
            stat = path.stat()
            stats[path.name] = [stat.st_size, stat.st_mtime_ns]
    return stats


def _cache_paths(spec: ModelSpec) -> list[Path]:
    """Beside the folder first; a per-user cache (keyed by the folder's path) for a folder this user cannot write."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(spec.path.resolve()).encode()).hexdigest()[:16]
    return [spec.path / CACHE_FILE, base / "swarm" / "digests" / f"{key}.json"]


def _read_cache(spec: ModelSpec, fingerprint: dict) -> dict[int, str] | None:
    for path in _cache_paths(spec):
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(cached, dict)
            and cached.get("version") == CACHE_VERSION
            and cached.get("files") == fingerprint
            and isinstance(cached.get("digests"), dict)
        ):
            return {int(block): str(digest) for block, digest in cached["digests"].items()}
    return None


def _write_cache(spec: ModelSpec, fingerprint: dict, digests: dict[int, str]) -> None:
    value = json.dumps({"version": CACHE_VERSION, "files": fingerprint, "digests": digests}, sort_keys=True)
    for path in _cache_paths(spec):
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")  # peers in one process may write at once
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(value)
            os.replace(tmp, path)
            return
        except OSError as e:
            logger.debug("cannot cache block digests at %s: %s", path, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    logger.warning(
        "could not cache the block digests of %s anywhere; they are hashed again at the next start", spec.path
    )


def block_digests(spec: ModelSpec, known: dict[int, str] | None = None) -> dict[int, str]:
    """The digest of every block whose tensors this folder holds (a client's folder may hold none), from the cache
    when the shards did not change since it was written. ``known``: digests of blocks whose shards cannot have changed
    since (a hub snapshot's files are its commit's), kept rather than hashed again when more shards arrive."""
    fingerprint = _fingerprint(spec)
    cached = _read_cache(spec, fingerprint)
    if cached is not None:
        return cached
    present = [block for block in range(spec.num_blocks) if _present(spec, block)]
    kept = {block: known[block] for block in present if known and block in known}
    blocks = [block for block in present if block not in kept]
    headers = {
        path: _header(path)
        for path in {spec.weight_files[n] for b in blocks for n in spec.tensor_names(spec.block_prefix(b))}
    }
    digests = {
        block: _hash_block(spec, block, headers)
        for block in tqdm(blocks, desc=f"hashing the blocks of {spec.name}", unit="block", disable=len(blocks) < 8)
    }
    digests = dict(sorted({**kept, **digests}.items()))
    _write_cache(spec, fingerprint, digests)
    return digests


def differing(mine: dict[int, str], pinned: dict[int, str], blocks: range | list[int]) -> list[int]:
    """The blocks among ``blocks`` whose digest here is not the pinned one (a block pinned but unknown here too)."""
    return [block for block in blocks if block in pinned and mine.get(block) != pinned[block]]
