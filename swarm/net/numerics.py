"""What counts as an honest difference between two replicas' results of the same hop.

A peer's numerics class is how it computes: the quantization of its base weights, its compute dtype and its device
kind. Two peers of one class differ only by their kernels' rounding (other vector units, GPU generations or torch
versions: up to 1.7e-6 of the largest value per fp32 block, measured), so a spot check compares them tightly: a result
off by more than that is a lie, however small. Across classes the honest difference is the quantization's own
error, which each peer measures on each of its blocks when it loads them (``peers/calibration.py``) and announces.
Announcements are read as at most the cap of the announced quantization, so a liar gains at most the slack an honest
peer of its class would get; a comparison whose tolerance would tell nothing (``UNDECIDABLE``) is not made, and a
spot check that cannot decide bans nobody.

Differences are relative: the largest absolute difference over the larger of the two largest magnitudes (0 to 2).
Importing this module imports no torch: the command line checks the precision names before any heavy import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

QUANT_MODES = ("none", "int8", "nf4")  # what a peer keeps its base weights in
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # what it computes in
# The rounding two kernels of one class differ by, per block a hop runs, by the dtype the block computes in: over
# twice the largest measured (fp32: 1.7e-6, default vs AVX-512 CPU kernels on SmolLM2's blocks, outputs and input
# gradients, scripts/bench_numerics.py).
ROUNDING_PER_BLOCK = {"float32": 4e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
COARSER = ("float32", "float16", "bfloat16")  # by unit roundoff, finest first
# The largest error per block an announcement is read as: somewhat above the most the quantization was measured to
# cost (peers/calibration.py on SmolLM2-135M's blocks: NF4 up to 0.77, int8 0.25, bf16 weights 0.04; on the tiny
# test models NF4 0.36, int8 0.03).
ERROR_CAPS = {"nf4": 1.0, "int8": 0.5, "none": 0.0}
DTYPE_ERROR_CAPS = {"float32": 0.0, "float16": 0.05, "bfloat16": 0.1}
SAFETY = 2.0  # real hidden states against the calibration's: up to 1.4x the calibrated error measured
MAX_BLOCKS = 1024  # blocks one announcement may name errors of
UNDECIDABLE = 1.0  # a tolerance this loose passes results that share only their sign pattern: no verdict


@dataclass(frozen=True)
class Numerics:
    """How a peer computes its blocks, and the error each of them showed against exact fp32 at load."""

    quant: str = "none"
    dtype: str = "float32"
    device: str = "cpu"
    errors: dict[int, float] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_MODES or self.dtype not in DTYPE_NAMES or not self.device.isidentifier():
            raise ValueError(f"unknown numerics {self.quant}/{self.dtype}/{self.device}")

    @property
    def key(self) -> str:
        """The class: peers with the same key differ only by rounding."""
        return f"{self.quant}/{self.dtype}/{self.device}"

    @property
    def cap(self) -> float:
        return max(ERROR_CAPS[self.quant], DTYPE_ERROR_CAPS[self.dtype])

    def error(self, blocks: Iterable[int]) -> float:
        """The announced error of a hop over ``blocks``: each block's, read as at most the cap (a block announced
        without one counts at the cap), summed."""
        return sum(min(max(self.errors.get(block, self.cap), 0.0), self.cap) for block in blocks)

    def to_wire(self) -> dict:
        return {
            "quant": self.quant,
            "dtype": self.dtype,
            "device": self.device,
            "errors": {str(block): float(error) for block, error in self.errors.items()},
        }

    @classmethod
    def from_wire(cls, value: object) -> Numerics:
        """Raises KeyError, TypeError or ValueError on anything malformed (a non-finite error, too many blocks)."""
        errors = {int(block): float(error) for block, error in dict(value["errors"]).items()}
        if len(errors) > MAX_BLOCKS or not all(math.isfinite(error) for error in errors.values()):
            raise ValueError(f"numerics: errors must be finite, for at most {MAX_BLOCKS} blocks")
        return cls(str(value["quant"]), str(value["dtype"]), str(value["device"]), errors)


EXACT = Numerics()  # what a peer that announces no numerics is taken to compute in


def coarsest(*dtypes: str | None) -> str:
    return max((d for d in dtypes if d is not None), key=COARSER.index)


def tolerance(a: Numerics, b: Numerics, blocks: Iterable[int], autocast: str | None = None) -> float | None:
    """How far two peers' honest results of a hop over ``blocks`` may differ (relative), under the client's
    ``autocast``; None where no tolerance would tell an honest difference from a lie."""
    blocks = list(blocks)
    rounding = ROUNDING_PER_BLOCK[coarsest(a.dtype, b.dtype, autocast)] * len(blocks)
    if a.key == b.key:
        return rounding
    loose = rounding + SAFETY * (a.error(blocks) + b.error(blocks))
    return None if loose >= UNDECIDABLE else loose
