"""Activations sent as their change since the sample's last pass (AC-SGD's idea, for runs that see each sample
more than once): both ends of a hop keep the value the receiver reconstructed last time for each sample (its
reference), and the sender encodes only ``value - reference`` with the rotated low-bit codec (swarm.net.rotated).
The change between epochs is much smaller than the value, so at the same bits its rounding error is too; and since
the sender measures the change from what the receiver really holds (not from the exact value it sent before),
last pass's rounding error is part of this pass's change and gets corrected rather than added up.

A sample's first pass (or one whose reference was evicted) sends the value itself in the same codec. A delta
names its reference by a digest, so a receiver that holds another reference (a replica that did not see the last
pass, an eviction, a restart) refuses it (``MissingReferenceError``) instead of adding a change to the wrong base;
the sender then forgets its reference and sends the value. References are stored in ``store_dtype`` (bfloat16: 2
bytes a value), least recently used first out beyond ``max_bytes``; what is stored is what both ends use next
time, so a rounding of the store is corrected like any other. Every step is IEEE-exact elementwise arithmetic, so
both ends reconstruct the same bits on any CPU kernel or device.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from swarm.net import rotated
from swarm.net.errors import MissingReferenceError

DIGEST_BYTES = 8


@dataclass(frozen=True)
class DeltaBits:
    """How a delta-coded hop rounds: ``value`` bits for a first pass, ``change`` bits after it."""

    value: int
    change: int
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.value not in rotated.BITS or self.change not in rotated.BITS:
            raise ValueError(f"bits must be one of {rotated.BITS}, got {self.value} and {self.change}")


@dataclass(frozen=True)
class Delta:
    """What crosses the wire: ``payload`` (rotated codes at ``bits``) is the value itself where ``base`` is None,
    else its change from the reference whose digest is ``base``; ``shape`` and ``dtype`` (a rotated.DTYPES name)
    are the value's, as the receiver computes with it."""

    base: bytes | None
    payload: bytes
    bits: int
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.base is not None and len(self.base) != DIGEST_BYTES:
            raise ValueError(f"a delta's base must be a {DIGEST_BYTES}-byte digest")
        if self.bits not in rotated.BITS or self.dtype not in rotated.DTYPES:
            raise ValueError(f"a delta of {self.bits} bits and dtype {self.dtype!r}")
        if len(self.shape) > 8 or not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise ValueError(f"a delta of shape {self.shape!r}")
        numel = 1
        for d in self.shape:
            numel *= d
        if len(self.payload) != rotated.encoded_bytes(numel, self.bits):
            raise ValueError(f"a delta of {len(self.payload)} bytes for {numel} values at {self.bits} bits")

    @property
    def nbytes(self) -> int:
        return len(self.payload) + (DIGEST_BYTES if self.base is not None else 0)

    def to_wire(self) -> list:
        """The delta's header (its payload travels as a uint8 tensor beside it)."""
        return [self.base, self.bits, list(self.shape), self.dtype]

    @classmethod
    def from_wire(cls, header: object, payload: torch.Tensor) -> Delta:
        """Inverse of ``to_wire``; raises ValueError on anything malformed."""
        if not (isinstance(header, list) and len(header) == 4):
            raise ValueError(f"{header!r} is not [base, bits, shape, dtype]")
        base, bits, shape, dtype = header
        if not (base is None or isinstance(base, bytes)) or not isinstance(bits, int) or not isinstance(shape, list):
            raise ValueError(f"{header!r} is not [base, bits, shape, dtype]")
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError("a delta's payload must be a 1-d uint8 tensor")
        return cls(base, payload.numpy().tobytes(), bits, tuple(shape), str(dtype))

    def payload_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)


def digest(tensor: torch.Tensor) -> bytes:
    """A reference's name: the rotated codec's hash of its dtype, shape and bytes."""
    return rotated.seed_of(tensor).to_bytes(DIGEST_BYTES, "little")


class DeltaReferences:
    """One end of hops: the references of the samples it has sent or received, keyed by the caller (a sample's
    identity, the hop, which end). The same store encodes (sender) and decodes (receiver); both reconstruct alike.
    Thread-safe: micro-batches in flight together share it."""

    def __init__(self, store_dtype: torch.dtype = torch.bfloat16, max_bytes: int = 2**30):
        self.store_dtype, self.max_bytes = store_dtype, max_bytes
        self._references: OrderedDict[Hashable, tuple[torch.Tensor, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.stored_bytes = 0

    def __len__(self) -> int:
        return len(self._references)

    def encode(self, key: Hashable, value: torch.Tensor, bits: DeltaBits) -> tuple[Delta, torch.Tensor]:
        """What to send for ``value`` of sample ``key``, and the value the receiver will reconstruct from it
        (float32)."""
        dtype = rotated.dtype_name(value.dtype)
        value = value.detach().float()
        shape = tuple(value.shape)
        with self._lock:
            reference = self._reference(key, shape)
            if reference is None:
                delta = Delta(None, rotated.encode(value, bits.value, bits.stochastic), bits.value, shape, dtype)
            else:
                stored, base = reference
                change = rotated.encode(value - stored.float(), bits.change, bits.stochastic)
                delta = Delta(base, change, bits.change, shape, dtype)
            return delta, self._apply(key, delta, reference)

    def decode(self, key: Hashable, delta: Delta) -> torch.Tensor:
        """The value the sender encoded (float32); raises MissingReferenceError where ``delta`` is a change from a
        reference this end does not hold."""
        with self._lock:
            reference = self._reference(key, delta.shape) if delta.base is not None else None
            if delta.base is not None and (reference is None or reference[1] != delta.base):
                self._forget(key)
                raise MissingReferenceError(
                    f"a change of activations from a reference this peer does not hold ({key!r}); send the value"
                )
            return self._apply(key, delta, reference)

    def digest_of(self, key: Hashable) -> bytes | None:
        """The digest of the reference held for ``key`` (None: none held)."""
        with self._lock:
            entry = self._references.get(key)
            return None if entry is None else entry[1]

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._forget(key)

    def _forget(self, key: Hashable) -> None:
        entry = self._references.pop(key, None)
        if entry is not None:
            self.stored_bytes -= entry[0].numel() * entry[0].element_size()

    def _reference(self, key: Hashable, shape: tuple[int, ...]) -> tuple[torch.Tensor, bytes] | None:
        entry = self._references.get(key)
        if entry is None or tuple(entry[0].shape) != tuple(shape):
            return None
        self._references.move_to_end(key)
        return entry

    def _apply(self, key: Hashable, delta: Delta, reference: tuple[torch.Tensor, bytes] | None) -> torch.Tensor:
        change = rotated.decode(delta.payload, delta.shape, torch.float32, delta.bits)
        value = change if reference is None else reference[0].float() + change
        stored = value.to(self.store_dtype)
        self._forget(key)
        self._references[key] = (stored, digest(stored))
        self.stored_bytes += stored.numel() * stored.element_size()
        while self.stored_bytes > self.max_bytes and len(self._references) > 1:
            self._forget(next(iter(self._references)))
        return value
