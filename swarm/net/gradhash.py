"""Gradient hashes on the wire: what the holder of a micro-batch's LoRA gradients on a block says they are, with the
backward's reply, so that a replica fetching them at commit (and a spot check) can tell whether the holder handed on
the gradients it computed.

The hash is canonical: sha256 over each tensor's dtype, shape and bytes, in the block's fixed parameter order (the
order ``add_lora`` gives every replica), so that the same gradients hash alike on every peer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import torch

from swarm.net import hostsync

HASH = re.compile(r"[0-9a-f]{64}")


def grad_hash(tensors: Sequence[torch.Tensor]) -> str:
    """The canonical sha256 of one block's LoRA gradients for one micro-batch (hex)."""
    return grad_hashes([tensors])[0]


def grad_hashes(blocks: Sequence[Sequence[torch.Tensor]]) -> list[str]:
    """``grad_hash`` of each block's gradients, from one flat copy of them all on the host: a span's blocks and LoRA
    tensors cost the device one copy, not one each (swarm/net/hostsync.py)."""
    flat = hostsync.flat_bytes([t for tensors in blocks for t in tensors]).numpy()
    hashes, offset = [], 0
    for tensors in blocks:
        digest = hashlib.sha256(f"{len(tensors)}\n".encode())
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            digest.update(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}\n".encode())
            digest.update(memoryview(flat[offset : offset + size]))
            offset += size
        hashes.append(digest.hexdigest())
    return hashes


def read_grad_hash(value: object) -> str:
    """A hash as the wire carries it (64 lowercase hex digits); raises ValueError."""
    if not isinstance(value, str) or not HASH.fullmatch(value):
        raise ValueError(f"{value!r} is not a sha256 gradient hash (64 lowercase hex digits)")
    return value
