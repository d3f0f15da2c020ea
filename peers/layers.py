"""Running loaded decoder blocks as the family's own model runs them: masks and rotary embeddings built alike."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from swarm.spec import ModelSpec


def run_layers(
    spec: ModelSpec,
    layers: dict[int, nn.Module],
    rotary: nn.Module,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    blocks: range,
    cache: DynamicCache | None = None,
    position: int = 0,
) -> torch.Tensor:
    """``blocks`` of ``layers`` on ``hidden``. With a ``cache`` (generation), ``hidden`` holds the tokens after the
    ``position`` ones it already holds, and ``attention_mask`` (if any) covers them all: positions count real
    tokens only, as transformers' ``generate`` numbers left-padded prompts."""
    length = hidden.shape[1]
    if cache is not None and attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, -length:]
    else:
        position_ids = torch.arange(position, position + length, device=hidden.device).unsqueeze(0)
    # no position_ids for the masks: ours are one run per row, never packed sequences, and transformers reads them
    # back to the host to look for packing (a sync per mask, per block where the span runs one block at a time)
    mask_args = dict(config=spec.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache)
    masks: dict[str, torch.Tensor | None] = {}
    position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for block in blocks:
        kind = spec.attention_kind(block)
        if kind not in masks:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            masks[kind] = make(**mask_args, layer_idx=block if cache is not None else None)
            position_embeddings[kind] = _rotary(rotary, hidden, position_ids, kind)
        hidden = layers[block](
            hidden,
            attention_mask=masks[kind],
            position_ids=position_ids,
            position_embeddings=position_embeddings[kind],
            cache=cache,
            use_cache=cache is not None,
        )
    return hidden


def _rotary(
    rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin a block of attention ``kind`` takes: one rotary for all blocks, or, where the family's rotary
    module holds one per layer type (Gemma 3: local and global bases, the global one scaled), that type's own."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(hidden, position_ids, kind)
    return rotary(hidden, position_ids)
