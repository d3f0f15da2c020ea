"""Activations sent as their change since the sample's last pass (AC-SGD's idea, for runs that see each sample
more than once): both ends of a hop keep the value the receiver reconstructed last time for each sample (its
reference), and the sender encodes only ``value - reference`` with the rotated low-bit codec (swarm.net.rotated).
The change between epochs is much smaller than the value, so at the same bits its rounding error is too; and since
the sender measures the change from what the receiver really holds (not from the exact value it sent before),
last pass's rounding error is part of this pass's change and gets corrected rather than added up.

A sample's first pass (or one whose reference was evicted) sends the value itself in the same codec. A delta
names its reference by a digest, so a receiver that holds another reference (a replica that did not see the last
pass, an eviction) refuses it (``MissingReference``) instead of adding a change to the wrong base; the sender then
forgets its reference and sends the value. References are stored in ``store_dtype`` (bfloat16: 2 bytes a value),
least recently used first out beyond ``max_bytes``; what is stored is what both ends use next time, so a rounding
of the store is corrected like any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from swarm.net import rotated

DIGEST_BYTES = 8


class MissingReference(KeyError):
    """A delta whose reference this end does not hold: the sender must send the value itself."""


@dataclass(frozen=True)
class Delta:
    """What crosses the wire: ``payload`` (rotated codes) is the value itself where ``base`` is None, else its
    change from the reference whose digest is ``base``."""

    base: bytes | None
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload) + (DIGEST_BYTES if self.base is not None else 0)


def digest(tensor: torch.Tensor) -> bytes:
    """A reference's name: the rotated codec's hash of its dtype, shape and bytes."""
    return rotated.seed_of(tensor).to_bytes(DIGEST_BYTES, "little")


class DeltaReferences:
    """One end of a hop: the references of the samples it has sent or received, keyed by the caller (a sample's
    identity and the hop). The same class encodes (sender) and decodes (receiver); both reconstruct alike."""

    def __init__(
        self,
        bits: int,
        value_bits: int | None = None,
        stochastic: bool = False,
        store_dtype: torch.dtype = torch.bfloat16,
        max_bytes: int = 2**30,
    ):
        """``bits`` for changes, ``value_bits`` (default: ``bits``) for a first pass's value itself."""
        value_bits = bits if value_bits is None else value_bits
        if bits not in rotated.BITS or value_bits not in rotated.BITS:
            raise ValueError(f"bits must be one of {rotated.BITS}, got {bits} and {value_bits}")
        self.bits, self.value_bits, self.stochastic = bits, value_bits, stochastic
        self.store_dtype, self.max_bytes = store_dtype, max_bytes
        self._references: OrderedDict[Hashable, tuple[torch.Tensor, bytes]] = OrderedDict()
        self.stored_bytes = 0

    def __len__(self) -> int:
        return len(self._references)

    def encode(self, key: Hashable, value: torch.Tensor) -> tuple[Delta, torch.Tensor]:
        """What to send for ``value`` of sample ``key``, and the value the receiver will reconstruct from it."""
        value = value.detach().float()
        reference = self._reference(key, value.shape)
        if reference is None:
            delta = Delta(None, rotated.encode(value, self.value_bits, self.stochastic))
        else:
            stored, base = reference
            delta = Delta(base, rotated.encode(value - stored.float(), self.bits, self.stochastic))
        return delta, self._apply(key, delta, value.shape, reference)

    def decode(self, key: Hashable, delta: Delta, shape: tuple[int, ...]) -> torch.Tensor:
        """The value the sender encoded (float32); raises MissingReference where ``delta`` is a change from a
        reference this end does not hold."""
        reference = self._reference(key, shape) if delta.base is not None else None
        if delta.base is not None and (reference is None or reference[1] != delta.base):
            self.forget(key)
            raise MissingReference(key)
        return self._apply(key, delta, shape, reference)

    def forget(self, key: Hashable) -> None:
        entry = self._references.pop(key, None)
        if entry is not None:
            self.stored_bytes -= entry[0].numel() * entry[0].element_size()

    def _reference(self, key: Hashable, shape: tuple[int, ...]) -> tuple[torch.Tensor, bytes] | None:
        entry = self._references.get(key)
        if entry is None or tuple(entry[0].shape) != tuple(shape):
            return None
        self._references.move_to_end(key)
        return entry

    def _apply(
        self, key: Hashable, delta: Delta, shape: tuple[int, ...], reference: tuple[torch.Tensor, bytes] | None
    ) -> torch.Tensor:
        bits = self.value_bits if delta.base is None else self.bits
        change = rotated.decode(delta.payload, tuple(shape), torch.float32, bits)
        value = change if reference is None else reference[0].float() + change
        stored = value.to(self.store_dtype)
        self.forget(key)
        self._references[key] = (stored, digest(stored))
        self.stored_bytes += stored.numel() * stored.element_size()
        while self.stored_bytes > self.max_bytes and len(self._references) > 1:
            self.forget(next(iter(self._references)))
        return value
