"""Activations as changes since the sample's last pass (swarm.net.deltas): both ends reconstruct the same bits,
a small change costs a small error where the value itself would cost the codec's full error, the last pass's
error is corrected rather than added up, a receiver without the reference refuses the change, and the store stays
within its bound."""

from __future__ import annotations

import pytest
import torch

from swarm.net import rotated
from swarm.net.deltas import Delta, DeltaBits, DeltaReferences, ReferenceKey
from swarm.net.errors import MissingReferenceError
from swarm.testing.activations import residual_stream

FOUR = DeltaBits(4, 4)


def _key(sample: str = "s", to: str | None = None) -> ReferenceKey:
    """A sample's key at a sender (``to`` the receiver) or at a receiver."""
    return ReferenceKey(adapter="a", sample=sample, boundary=2, sent=to is not None, peer=to)


def _relative(back: torch.Tensor, x: torch.Tensor) -> float:
    return ((back - x).norm() / x.norm()).item()


def _epochs(x: torch.Tensor, drift: float, passes: int, seed: int = 1) -> list[torch.Tensor]:
    """One sample's value at each pass: ``x`` drifting by ``drift`` of its scale between passes."""
    generator = torch.Generator().manual_seed(seed)
    values = [x]
    for _ in range(passes - 1):
        values.append(values[-1] + drift * x.std() * torch.randn(x.shape, generator=generator))
    return values


@pytest.mark.parametrize("bits", [3, 4])  # 2 bits: for changes only (below)
def test_both_ends_reconstruct_the_same_bits_and_a_small_change_costs_a_small_error(bits):
    sender, receiver = DeltaReferences(), DeltaReferences()
    values = _epochs(residual_stream(shape=(4, 64, 256)), drift=0.02, passes=4)
    errors = []
    for value in values:
        delta, sent = sender.encode(_key(), value, DeltaBits(bits, bits))
        got = receiver.decode(_key(), delta)
        assert torch.equal(got, sent), "the receiver must compute with what the sender thinks it sent"
        errors.append(_relative(got, value))
    first = _relative(
        rotated.decode(rotated.encode(values[0], bits, False), values[0].shape, torch.float32, bits), values[0]
    )
    assert errors[0] == pytest.approx(first), "a first pass sends the value itself"
    assert max(errors[1:]) < errors[0] / 4, f"changes of 2 % must cost far less than the value's error: {errors}"


def test_the_last_passes_error_is_corrected_not_added_up():
    """The same value sent again and again: each pass's change is the error the receiver still holds."""
    sender, receiver = DeltaReferences(), DeltaReferences()
    x = residual_stream(shape=(4, 64, 256))
    errors = []
    for _ in range(4):
        delta, _ = sender.encode(_key(), x, FOUR)
        errors.append(_relative(receiver.decode(_key(), delta), x))
    assert errors[1] < errors[0] / 5 and errors[2] < errors[1], errors
    assert errors[3] < 0.01, "four passes of a still value land within the reference store's bf16 rounding"


def test_a_replayed_sequence_gives_the_same_bytes():
    values = _epochs(residual_stream(shape=(4, 64, 256)), drift=0.05, passes=3)
    runs = []
    for _ in range(2):
        sender = DeltaReferences()
        runs.append([sender.encode(_key(), value, DeltaBits(4, 3, stochastic=True))[0] for value in values])
    assert runs[0] == runs[1]
    assert runs[0][0].base is None and all(delta.base is not None for delta in runs[0][1:])


def test_a_receiver_without_the_reference_refuses_the_change_and_the_value_itself_goes_through():
    sender, receiver, replica = DeltaReferences(), DeltaReferences(), DeltaReferences()
    first, second = _epochs(residual_stream(shape=(4, 64, 256)), drift=0.02, passes=2)
    delta, _ = sender.encode(_key(), first, FOUR)
    receiver.decode(_key(), delta)
    delta, _ = sender.encode(_key(), second, FOUR)
    assert delta.base is not None
    with pytest.raises(MissingReferenceError):
        replica.decode(_key(), delta)  # did not see the first pass
    sender.forget(_key())
    delta, sent = sender.encode(_key(), second, FOUR)
    assert delta.base is None and torch.equal(replica.decode(_key(), delta), sent)
    other = DeltaReferences()
    other.decode(_key(), DeltaReferences().encode(_key(), -first, FOUR)[0])  # a reference, not the sender's
    with pytest.raises(MissingReferenceError):
        other.decode(_key(), sender.encode(_key(), second, FOUR)[0])
    sender.forget(_key())
    delta, sent = sender.encode(_key(), second, FOUR)
    assert torch.equal(other.decode(_key(), delta), sent), "after a refusal the value itself goes through"


