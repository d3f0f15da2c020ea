"""How activations and their gradients travel: at full precision (the default, exact), or cast to a 16-bit dtype
and/or quantized blockwise to 8 bits with hivemind's compression, for slow links, or rotated and quantized to 4 or 3
bits (swarm.net.rotated: "hadamard4", "hadamard3", and "...sr" with stochastic rounding). "hadamard4d3" (and
"...d4", "...d2") sends a chained forward's hidden states as their change since the sample's last pass at 3 (4, 2)
bits, a first pass at 4 (swarm.net.deltas); every other tensor of such a wire goes as "hadamard4". Masks and other
integer tensors always travel as they are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.net import rotated
from swarm.net.deltas import DeltaBits

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# swarm's own codecs: codes outside hivemind's CompressionType (they never reach a protobuf's ``compression``
# field, which says NONE; the protobuf's ``dtype`` says e.g. "hadamard4:bfloat16"), name -> (bits, stochastic)
ROTATED = {"hadamard4": (4, False), "hadamard3": (3, False), "hadamard4sr": (4, True), "hadamard3sr": (3, True)}
ROTATED_CODES = {0x100 + index: name for index, name in enumerate(ROTATED)}
# delta-coded forwards (swarm.net.deltas): name -> (the codec of everything else, the delta's bits)
DELTAS = {f"hadamard4d{change}": ("hadamard4", DeltaBits(4, change)) for change in (4, 3, 2)}
_ROTATED_BY_NAME = {name: code for code, name in ROTATED_CODES.items()}
COMPRESSIONS = {
    "none": runtime_pb2.CompressionType.NONE,
    "blockwise8": runtime_pb2.CompressionType.BLOCKWISE_8BIT,
    **_ROTATED_BY_NAME,
    **{name: _ROTATED_BY_NAME[values] for name, (values, _) in DELTAS.items()},
}
BLOCKSIZE = 4096  # hivemind's blockwise quantization block


@dataclass(frozen=True)
class WireFormat:
    """``dtype``: what floating tensors are cast to before they leave (None: as computed); ``compression``: how
    they are then encoded. A peer answers in the format of the request."""

    dtype: str | None = None
    compression: str = "none"
    grad_compression: str | None = None  # the backward's (gradients of the hidden states); None: ``compression``

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)} or None, got {self.dtype!r}")
        for option, value in (("compression", self.compression), ("grad_compression", self.backward_compression)):
            if value not in COMPRESSIONS:
                raise ValueError(f"{option} must be one of {sorted(COMPRESSIONS)}, got {value!r}")

    @classmethod
    def parse(cls, spec: str) -> WireFormat:
        """A format from its short name, ``[DTYPE+]COMPRESSION[/GRAD_COMPRESSION]`` or a bare dtype: "none",
        "bfloat16", "blockwise8", "bfloat16+hadamard4", "bfloat16+hadamard4/hadamard3" (what benchmarks take)."""
        head, _, grads = spec.partition("/")
        dtype, plus, compression = head.rpartition("+")
        if not plus and compression in WIRE_DTYPES:
            dtype, compression = compression, "none"
        return cls(dtype or None, compression, grads or None)

    @property
    def spec(self) -> str:
        """The short name ``parse`` reads back."""
        head = self.compression if self.dtype is None else f"{self.dtype}+{self.compression}"
        if self.dtype is not None and self.compression == "none":
            head = self.dtype
        return head if self.grad_compression is None else f"{head}/{self.grad_compression}"

    @property
    def backward_compression(self) -> str:
        """How a backward's request and reply travel: gradients may want other rounding (stochastic: unbiased)."""
        return self.compression if self.grad_compression is None else self.grad_compression

    @property
    def exact(self) -> bool:
        return self.dtype is None and self.compression == "none" and self.backward_compression == "none"

    def value_bytes(self, computed: torch.dtype, backward: bool = False) -> float:
        """What one value of a floating tensor computed in ``computed`` weighs on the wire: forward (a delta wire's
        change, what a sample's later passes send; its first pass weighs as hadamard4) or ``backward``."""
        compression = self.backward_compression if backward else self.compression
        if compression == "blockwise8":
            return 1 + 4 / BLOCKSIZE  # a byte, and a float32 scale per block
        if compression in DELTAS:
            bits = DELTAS[compression][1]
            return rotated.value_bytes(bits.value if backward else bits.change)
        if compression in ROTATED:
            return rotated.value_bytes(ROTATED[compression][0])  # bits/8 and a float32 scale per tile
        return torch.finfo(computed if self.dtype is None else WIRE_DTYPES[self.dtype]).bits / 8

    @property
    def delta_bits(self) -> DeltaBits | None:
        """How a chained forward's hidden states round as changes since the sample's last pass (None: not sent
        as changes)."""
        return DELTAS[self.compression][1] if self.compression in DELTAS else None

    @property
    def compression_type(self) -> int:
        return COMPRESSIONS[self.compression]

    def cast(self, tensor: torch.Tensor) -> torch.Tensor:
        """A floating tensor in the wire dtype (others as they are)."""
        if self.dtype is None or not tensor.is_floating_point():
            return tensor
        return tensor.to(WIRE_DTYPES[self.dtype])


