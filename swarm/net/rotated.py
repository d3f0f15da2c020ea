"""A low-bit codec for activations and their gradients that keeps the loss: each tile of TILE values (along the
flattened tensor, so along the hidden dimension whenever it is a multiple of TILE) is multiplied by random signs
and rotated by a Walsh-Hadamard transform, then quantized to 4 or 3 bits with one float32 absmax scale per tile.
The rotation spreads the few outlier channels of an LLM residual stream over the whole tile, so they no longer set
a scale that crushes every other value to zero.

Deterministic: the signs are one fixed random pattern (``SIGNS_SEED``), so that a tensor decoded and encoded again
(a chained reply passed back hop by hop) lands on the same codes instead of adding a fresh rounding error at every
hop; the stochastic rounding's noise comes from a seed that is a hash (blake2b) of the tensor's dtype, shape and
bytes, carried in the header. Both are a counter-based integer hash (no torch RNG, whose CPU kernels differ with
the CPU's vector unit and whose CUDA stream differs from the CPU's). Every float operation is elementwise (butterfly
adds and subtractions, products and quotients by a scale, floor, max): IEEE-exact in any order, so the same tensor
gives the same bytes on any machine, CPU kernel (ATEN_CPU_CAPABILITY) or device, and decodes to the same values.

Measured (tests/unit/test_rotated_wire.py), relative error ||decoded - x|| / ||x|| of float32 activations 8x64x256,
"ord" the same on the ordinary channels only (against their own norm):

    input                          4 nearest     4 stochastic  3 nearest     3 stochastic
    4 channels 50-100x, rotated    0.056 ord .56  0.079 ord .78  0.128 ord 1.16 0.175 ord 1.74
      same codec, no rotation      0.626          0.684          1.413          1.477
      plain absmax, grid with 0    0.104 ord .97  -              0.131 ord 1.00 -
    1 channel 50x, rotated         0.060 ord .20  0.085 ord .28  0.130 ord .43  0.183 ord .60
      plain absmax, grid with 0    0.184 ord .61  -              0.209 ord .69  -
    no outliers (unit Gaussian)    0.109          0.154          0.234          0.330

The rotation spreads a tile's energy evenly, outliers' included: the error is small against the whole tensor but,
where outliers hold most of a tile's energy, as large as the ordinary channels themselves (at 3 bits, plain
quantization's zeroing them does about as well). Nearest rounding has the lower error; stochastic rounding is
unbiased (the mean over 32 seeds shrinks like 1/sqrt(32); nearest's 3-bit bias does not), which is what gradients
summed over many micro-batches want. A scale clipped to 0.9 (4 bits) / 0.85 (3 bits) of the absmax would lower the
nearest error by 4% / 21% but shrinks every value by 1% / 3% (a bias), so the scale is the absmax.

Bytes per value: bits/8 + 4/TILE (0.53125 at 4 bits, 0.40625 at 3), plus a 16-byte header per tensor and the last
tile's padding (``encoded_bytes``). Speed on a 2-core CPU (torch 2.13, AVX512), per MiB of float32 in: ~10 ms to
encode with nearest rounding, ~22 ms with stochastic rounding (the noise's integer hash), ~6 ms to decode.

Wire layout (little-endian): magic ``SWHR``, version, bits, log2(tile), flags (bit 0: stochastic rounding),
seed (u64); then one float32 scale per tile; then the codes, 2 per byte (4 bits), 8 per 3 bytes (3 bits) or 4 per
byte (2 bits: only for changes, swarm.net.deltas).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

TILE = 128
MAGIC = b"SWHR"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQ")  # magic, version, bits, log2(tile), flags, seed
STOCHASTIC = 1
BITS = (2, 3, 4)  # 2: for small changes (swarm.net.deltas), too coarse for activations themselves
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_MASK32 = 0xFFFFFFFF
# 2 bits spend their 4 levels on the bulk of a rotated tile (about Gaussian, its absmax ~2.7 sigma): levels at +-0.5
# and +-1.5 times absmax / 2.7 (near the Gaussian's optimal +-0.45 and +-1.51 sigma), the rest clipped; on Gaussian
# tiles the relative error is 0.35, against 0.55 with the absmax as the outer level
CLIP = {2: 1.8}
SIGNS_SEED = 0x5EED_5A7A_4D1A_0001  # the rotation's signs: the same for every tensor (see the module's docstring)


def dtype_name(dtype: torch.dtype) -> str:
    """The name a rotated tensor's dtype travels by; ValueError for one the codec does not encode."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    raise ValueError(f"the rotated codec cannot encode {dtype}")


