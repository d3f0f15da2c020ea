"""Adapter files: export the swarm's LoRA tensors as a standard peft adapter folder."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import torch
from safetensors.torch import save_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"


DORA_MAGNITUDE = "lora_magnitude_vector.weight"


def peft_key(block: int, name: str) -> str:
    """The key peft uses for a LoRA tensor of decoder block ``block`` in a causal LM; a DoRA magnitude is saved
    without its module's ``.weight`` suffix (peft's file format predates its DoRA module)."""
    if name.endswith(DORA_MAGNITUDE):
        name = name.removesuffix(".weight")
    return f"base_model.model.model.layers.{block}.{name}"


def save_peft_adapter(
    out_dir: str | Path,
    lora_config: peft.LoraConfig,
    base_model: str,
    tensors: dict[int, dict[str, torch.Tensor]],
    revision: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` would
    (``revision``: the base model's commit, for a model from the hub)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(lora_config)
    config.base_model_name_or_path = base_model
    if revision is not None:
        config.revision = revision
    config.task_type = peft.TaskType.CAUSAL_LM
    config.save_pretrained(str(out))
    flat = {peft_key(block, name): t.contiguous() for block, named in tensors.items() for name, t in named.items()}
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file(flat, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_WEIGHTS)
    return out
