"""Linear sketches of gradients, so that an audit of a holder's partial sum does not grow with the step's
micro-batches (issue 59). A holder hands each partial sum (or chunk of one) with a sketch of every micro-batch
gradient in it: ``ROWS`` random +-1 projections of the values, the signs drawn from a seed that is the hash of the
partial sum as sent. The projection is linear, so the partial sum's sketch equals the sum of its micro-batches'
within the rounding of the sum (``sum_agrees``); and since the signs are known only once the sum is fixed, a holder
that changes its sum by ``e`` must also change some micro-batch's sketch by the projection of ``e`` (a change whose
projection stays inside the rounding bound is as small as the fp rounding of the sum itself: see ``SLACK``). An
auditor then fetches one micro-batch gradient, drawn at random: it must hash as its holder reported with its backward
and project to its reported sketch (``same_sketch``). ARCHITECTURE.md "One reduction per step" says what a liar can
still do and how likely it is caught.

The signs are integer arithmetic (splitmix64 of each value's index and the seed), the same bits on every device and
kernel; the projections are float64 sums of float32 (or bf16) values."""

from __future__ import annotations

import torch

from swarm.net.gradhash import grad_hash

ROWS = 64  # projections per sketch: 512 bytes a micro-batch, whatever its size
SLACK = 8.0  # a projection of the sum's rounding errors is within SLACK of their norm (a Gaussian's 8 sigma)
FLOAT64_SLACK = 1e-12  # the float64 projections' own rounding, relative to the gradients' norms
_CHUNK = 1 << 15  # values projected at a time: a (chunk x ROWS) sign matrix, 16 MiB in float64
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 that has its bits (torch multiplies int64 modulo 2**64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(words: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (words >> bits) & ((1 << (64 - bits)) - 1)


def sign_words(start: int, stop: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """64 pseudo-random bits for each value index in [start, stop): splitmix64 of ``seed + index x golden``; bit r
    of a word is the sign of that value in projection r."""
    words = torch.arange(start, stop, dtype=torch.int64, device=device) * _int64(_GOLDEN) + _int64(seed)
    words = (words ^ _shift_right(words, 30)) * _int64(_MIX1)
    words = (words ^ _shift_right(words, 27)) * _int64(_MIX2)
    return words ^ _shift_right(words, 31)


def seed_of(tensors: list[torch.Tensor]) -> int:
    """The signs' seed: the canonical hash of the partial sum (or chunk) the sketches stand beside."""
    return int(grad_hash(tensors)[:15], 16)


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One gradient's values end to end, in its tensors' order (a chunk is flat already)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def sketches(vectors: list[torch.Tensor], seed: int) -> torch.Tensor:
    """The sketch of each flat vector (all of one length): a (vectors, ROWS) float64 tensor on their device."""
    length = vectors[0].numel()
    device = vectors[0].device
    table = _byte_signs(device)
    out = torch.zeros(len(vectors), ROWS, dtype=torch.float64, device=device)
    for start in range(0, length, _CHUNK):
        stop = min(length, start + _CHUNK)
        # each word's 8 bytes (little-endian: byte k holds bits 8k..8k+7) looked up as 8 signs each
        signs = table[sign_words(start, stop, seed, device).view(torch.uint8).long()].reshape(stop - start, ROWS)
        values = torch.stack([v[start:stop] for v in vectors]).to(torch.float64)
        out += values @ signs
    return out


def _byte_signs(device: torch.device) -> torch.Tensor:
    """For each byte value, the signs its 8 bits stand for (bit i set: -1), lowest bit first: unpacking a word's
    bits by lookup costs a tenth of shifting them out one by one."""
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    return (1 - 2 * bits).to(torch.float64)


def sum_agrees(summed: torch.Tensor, reported: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a partial sum's sketch (``summed``: ROWS) equals the sum of its micro-batches' reported sketches
    (``reported``: micro-batches x ROWS) within the rounding of a sum in ``dtype``: each value of the sum is off its
    exact sum by at most (micro-batches - 1) x the unit roundoff x the sum of the values' magnitudes, so the errors'
    norm is at most that times the sum of the gradients' norms; a random-sign projection of the errors is about
    their norm (within ``SLACK`` of it but with odds below 1e-15), and a sketch row's root mean square is its
    vector's norm. The float64 projections add ``FLOAT64_SLACK`` (another device adds in another order)."""
    gap = (summed - reported.sum(0)).abs()
    sizes = float(reported.pow(2).mean(1).sqrt().sum())
    unit = torch.finfo(dtype).eps / 2
    return bool((gap <= (SLACK * (len(reported) - 1) * unit + FLOAT64_SLACK) * sizes + 1e-300).all())


def same_sketch(reported: torch.Tensor, recomputed: torch.Tensor, vector: torch.Tensor) -> bool:
    """Whether a micro-batch's reported sketch is the projection of its gradient (``vector``) recomputed here: to
    float64 rounding, which differs between devices only in the order of the additions."""
    bound = FLOAT64_SLACK * float(vector.double().abs().sum()) + 1e-300
    return bool(((reported.to(recomputed) - recomputed).abs() <= bound).all())


def are_sketches(reported: torch.Tensor, vectors: list[torch.Tensor], summed: list[torch.Tensor]) -> bool:
    """Whether ``reported`` (a row per vector) are the sketches of these flat vectors with the signs that the
    partial sum (or chunk) ``summed`` draws."""
    if tuple(reported.shape) != (len(vectors), ROWS):
        return False
    own = sketches(vectors, seed_of(summed))
    return all(same_sketch(row, mine, vector) for row, mine, vector in zip(reported, own, vectors, strict=True))
