"""How a step's gradients add up, the same bits on every replica, standby holder and client that checks them: each
holder sums its own micro-batches' gradients in sorted order (its partial sum, the only gradient it sends), and the
partial sums are added in the order of the ledger's groups (``protocol.ledger_groups``). Every sum is one ``add``
per tensor onto zeros: correctly rounded on every device (see peers/update.py).

With three or more replicas a block's sum is split into chunks (``chunk_of``: the tensors flattened end to end, cut
into equal runs), each reduced by one replica and handed to the others (ARCHITECTURE.md "One reduction per step"):
a sum is elementwise, so a chunk reduced alone is the same bits as that run of the whole sum."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from swarm.net.protocol import Group

MIN_REDUCERS = 3  # with two replicas the direct exchange moves one G each way already: chunks would add a round


def add_up(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The elementwise sum of lists of tensors, in the order given."""
    summed = [torch.zeros_like(t) for t in parts[0]]
    for part in parts:
        for total, tensor in zip(summed, part, strict=True):
            total.add_(tensor)
    return summed


def add_chunks(parts: list[torch.Tensor]) -> torch.Tensor:
    """One chunk of the reduced gradient: that chunk of each partial sum, added in the ledger's group order."""
    return add_up([[part] for part in parts])[0]


def partial_sum(by_mb: dict[str, list[torch.Tensor]], group: Group) -> list[torch.Tensor]:
    """One holder's partial sum: the gradients of its micro-batches (``group``) in sorted order."""
    return add_up([by_mb[mb] for mb in sorted(group)])


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def chunk_bounds(sizes: list[int], chunk: int, chunks: int) -> tuple[int, int]:
    """Where chunk ``chunk`` of ``chunks`` runs in tensors of ``sizes`` values laid end to end: equal runs, the
    first ones a value longer where the total does not divide."""
    if not 0 <= chunk < chunks:
        raise ValueError(f"chunk {chunk} is not one of {chunks}")
    total = sum(sizes)
    base, extra = divmod(total, chunks)
    start = chunk * base + min(chunk, extra)
    return start, start + base + (1 if chunk < extra else 0)


def chunk_of(tensors: list[torch.Tensor], chunk: int, chunks: int) -> torch.Tensor:
    """Chunk ``chunk`` of ``chunks`` of ``tensors`` flattened end to end (a copy of that run only: one tensor on the
    wire)."""
    start, stop = chunk_bounds([t.numel() for t in tensors], chunk, chunks)
    pieces, offset = [], 0
    for t in tensors:
        low, high = max(start, offset), min(stop, offset + t.numel())
        if low < high:
            pieces.append(t.reshape(-1)[low - offset : high - offset])
        offset += t.numel()
    return torch.cat(pieces) if pieces else tensors[0].new_empty(0)


def partial_chunk(by_mb: dict[str, list[torch.Tensor]], group: Group, chunk: int, chunks: int) -> torch.Tensor:
    """That chunk of one holder's partial sum, adding only that run of each gradient: the same bits as
    ``chunk_of(partial_sum(by_mb, group), ...)`` for 1/chunks of the work."""
    return add_chunks([chunk_of(by_mb[mb], chunk, chunks) for mb in sorted(group)])


def from_chunks(chunks: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors shaped as ``like`` whose chunks, in order, are ``chunks``."""
    flat = torch.cat([c.reshape(-1) for c in chunks])
    if flat.numel() != sum(t.numel() for t in like):
        raise ValueError(f"{flat.numel()} values in the chunks, {sum(t.numel() for t in like)} in the tensors")
    parts = flat.split([t.numel() for t in like])
    return [part.reshape(t.shape).to(t.dtype) for part, t in zip(parts, like, strict=True)]


def groups_digest(groups: list[Group]) -> str:
    """Names one block's reduction: its holders' micro-batches, in the order they are added."""
    return hashlib.sha256(repr([list(group) for group in groups]).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ChunkKey:
    """Names one chunk of one block's reduced gradient of a step (peers/reduction/scatter.py)."""

    adapter: str
    step: int
    block: int
    groups: str  # groups_digest of the block's ledger
    chunk: int
    chunks: int
