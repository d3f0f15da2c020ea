"""What counts as an honest difference (swarm/net/numerics.py): one class is compared at its kernels' rounding, classes
apart at their announced errors, read as at most their quantization's cap; too loose a tolerance is none."""

from __future__ import annotations

import pytest

from swarm.net.numerics import ERROR_CAPS, EXACT, ROUNDING_PER_BLOCK, SAFETY, Numerics, tolerance


def test_one_class_is_compared_at_its_rounding_per_block():
    other_kernels = Numerics("none", "float32", "cpu", {0: 0.5})  # an error announced in the exact class is moot
    assert tolerance(EXACT, other_kernels, range(0, 3)) == pytest.approx(3 * ROUNDING_PER_BLOCK["float32"])


def test_the_clients_autocast_widens_the_rounding():
    assert tolerance(EXACT, EXACT, [0], autocast="bfloat16") == ROUNDING_PER_BLOCK["bfloat16"]


def test_classes_apart_are_compared_at_their_announced_errors():
    int8 = Numerics("int8", "float32", "cpu", {0: 0.02, 1: 0.03})
    expected = 2 * ROUNDING_PER_BLOCK["float32"] + SAFETY * 0.05
    assert tolerance(int8, EXACT, range(2)) == pytest.approx(expected)
    assert tolerance(int8, EXACT, range(2)) == tolerance(EXACT, int8, range(2))


def test_an_announcement_is_read_as_at_most_its_quantizations_cap_and_a_missing_one_as_the_cap():
    bragging = Numerics("int8", "float32", "cpu", {0: 5.0})
    assert bragging.error([0]) == ERROR_CAPS["int8"]
    assert Numerics("int8", "float32", "cpu", {}).error([0]) == ERROR_CAPS["int8"]
    assert Numerics("int8", "float32", "cpu", {0: -1.0}).error([0]) == 0.0


def test_a_tolerance_that_would_tell_nothing_is_none():
    nf4 = Numerics("nf4", "float32", "cpu", {0: 0.4, 1: 0.4})
    assert tolerance(nf4, EXACT, range(2)) is None
    assert tolerance(nf4, nf4, range(2)) == pytest.approx(2 * ROUNDING_PER_BLOCK["float32"])


def test_numerics_travel_and_malformed_ones_are_refused():
    nf4 = Numerics("nf4", "bfloat16", "cuda", {3: 0.25})
    assert Numerics.from_wire(nf4.to_wire()) == nf4 and Numerics.from_wire(nf4.to_wire()).errors == {3: 0.25}
    wire = nf4.to_wire()
    for bad in ({**wire, "quant": "fp3"}, {**wire, "errors": {"0": float("nan")}}, {k: wire[k] for k in ("quant",)}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            Numerics.from_wire(bad)
