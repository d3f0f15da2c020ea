"""Every place the peer's hot path waits for its device: a copy of tensors to the host, or values read there (a
sync). On a GPU each one stalls the compute stream, so the path does a fixed few per micro-batch and per commit,
batched over the span's blocks and LoRA tensors; the counts here are what tests/unit/test_host_syncs.py holds to that.
On a CPU the same calls run and count alike, so the test needs no GPU."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

import torch

counts: Counter[str] = Counter()  # "syncs" and "copies" since the process started; read through ``counted``


@contextlib.contextmanager
def counted() -> Iterator[Counter[str]]:
    """The syncs and copies made while inside (filled in on exit)."""
    start = counts.copy()
    seen: Counter[str] = Counter()
    try:
        yield seen
    finally:
        seen.update({key: counts[key] - start[key] for key in ("syncs", "copies")})


def values(tensor: torch.Tensor) -> list:
    """The values of a (small) tensor on the host, for one sync."""
    counts["syncs"] += 1
    return tensor.tolist()


def flat_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` (on one device), laid end to end in one flat uint8 tensor on the host, for one copy:
    joined on the device, then copied at once (into pinned memory, on CUDA)."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    counts["copies"] += 1
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    return _pinned_copy(flat) if flat.device.type != "cpu" else flat


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (on one device), as their own tensors, never views of the device ones or of one
    another (a checkpoint saves each alone), for one copy (``flat_bytes``; on the CPU a plain clone each)."""
    if not tensors:
        return []
    if tensors[0].device.type != "cpu":
        pieces = flat_bytes(tensors).split([t.numel() * t.element_size() for t in tensors])
        return [piece.clone().view(t.dtype).reshape(t.shape) for piece, t in zip(pieces, tensors, strict=True)]
    counts["copies"] += 1
    return [t.detach().clone() for t in tensors]


def one_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """One tensor on the host (a forward's or a backward's output, for the wire), for one copy; a tensor there
    already is handed on as it is."""
    counts["copies"] += 1
    return tensor if tensor.device.type == "cpu" else _pinned_copy(tensor.detach())


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into pinned host memory without a pageable bounce, waited for."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host