def serialize(tensor: torch.Tensor, compression: int) -> runtime_pb2.Tensor:
    """hivemind's serializer (``compression`` for floating tensors only), except that an uncompressed bfloat16
    tensor travels in 2 bytes per value (hivemind widens it to float32, numpy having no bfloat16)."""
    if not tensor.is_floating_point():
        compression = runtime_pb2.CompressionType.NONE
    if compression in ROTATED_CODES:
        name = ROTATED_CODES[compression]
        return runtime_pb2.Tensor(
            buffer=rotated.encode(tensor, *ROTATED[name]),
            size=tensor.shape,
            requires_grad=tensor.requires_grad,
            dtype=f"{name}:{rotated.dtype_name(tensor.dtype)}",
            compression=runtime_pb2.CompressionType.NONE,
        )
    if tensor.dtype == torch.bfloat16 and compression == runtime_pb2.CompressionType.NONE:
        serialized = serialize_torch_tensor(tensor.view(torch.int16))
        serialized.dtype = "bfloat16"
        return serialized
    return serialize_torch_tensor(tensor, compression)


def deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """hivemind's deserializer, but for 2-byte bfloat16 (see ``serialize``) and blockwise 8-bit tensors, whose
    header hivemind 1.1 reads in a way that numpy 2 refuses (``int()`` of a one-element array)."""
    size = tuple(serialized.size)
    name, _, dtype = serialized.dtype.partition(":")
    if name in ROTATED:
        if serialized.compression != runtime_pb2.CompressionType.NONE or dtype not in rotated.DTYPES:
            raise ValueError(f"a {name} tensor of dtype {dtype!r} and compression {serialized.compression}")
        values = rotated.decode(serialized.buffer, size, rotated.DTYPES[dtype], ROTATED[name][0])
        return values.requires_grad_(serialized.requires_grad)
    if serialized.compression == runtime_pb2.CompressionType.NONE and serialized.dtype == "bfloat16":
        if len(serialized.buffer) == 2 * int(np.prod(size)):
            values = torch.frombuffer(bytearray(serialized.buffer), dtype=torch.int16)
            return values.view(torch.bfloat16).reshape(size).requires_grad_(serialized.requires_grad)
    if serialized.compression != runtime_pb2.CompressionType.BLOCKWISE_8BIT:
        return deserialize_torch_tensor(serialized)
    from bitsandbytes.functional import dequantize_blockwise

    buffer = serialized.buffer
    absmax_size, code_size = (int(v) for v in np.frombuffer(buffer, count=2, dtype=np.int64))
    absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=np.float32)
    code = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=code_size, dtype=np.float32)
    quantized = np.frombuffer(buffer, offset=16 + absmax.nbytes + code.nbytes, dtype=np.uint8)
    if quantized.size != int(np.prod(size)) or absmax_size != -(-quantized.size // BLOCKSIZE):
        raise ValueError("a blockwise 8-bit tensor whose sizes do not add up")
    result = dequantize_blockwise(
        torch.as_tensor(quantized.copy()).reshape(size),
        absmax=torch.as_tensor(absmax.copy()),
        code=torch.as_tensor(code.copy()),
        blocksize=BLOCKSIZE,
        nested=False,
    )
    if serialized.dtype not in WIRE_DTYPES:
        raise ValueError(f"a blockwise 8-bit tensor of dtype {serialized.dtype!r}")
    return result.to(WIRE_DTYPES[serialized.dtype]).requires_grad_(serialized.requires_grad)