def test_the_store_keeps_within_its_bound_dropping_the_least_recently_used():
    x = residual_stream(shape=(2, 8, 128))
    size = x.numel() * 2  # bfloat16
    references = DeltaReferences(max_bytes=3 * size)
    for sample in "012":
        references.encode(_key(sample), x, FOUR)
    references.encode(_key("0"), x, FOUR)  # 0 is now the most recent
    references.encode(_key("3"), x, FOUR)
    assert len(references) == 3 and references.stored_bytes == 3 * size
    assert set(references._digests) == {_key("0"), _key("2"), _key("3")}
    delta, _ = references.encode(_key("1"), x, FOUR)
    assert delta.base is None, "an evicted sample sends its value again"
    with pytest.raises(ValueError, match="bits"):
        DeltaBits(1, 1)
    with pytest.raises(ValueError, match="bits"):
        DeltaBits(8, 2)


def test_two_bit_changes_after_a_four_bit_value_land_below_the_four_bit_error():
    sender, receiver = DeltaReferences(), DeltaReferences()
    values = _epochs(residual_stream(shape=(4, 64, 256)), drift=0.01, passes=4)
    errors, sizes = [], []
    for value in values:
        delta, sent = sender.encode(_key(), value, DeltaBits(4, 2))
        assert torch.equal(receiver.decode(_key(), delta), sent)
        errors.append(_relative(sent, value))
        sizes.append(delta.nbytes)
    assert sizes[0] == rotated.encoded_bytes(values[0].numel(), 4)
    assert all(size == rotated.encoded_bytes(values[0].numel(), 2) + 8 for size in sizes[1:])
    assert max(errors[1:]) < errors[0] / 2, errors


def test_a_delta_crosses_the_wire_as_its_header_and_payload_and_a_malformed_one_is_refused():
    x = residual_stream(shape=(2, 8, 128)).to(torch.bfloat16)
    sender = DeltaReferences()
    sender.encode(_key(), x, DeltaBits(4, 3))
    delta, _ = sender.encode(_key(), x, DeltaBits(4, 3))
    header, payload = delta.to_wire(), delta.payload_tensor()
    assert Delta.from_wire(header, payload) == delta and delta.dtype == "bfloat16" and delta.bits == 3
    for bad in (
        [b"short", 3, [2, 8, 128], "bfloat16"],
        [delta.base, 3, [2, 8, 129], "bfloat16"],
        [delta.base, 5, [2, 8, 128], "bfloat16"],
        [delta.base, 3, [2, 8, 128], "int8"],
        [None, 3],
    ):
        with pytest.raises(ValueError):
            Delta.from_wire(bad, payload)
    with pytest.raises(ValueError):
        Delta.from_wire(header, payload[:-1])


def test_replicas_sending_a_receiver_the_same_sample_in_turn_each_find_their_own_reference():
    """Two replicas of the span before send the receiver the same sample in turn (the routes alternate): each keeps
    its own reference (a sender's key names the receiver) and the receiver both, told apart by digest, so every pass
    after each one's first is a change, and none is refused."""
    first, second = DeltaReferences(), DeltaReferences()
    receiver = DeltaReferences(per_key=2)
    values = _epochs(residual_stream(shape=(4, 64, 256)), drift=0.02, passes=6)
    for index, value in enumerate(values):
        sender = (first, second)[index % 2]
        delta, sent = sender.encode(_key(to="receiver"), value, DeltaBits(4, 3))
        assert (delta.base is None) == (index < 2), index
        assert torch.equal(receiver.decode(_key(), delta), sent)
    assert len(receiver) == 2 and len(first) == len(second) == 1
    receiver.decode(_key(), DeltaReferences().encode(_key(), values[0], FOUR)[0])  # a third sender's first pass
    assert len(receiver) == 2, "at most per_key references a key: the least recent one goes"
