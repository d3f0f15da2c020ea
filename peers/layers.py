"""Running loaded decoder blocks as the family's own model runs them: masks and rotary embeddings built alike."""

from __future__ import annotations

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
    mask_args = dict(
        config=spec.config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    masks: dict[str, torch.Tensor | None] = {}
    position_embeddings = rotary(hidden, position_ids)
    for block in blocks:
        kind = spec.attention_kind(block)
        if kind not in masks:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            masks[kind] = make(**mask_args, layer_idx=block if cache is not None else None)
        hidden = layers[block](
            hidden,
            attention_mask=masks[kind],
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            cache=cache,
            use_cache=cache is not None,
        )
    return hidden