def value_bytes(bits: int, tile: int = TILE) -> float:
    """What one value weighs on the wire: its code and its share of the tile's scale (header and padding aside)."""
    return bits / 8 + 4 / tile


def encoded_bytes(numel: int, bits: int, tile: int = TILE) -> int:
    """The exact size of ``encode``'s buffer for a tensor of ``numel`` values."""
    tiles = -(-numel // tile)
    return HEADER.size + tiles * (4 + tile * bits // 8)


def seed_of(tensor: torch.Tensor) -> int:
    """A 64-bit seed from the tensor's dtype, shape and bytes (the same tensor, the same seed, anywhere)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.view(torch.int16)
    digest = hashlib.blake2b(digest_size=8, person=b"swarm-hadamard")
    digest.update(f"{flat.dtype}:{tuple(tensor.shape)}".encode())
    digest.update(flat.numpy().tobytes())
    return int.from_bytes(digest.digest(), "little")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors holding values below 2**32 (products stay below 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _hash(count: int, key_a: int, key_b: int, device: torch.device) -> torch.Tensor:
    index = torch.arange(count, dtype=torch.int64, device=device)
    return _mix(_mix((index + key_a) & _MASK32) ^ key_b)


def _signs(seed: int, tile: int, device: torch.device) -> torch.Tensor:
    bits = _hash(tile, (seed >> 32) ^ 0x9E3779B9, seed & _MASK32, device) & 1
    return (1 - 2 * bits).to(torch.float32)


def _noise(seed: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` uniform values in [0, 1), exact multiples of 2**-16 (two per 32-bit hash)."""
    hashed = _hash(-(-count // 2), seed & _MASK32, seed >> 32, device)
    return torch.stack((hashed & 0xFFFF, hashed >> 16), dim=1).reshape(-1)[:count].to(torch.float32) * 2.0**-16


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of each row of ``x`` (rows of a power-of-2 length): butterflies
    only, so each value is the same sequence of float additions and subtractions on any machine. H @ H = n I."""
    rows, n = x.shape
    h = 1
    while h < n:
        x = x.view(rows, n // (2 * h), 2, h)
        a, b = x[:, :, 0], x[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(rows, n)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 2:
        quads = codes.view(-1, 4)
        return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    if bits == 4:
        pairs = codes.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    groups = codes.view(-1, 8).to(torch.int32)
    word = groups[:, 0]
    for j in range(1, 8):
        word = word | (groups[:, j] << (3 * j))
    return torch.stack((word & 255, (word >> 8) & 255, word >> 16), dim=1).to(torch.uint8).reshape(-1)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 2:
        return torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1)
    if bits == 4:
        return torch.stack((packed & 15, packed >> 4), dim=1).reshape(-1)
    triples = packed.view(-1, 3).to(torch.int32)
    word = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
    return torch.stack([(word >> (3 * j)) & 7 for j in range(8)], dim=1).reshape(-1)


def quantize(
    tensor: torch.Tensor, bits: int, stochastic: bool, seed: int, tile: int = TILE, rotate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile scales (float32, one per tile) and codes (uint8, one per value, padded to whole tiles).
    ``rotate=False`` is plain per-tile absmax quantization (for comparison)."""
    half = (2**bits - 1) / 2  # codes 0 .. 2**bits-1 stand for (code - half) * scale: no code wasted
    flat = tensor.detach().reshape(-1).to(torch.float32)
    tiles = -(-flat.numel() // tile)
    x = torch.nn.functional.pad(flat, (0, tiles * tile - flat.numel())).view(tiles, tile)
    if rotate:
        x = hadamard(x * _signs(SIGNS_SEED, tile, x.device))
    scales = x.abs().amax(dim=1) / (half * CLIP.get(bits, 1.0))
    scales = torch.where(torch.isfinite(scales), scales, torch.full_like(scales, float("nan")))  # canonical NaN
    scaled = torch.nan_to_num(x / scales[:, None], nan=0.0, posinf=0.0, neginf=0.0) + half  # 0/0: an all-0 tile
    if stochastic:
        codes = torch.floor(scaled + _noise(seed, scaled.numel(), x.device).view(tiles, tile))
    else:
        codes = torch.round(scaled)
    return scales, codes.clamp_(0, 2**bits - 1).to(torch.uint8)


def dequantize(scales: torch.Tensor, codes: torch.Tensor, bits: int, rotate: bool = True) -> torch.Tensor:
    """Float32 values, flat and padded to whole tiles: the inverse of ``quantize``."""
    half = (2**bits - 1) / 2
    tile = codes.numel() // max(scales.numel(), 1)
    y = (codes.view(-1, tile).to(torch.float32) - half) * scales[:, None]
    if rotate:
        y = (hadamard(y) / tile) * _signs(SIGNS_SEED, tile, y.device)
    return y.reshape(-1)


def encode(tensor: torch.Tensor, bits: int, stochastic: bool, tile: int = TILE) -> bytes:
    """The tensor's values as ``encoded_bytes(tensor.numel(), bits)`` bytes (shape and dtype travel elsewhere)."""
    if bits not in BITS or tile < 8 or tile & (tile - 1):
        raise ValueError(f"bits must be one of {BITS} and the tile a power of 2 >= 8, got {bits}, {tile}")
    seed = seed_of(tensor)
    scales, codes = quantize(tensor, bits, stochastic, seed, tile)
    header = HEADER.pack(MAGIC, VERSION, bits, tile.bit_length() - 1, STOCHASTIC if stochastic else 0, seed)
    return b"".join((header, scales.cpu().numpy().astype("<f4").tobytes(), _pack(codes, bits).cpu().numpy().tobytes()))


def decode(
    buffer: bytes, shape: tuple[int, ...], dtype: torch.dtype, bits: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The inverse of ``encode``; raises ValueError on any buffer that ``encode`` could not have made for a tensor
    of ``shape`` (so memory stays bounded by the buffer's size)."""
    if len(buffer) < HEADER.size:
        raise ValueError("a rotated tensor shorter than its header")
    magic, version, header_bits, log_tile, flags, seed = HEADER.unpack_from(buffer)
    if magic != MAGIC or version != VERSION or flags & ~STOCHASTIC:
        raise ValueError("a rotated tensor with a bad header")
    if header_bits != bits or not 3 <= log_tile <= 12:
        raise ValueError(f"a rotated tensor of {header_bits} bits and tile 2**{log_tile}, expected {bits} bits")
    if any(d < 0 for d in shape):
        raise ValueError(f"a rotated tensor of shape {shape}")
    numel, tile = int(np.prod(shape, dtype=object)) if shape else 1, 1 << log_tile
    if len(buffer) != encoded_bytes(numel, bits, tile):
        raise ValueError(f"a rotated tensor of {len(buffer)} bytes for {numel} values at {bits} bits")
    tiles = -(-numel // tile)
    if tiles == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    scales = torch.frombuffer(bytearray(buffer[HEADER.size : HEADER.size + 4 * tiles]), dtype=torch.float32)
    packed = torch.frombuffer(bytearray(buffer[HEADER.size + 4 * tiles :]), dtype=torch.uint8)
    codes = _unpack(packed.to(device), bits)
    values = dequantize(scales.to(device), codes, bits)
    return values[:numel].view(shape).to(dtype)
