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

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from swarm.net import rotated
from swarm.net.errors import MissingReferenceError

DIGEST_BYTES = 8
CLIENT = "client"  # a reference's other end where a chain's last peer answers the client


@dataclass(frozen=True, kw_only=True)
class ReferenceKey:
    """Which of a sample's references one end of a hop uses. Each end keys its own store, but with this one type,
    so that a sender's keys and a receiver's cannot drift apart in shape or order: the adapter, the sample (the
    client's hash of its tokens), the block boundary the hidden states cross, whether this end sent or received
    them, and the other end: a peer's id (base58), ``CLIENT``, or None where a receiving peer keeps one key for every
    sender (its references told apart by digest)."""

    adapter: str
    sample: str
    boundary: int
    sent: bool
    peer: str | None = None


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
        numel = math.prod(self.shape)
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
    """One end of hops: the references of the samples it has sent or received, by ``ReferenceKey``. A sender keeps
    one reference a key; a receiver up to ``per_key``, told apart by digest, so that replicas sending it the same
    sample in turn each find their own (and a sender's change finds its base however the routes went). Both ends
    reconstruct alike. Thread-safe: micro-batches in flight together share it."""

    def __init__(self, store_dtype: torch.dtype = torch.bfloat16, max_bytes: int = 2**30, per_key: int = 4):
        self.store_dtype, self.max_bytes, self.per_key = store_dtype, max_bytes, per_key
        self._references: OrderedDict[tuple[ReferenceKey, bytes], torch.Tensor] = OrderedDict()  # least recent first
        self._digests: dict[ReferenceKey, list[bytes]] = {}  # key -> its references' digests, most recent last
        self._lock = threading.Lock()
        self.stored_bytes = 0

    def __len__(self) -> int:
        return len(self._references)

    def encode(self, key: ReferenceKey, value: torch.Tensor, bits: DeltaBits) -> tuple[Delta, torch.Tensor]:
        """What to send for ``value`` of sample ``key``, and the value the receiver will reconstruct from it
        (float32): a change from this end's reference for ``key``, or the value itself where it holds none."""
        dtype = rotated.dtype_name(value.dtype)
        value = value.detach().float()
        shape = tuple(value.shape)
        with self._lock:
            digests = self._digests.get(key, [])
            stored = self._get(key, digests[-1]) if digests else None
            if stored is None or tuple(stored.shape) != shape:
                delta = Delta(None, rotated.encode(value, bits.value, bits.stochastic), bits.value, shape, dtype)
                reconstructed = self._decoded(delta, None)
            else:
                change = rotated.encode(value - stored.float(), bits.change, bits.stochastic)
                delta = Delta(digests[-1], change, bits.change, shape, dtype)
                reconstructed = self._decoded(delta, stored)
            self._forget(key)  # a sender keeps one reference a key
            self._store(key, reconstructed)
            return delta, reconstructed

    def decode(self, key: ReferenceKey, delta: Delta) -> torch.Tensor:
        """The value the sender encoded (float32); raises MissingReferenceError where ``delta`` is a change from a
        reference this end does not hold for ``key``."""
        with self._lock:
            stored = None
            if delta.base is not None:
                stored = self._get(key, delta.base)
                if stored is None or tuple(stored.shape) != delta.shape:
                    raise MissingReferenceError(
                        f"a change of activations from a reference this peer does not hold ({key!r}); send the value"
                    )
                self._drop(key, delta.base)  # its sender moves on to the new one
            value = self._decoded(delta, stored)
            self._store(key, value)
            return value

    def digest_of(self, key: ReferenceKey) -> bytes | None:
        """The digest of the most recent reference held for ``key`` (None: none held)."""
        with self._lock:
            digests = self._digests.get(key)
            return digests[-1] if digests else None

    def forget(self, key: ReferenceKey) -> None:
        with self._lock:
            self._forget(key)

    def _forget(self, key: ReferenceKey) -> None:
        for digest_ in list(self._digests.get(key, [])):
            self._drop(key, digest_)

    def _get(self, key: ReferenceKey, digest_: bytes) -> torch.Tensor | None:
        stored = self._references.get((key, digest_))
        if stored is not None:
            self._references.move_to_end((key, digest_))
        return stored

    def _drop(self, key: ReferenceKey, digest_: bytes) -> None:
        stored = self._references.pop((key, digest_), None)
        if stored is None:
            return
        self.stored_bytes -= stored.numel() * stored.element_size()
        digests = self._digests[key]
        digests.remove(digest_)
        if not digests:
            del self._digests[key]

    def _decoded(self, delta: Delta, stored: torch.Tensor | None) -> torch.Tensor:
        change = rotated.decode(delta.payload, delta.shape, torch.float32, delta.bits)
        return change if stored is None else stored.float() + change

    def _store(self, key: ReferenceKey, value: torch.Tensor) -> None:
        """Keep ``value`` (as stored, what both ends use next time) as a reference of ``key``, within the bounds."""
        stored = value.to(self.store_dtype)
        name = digest(stored)
        self._drop(key, name)
        self._references[(key, name)] = stored
        self._digests.setdefault(key, []).append(name)
        self.stored_bytes += stored.numel() * stored.element_size()
        while len(self._digests[key]) > self.per_key:
            self._drop(key, self._digests[key][0])
        while self.stored_bytes > self.max_bytes and len(self._references) > 1:
            self._drop(*next(iter(self._references)))
