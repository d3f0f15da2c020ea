"""What the host reads of a span's gradients, in one sync for all its blocks and LoRA tensors: each tensor's norms
(a backward's reply, a clipping share) and each block's finiteness (a commit's check). One ``float()`` or
``isfinite`` per tensor was a device sync each: ~750 per backward of a 70B span."""

from __future__ import annotations

import functools
import math

import torch

from swarm.net import hostsync


def tensor_norms(blocks: list[list[torch.Tensor]], norm_types: tuple[float, ...]) -> list[list[tuple[float, ...]]]:
    """Per block, per tensor, its ``norm_types``-norms (each computed alone, in the tensor's dtype, as
    ``torch.linalg.vector_norm`` does: the same values as one ``float()`` each). An empty tensor's inf-norm is 0."""
    norms = [_norm(t, p) for tensors in blocks for t in tensors for p in norm_types]
    if not norms:
        return [[] for _ in blocks]
    dtype = functools.reduce(torch.promote_types, {n.dtype for n in norms}, torch.float32)  # exact for every norm
    flat = iter(hostsync.values(torch.stack([n.to(dtype) for n in norms])))
    return [[tuple(next(flat) for _ in norm_types) for _ in tensors] for tensors in blocks]


def _norm(tensor: torch.Tensor, norm_type: float) -> torch.Tensor:
    if math.isinf(norm_type) and not tensor.numel():
        return tensor.new_zeros(())
    return torch.linalg.vector_norm(tensor, norm_type)


def finite(blocks: list[list[torch.Tensor]]) -> list[bool]:
    """Per block, whether every value of its tensors is finite."""
    flags = [torch.stack([torch.isfinite(t).all() for t in tensors]).all() for tensors in blocks if tensors]
    read = iter(hostsync.values(torch.stack(flags)) if flags else [])
    return [next(read) if tensors else True for tensors in blocks]
