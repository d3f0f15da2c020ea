"""LoRA dropout that replays: peers recompute forwards (a backward from a kept input, a replay on another replica), so
each mask is a hash of (adapter seed, step and counter of the micro-batch, block, draw) and the element's index, never
a draw from the global RNG or a device's generator: the same masks on every device. Masks are drawn only inside
``dropout_masks`` (a training forward and its recomputes); every other forward (no-grad evaluation, inference,
generation) runs without dropout, as peft does in eval mode."""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

M32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # below 2**27: a 32-bit value times it stays below 2**59, exact in int64 on every device


@dataclass
class MaskDraws:
    """The draws of one training forward of one micro-batch: per block, how many masks it drew so far."""

    adapter_seed: int
    micro_batch: str
    draws: dict[int, int] = field(default_factory=dict)

    def key(self, block: int) -> int:
        """A 64-bit key for the block's next mask: the order of draws within a block is what a recompute repeats."""
        count = self.draws[block] = self.draws.get(block, -1) + 1
        digest = hashlib.sha256(f"{dropout_seed(self.adapter_seed, self.micro_batch, block)}:{count}".encode())
        return int.from_bytes(digest.digest()[:8], "little")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) in int64 arithmetic, exact on any device."""
    x = ((x >> 16) ^ x) * MIX & M32
    x = ((x >> 16) ^ x) * MIX & M32
    return (x >> 16) ^ x


def keep_mask(shape: torch.Size, keep: float, key: int, device: torch.device) -> torch.Tensor:
    """Which elements dropout keeps, each with probability ``keep`` (to 2**-24), from ``key`` and the element's index
    alone: the same bits on a CPU and on any GPU, where a device's own generator would draw others (a replay or a spot
    check of the micro-batch on another device would then compute other gradients)."""
    index = torch.arange(math.prod(shape), device=device, dtype=torch.int64)
    bits = _mix(_mix(index ^ (key & M32)) ^ (key >> 32))
    return ((bits >> 8) < round(keep * 2**24)).reshape(shape)


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
        return x * keep_mask(x.shape, keep, draws.key(self.block), x.device).to(x.dtype) / keep

    def extra_repr(self) -> str:
        return f"p={self.p}, block={self.block}"


def seeded_dropout(layer: nn.Module, adapter: str, p: float, block: int) -> None:
    """Replace peft's ``nn.Dropout`` of ``adapter`` in every LoRA layer of a block by a ``SeededDropout``."""
    for module in layer.modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_dropout:
            module.lora_dropout[adapter] = SeededDropout(p, block)
