"""Compressed activations on the wire: off by default (bit-exact), bounded error when on, masks untouched, and
malformed compressed tensors refused like any bad input."""

from __future__ import annotations

import pytest
import torch

from swarm.net.compression import WireFormat
from swarm.net.wire import Message, WireError, decode, encode


def _round_trip(wire: WireFormat, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    parts = encode(Message({}, [wire.cast(hidden), mask], wire.compression_type))
    size = sum(t.ByteSize() for part in parts for t in part.tensors)
    back = decode(parts)
    return back.tensors[0].to(hidden.dtype), back.tensors[1], size


@pytest.mark.parametrize(
    "dtype, compression, tolerance, shrink",
    [(None, "none", 0.0, 1.0), ("bfloat16", "none", 1e-2, 0.55), (None, "blockwise8", 3e-2, 0.3)],
)
def test_round_trip_error_is_bounded_and_bytes_shrink(dtype, compression, tolerance, shrink):
    hidden = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0)) * 3
    mask = torch.ones(4, 64, dtype=torch.int64)
    mask[1, 50:] = 0
    wire = WireFormat(dtype, compression)
    back, mask_back, size = _round_trip(wire, hidden, mask)
    assert back.shape == hidden.shape and back.dtype == torch.float32
    error = ((back - hidden).abs().max() / hidden.abs().max()).item()
    assert error <= tolerance, error
    if wire.exact:
        assert torch.equal(back, hidden), "the default wire is exact"
    assert torch.equal(mask_back, mask) and mask_back.dtype == torch.int64, "masks travel as they are"
    assert size <= shrink * hidden.numel() * 4 + mask.numel() * 8 + 64, size


def test_bad_settings_and_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="wire_dtype"):
        WireFormat("int8")
    with pytest.raises(ValueError, match="compression"):
        WireFormat(None, "zip")
    parts = encode(Message({}, [torch.randn(64, 128)], WireFormat(None, "blockwise8").compression_type))
    parts[0].tensors[0].buffer = parts[0].tensors[0].buffer[:-100]  # cut short
    with pytest.raises(WireError, match="could not be decoded"):
        decode(parts)


def test_the_backward_may_travel_in_a_compression_of_its_own():
    assert WireFormat(compression="hadamard4").backward_compression == "hadamard4"
    wire = WireFormat(compression="hadamard4", grad_compression="hadamard4sr")
    assert (wire.compression, wire.backward_compression, wire.exact) == ("hadamard4", "hadamard4sr", False)
    assert not WireFormat(grad_compression="hadamard3sr").exact, "compressed gradients are not exact"
    with pytest.raises(ValueError, match="grad_compression"):
        WireFormat(grad_compression="zip")


@pytest.mark.parametrize(
    "spec, wire",
    [
        ("none", WireFormat()),
        ("bfloat16", WireFormat("bfloat16")),
        ("blockwise8", WireFormat(None, "blockwise8")),
        ("bfloat16+hadamard4", WireFormat("bfloat16", "hadamard4")),
        ("bfloat16+hadamard4/hadamard3sr", WireFormat("bfloat16", "hadamard4", "hadamard3sr")),
        ("hadamard4/none", WireFormat(None, "hadamard4", "none")),
    ],
)
def test_a_wire_format_reads_back_from_its_short_name(spec, wire):
    assert WireFormat.parse(spec) == wire
    assert WireFormat.parse(wire.spec) == wire
    assert wire.spec == spec


def test_a_short_name_that_is_no_format_is_refused():
    for spec in ("int8", "bfloat16+zip", "hadamard4/zip", "float33+none"):
        with pytest.raises(ValueError):
            WireFormat.parse(spec)
