"""LoRA dropout that replays: peers recompute forwards (a backward from a kept input, a replay on another replica), so
each mask is drawn from a generator seeded by (adapter seed, step and counter of the micro-batch, block), never from
the global RNG. Masks are drawn only inside ``dropout_masks`` (a training forward and its recomputes); every other
forward (no-grad evaluation, inference, generation) runs without dropout, as peft does in eval mode."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from peft.tuners.lora import LoraLayer
from torch import nn


@dataclass
class MaskDraws:
    """The generators of one training forward of one micro-batch, one per block, created at their first draw."""

    adapter_seed: int
    micro_batch: str
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    def generator(self, block: int, device: torch.device) -> torch.Generator:
        if block not in self.generators:
            self.generators[block] = torch.Generator(device=device).manual_seed(
                dropout_seed(self.adapter_seed, self.micro_batch, block)
            )
        return self.generators[block]


_DRAWS: ContextVar[MaskDraws | None] = ContextVar("swarm_lora_dropout", default=None)


def dropout_seed(adapter_seed: int, micro_batch: str, block: int) -> int:
    """A 63-bit seed from the adapter seed, the micro-batch's ``step:counter`` and the block. The session part of the
    id is random per client, so it is left out: two runs of the same script draw the same masks."""
    step_and_counter = micro_batch.split(":", 1)[-1]
    digest = hashlib.sha256(f"swarm-dropout:{adapter_seed}:{step_and_counter}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def dropout_masks(adapter_seed: int, micro_batch: str) -> Iterator[None]:
    """While inside, LoRA dropout applies, with masks that depend only on (seed, micro-batch, block) and the order of
    the draws within the block, which a recompute repeats."""
    token = _DRAWS.set(MaskDraws(adapter_seed, micro_batch))
    try:
        yield
    finally:
        _DRAWS.reset(token)


class SeededDropout(nn.Module):
    """``nn.Dropout(p)`` for LoRA inputs, drawing from the current micro-batch's generator of its block; the identity
    outside ``dropout_masks`` (peers keep blocks in eval mode, so the module's own ``training`` flag says nothing)."""

    def __init__(self, p: float, block: int):
        super().__init__()
        self.p, self.block = p, block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draws = _DRAWS.get()
        if draws is None:
            return x
        keep = 1.0 - self.p
        mask = torch.empty_like(x).bernoulli_(keep, generator=draws.generator(self.block, x.device))
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}, block={self.block}"


def seeded_dropout(layer: nn.Module, adapter: str, p: float, block: int) -> None:
    """Replace peft's ``nn.Dropout`` of ``adapter`` in every LoRA layer of a block by a ``SeededDropout``."""
    for module in layer.modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_dropout:
            module.lora_dropout[adapter] = SeededDropout(p, block)
