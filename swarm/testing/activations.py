"""Hidden states shaped like an LLM's residual stream, for tests of the wire's codecs: what plain low-bit
quantization fails on is its few outlier channels."""

from __future__ import annotations

import torch


def residual_stream(seed: int = 0, shape: tuple[int, ...] = (8, 64, 256), outliers: int = 4) -> torch.Tensor:
    """Unit Gaussian noise with ``outliers`` channels (of the last dimension) 50-100x larger."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator)
    channels = torch.randperm(shape[-1], generator=generator)[:outliers]
    x[..., channels] *= torch.linspace(50, 100, outliers)
    return x
