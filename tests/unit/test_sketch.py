"""Sketches of micro-batch gradients (swarm/net/sketch.py, issue 59 item 1): a partial sum's sketch is the sum of
its micro-batches' within the sum's rounding at any number of micro-batches, a sum changed by more than that
rounding is told, forged sketches that add up to a wrong sum are told one micro-batch at a time, and the signs are
the same integers on every device and kernel."""

from __future__ import annotations

import pytest
import torch

from swarm.net import sketch
from swarm.net.reduction import add_up, chunk_of, partial_chunk
from swarm.testing.dishonest import ForgedSketches

MASK = (1 << 64) - 1


def _splitmix(index: int, seed: int) -> int:
    """splitmix64 of ``seed + index x golden`` in Python integers: what ``sign_words`` must compute in int64."""
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _grads(count: int, generator: torch.Generator, size: int = 20_000) -> list[list[torch.Tensor]]:
    """``count`` micro-batch gradients of one block (two LoRA tensors), of magnitudes apart by up to 1e4."""
    scales = 10.0 ** torch.randint(-2, 3, (count,), generator=generator)
    return [
        [scale * torch.randn(size // 4, 2, generator=generator), scale * torch.randn(size // 2, generator=generator)]
        for scale in scales.tolist()
    ]


def test_the_signs_are_splitmix64_in_integers():
    seed = (1 << 59) + 12345
    words = sketch.sign_words(0, 2000, seed)
    assert [int(w) & MASK for w in words] == [_splitmix(i, seed) for i in range(2000)]
    assert torch.equal(sketch.sign_words(1000, 2000, seed), words[1000:])


@pytest.mark.parametrize("micro_batches", [1, 2, 8, 32])
def test_a_partial_sum_agrees_with_its_micro_batches_sketches(micro_batches):
    grads = _grads(micro_batches, torch.Generator().manual_seed(micro_batches))
    summed = add_up(grads)
    reported = sketch.sketches([sketch.flat(g) for g in grads], sketch.seed_of(summed))
    assert reported.shape == (micro_batches, sketch.ROWS) and reported.dtype == torch.float64
    own = sketch.sketches([sketch.flat(summed)], sketch.seed_of(summed))[0]
    assert sketch.sum_agrees(own, reported, torch.float32)
    assert sketch.are_sketches(reported, [sketch.flat(g) for g in grads], summed)


@pytest.mark.parametrize("micro_batches", [2, 16])
def test_a_sum_changed_by_a_thousandth_of_a_gradient_is_told(micro_batches):
    """A change to the sum moves its signs too (they are drawn from its hash), so the sketches reported for the
    honest sum cannot be kept; those of its micro-batches computed under the new signs do not add up to it. (The
    bound lets through changes below 8 (micro-batches - 1) x 2**-24 of the gradients' summed norms: 7e-6 of them at
    16 micro-batches; this one is a thousandth of their mean norm.)"""
    grads = _grads(micro_batches, torch.Generator().manual_seed(7))
    wrong = add_up(grads)
    wrong[1][3] += 1e-3 * sum(float(sketch.flat(g).norm()) for g in grads) / micro_batches
    reported = sketch.sketches([sketch.flat(g) for g in grads], sketch.seed_of(wrong))
    own = sketch.sketches([sketch.flat(wrong)], sketch.seed_of(wrong))[0]
    assert not sketch.sum_agrees(own, reported, torch.float32)


def test_forged_sketches_add_up_but_none_is_its_micro_batches():
    """The liar of swarm/testing/dishonest.py: its forged sketches pass the sum's check; each fails alone."""
    grads = _grads(4, torch.Generator().manual_seed(3))
    by_mb = {f"s:0:{i}": g for i, g in enumerate(grads)}
    group = tuple(sorted(by_mb))
    honest = {0: {"+": add_up([by_mb[mb] for mb in group])}}
    liar = ForgedSketches()
    wrong = liar.partial_sums(honest)
    summed = wrong[0]["+"]
    wrong[0]["#"] = [sketch.sketches([sketch.flat(by_mb[mb]) for mb in group], sketch.seed_of(summed))]
    forged = liar.sketched(wrong)[0]["#"][0]
    own = sketch.sketches([sketch.flat(summed)], sketch.seed_of(summed))[0]
    assert sketch.sum_agrees(own, forged, torch.float32)
    for index, mb in enumerate(group):
        assert not sketch.are_sketches(forged[index : index + 1], [sketch.flat(by_mb[mb])], summed)


def test_a_chunk_of_a_sum_agrees_with_its_micro_batches_chunks():
    """The chunked reduction hands a chunk of a partial sum with the sketches of that chunk of each gradient."""
    grads = _grads(5, torch.Generator().manual_seed(5))
    by_mb = {f"s:0:{i}": g for i, g in enumerate(grads)}
    group = tuple(sorted(by_mb))
    summed = [partial_chunk(by_mb, group, 1, 3)]
    vectors = [chunk_of(by_mb[mb], 1, 3) for mb in group]
    reported = sketch.sketches(vectors, sketch.seed_of(summed))
    own = sketch.sketches([sketch.flat(summed)], sketch.seed_of(summed))[0]
    assert sketch.sum_agrees(own, reported, torch.float32)
    assert sketch.are_sketches(reported, vectors, summed)


def test_a_sketch_computed_in_another_order_is_the_same_sketch():
    """Another device adds the projections in another order: rows one at a time, in float64, against the batched
    product."""
    vector = sketch.flat(_grads(1, torch.Generator().manual_seed(11), size=70_000)[0])
    seed = 12345
    words = sketch.sign_words(0, vector.numel(), seed)
    rows = torch.stack(
        [(vector.double() * (1 - 2 * ((words >> row) & 1)).double()).sum() for row in range(sketch.ROWS)]
    )
    assert sketch.same_sketch(rows, sketch.sketches([vector], seed)[0], vector)
    rows[5] += 1e-6 * rows.abs().max()
    assert not sketch.same_sketch(rows, sketch.sketches([vector], seed)[0], vector)


def test_sketches_of_another_shape_are_refused():
    grads = _grads(2, torch.Generator().manual_seed(2))
    summed = add_up(grads)
    reported = sketch.sketches([sketch.flat(g) for g in grads], sketch.seed_of(summed))
    assert not sketch.are_sketches(reported[:1], [sketch.flat(g) for g in grads], summed)
