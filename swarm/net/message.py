"""What travels in one call, before any method gives it a meaning: a metadata map and tensors. Its own module so that
the schemas (swarm.net.protocol) and the bytes (swarm.net.wire) can both use it without importing each other."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from hivemind.proto import runtime_pb2


@dataclass
class Message:
    """A method name or error in ``meta``, and tensors."""

    meta: dict
    tensors: list[torch.Tensor]
    compression: int = runtime_pb2.CompressionType.NONE  # for floating tensors (swarm.net.compression)


def payload_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
