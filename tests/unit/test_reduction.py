"""One reduction per step (swarm/net/reduction.py): each holder's micro-batches summed in sorted order, the partial
sums added in the order of their first micro-batch. With one holder that is local accumulation to the bit; with more,
it differs from it by summation-order rounding only, within the textbook bound; and a replica that fetched a
holder's partial sum applies the same bits as one that summed the holder's gradients itself."""

from __future__ import annotations

import pytest
import torch

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.commits import Commits
from peers.reduction.held import HeldGradients
from peers.reduction.running import RunningSum
from swarm.net.protocol import SUM, Held, OptimizerHParams, ledger_groups
from swarm.net.reduction import (
    add_chunks,
    add_up,
    chunk_bounds,
    chunk_of,
    from_chunks,
    partial_chunk,
    partial_sum,
    same_bits,
)
from swarm.spec import load_spec

U = 2.0**-24  # fp32's unit roundoff
HPARAMS = OptimizerHParams(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def _grads(count: int, n: int = 4099) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        f"s:0:{i:09d}": [torch.randn(n, generator=g) * 10.0 ** (i % 3), torch.randn(7, generator=g)]
        for i in range(count)
    }


def _accumulated(grads: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """What autograd leaves in ``.grad`` after backwards in this order: the first, then each added in place."""
    mbs = sorted(grads)
    total = [t.clone() for t in grads[mbs[0]]]
    for mb in mbs[1:]:
        for acc, t in zip(total, grads[mb], strict=True):
            acc.add_(t)
    return total


def test_the_ledgers_groups_are_each_holders_micro_batches_in_the_order_of_their_first():
    ledger = {0: {"s:0:2": Held("B"), "s:0:0": Held("A"), "s:0:1": Held("B"), "s:0:3": Held("A")}, 1: {}}
    assert ledger_groups(ledger) == {0: [("s:0:0", "s:0:3"), ("s:0:1", "s:0:2")], 1: []}


def test_with_one_holder_the_reduced_gradient_is_local_accumulation_to_the_bit():
    grads = _grads(8)
    reduced = add_up([partial_sum(grads, tuple(grads))])
    assert all(torch.equal(a, b) for a, b in zip(reduced, _accumulated(grads), strict=True))


def test_a_partial_sum_kept_as_the_backwards_come_is_the_partial_sums_bits_in_any_order_they_come():
    grads = _grads(6)
    mbs = sorted(grads)
    running, held = RunningSum(), {}
    for mb in [mbs[0], mbs[1], mbs[3], mbs[2], mbs[4], mbs[5]]:  # one comes late: the sum starts over
        held[mb] = grads[mb]
        assert same_bits(running.of(held, tuple(held)), partial_sum(held, tuple(held)))
    extended = running.total
    held[mbs[5]] = [t.clone() for t in grads[mbs[0]]]  # a held gradient replaced (drop_unlike, then fetched)
    assert same_bits(running.of(held, tuple(held)), partial_sum(held, tuple(held)))
    assert running.total is not extended
    assert same_bits(running.of(held, tuple(mbs[:3])), partial_sum(held, tuple(mbs[:3])))  # a ledger's subset
    held[mbs[1]][0].mul_(2.0)  # changed in place where it is held
    assert same_bits(running.of(held, tuple(mbs[:3])), partial_sum(held, tuple(mbs[:3])))


def test_with_several_holders_it_differs_by_summation_order_rounding_within_its_bound():
    """|two orders' sums| <= 2 (M-1) u sum_i |g_i|, elementwise (M micro-batches, u fp32's unit roundoff)."""
    grads = _grads(16)
    mbs = sorted(grads)
    groups = [tuple(mbs[0::3]), tuple(mbs[1::3]), tuple(mbs[2::3])]
    reduced = add_up([partial_sum(grads, group) for group in sorted(groups)])
    local = _accumulated(grads)
    for index, (ours, theirs) in enumerate(zip(reduced, local, strict=True)):
        magnitude = torch.stack([grads[mb][index].abs() for mb in mbs]).sum(0)
        assert torch.all((ours - theirs).abs() <= 2 * (len(mbs) - 1) * U * magnitude)
    assert not all(torch.equal(a, b) for a, b in zip(reduced, local, strict=True))  # the order does show


def _micro_batch_ids(count: int) -> list[str]:
    return [f"s:0:{i:09d}" for i in range(count)]


def _replicas_that_computed(model_dir, computes: dict) -> dict[str, SpanBackend]:
    """Span 0:2 replicas by name, adapter "a" open on each, each having run the forward and backward of the
    micro-batches ``computes`` names for it (the hidden states seeded by micro-batch)."""
    spec = load_spec(model_dir)
    cpu, fp32 = torch.device("cpu"), torch.float32
    replicas = {name: SpanBackend(spec, range(0, 2), cpu, fp32, "none", AdapterStore(spec)) for name in computes}
    for name, backend in replicas.items():
        backend.adapters.open_adapter("a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, 7)
        for mb in computes[name]:
            seed = int(mb.rsplit(":", 1)[1])
            hidden = torch.randn(1, 5, spec.hidden_size, generator=torch.Generator().manual_seed(seed))
            backend.forward("a", range(0, 2), 0, hidden, None, mb)
            backend.backward("a", range(0, 2), 0, mb, hidden, None, torch.ones_like(hidden))
    return replicas


def test_a_fetched_partial_sum_applies_the_same_bits_as_one_summed_here(tiny_models):
    """Replica A computed micro-batches 0 and 2, replica B 1 and 3; C holds all four (it computed them too). A
    applies its own sum and B's partial sum; C sums both groups itself: the same state after the step."""
    mbs = _micro_batch_ids(4)
    groups = {block: [(mbs[0], mbs[2]), (mbs[1], mbs[3])] for block in range(2)}
    computes = {"A": [mbs[0], mbs[2]], "B": [mbs[1], mbs[3]], "C": mbs}
    replicas = _replicas_that_computed(tiny_models["llama"], computes)
    from_b = HeldGradients(replicas["B"].adapters).partial_sums("a", 0, {block: [mbs[1], mbs[3]] for block in range(2)})
    HeldGradients(replicas["A"].adapters).add_partials(
        "a", 0, {block: {groups[block][1]: by_key[SUM]} for block, by_key in from_b.items()}
    )
    for name in "AC":
        Commits(replicas[name].adapters).apply("a", 0, groups, HPARAMS)
    assert replicas["A"].adapters.digests("a") == replicas["C"].adapters.digests("a")


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_chunks_cover_the_tensors_end_to_end_and_put_back_together(chunks):
    tensors = [torch.randn(7, 3), torch.randn(11), torch.randn(2, 2, 2)]
    sizes = [t.numel() for t in tensors]
    bounds = [chunk_bounds(sizes, k, chunks) for k in range(chunks)]
    assert bounds[0][0] == 0 and bounds[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
    assert same_bits(from_chunks([chunk_of(tensors, k, chunks) for k in range(chunks)], tensors), tensors)
    with pytest.raises(ValueError):
        chunk_of(tensors, chunks, chunks)


def test_a_reduction_in_chunks_is_the_bits_of_the_whole_sum():
    """Each reducer adds one chunk of every partial sum in the ledger's order; put together, the chunks are the
    whole partial sums added in that order, to the bit (a sum is elementwise)."""
    grads = _grads(9)
    mbs = sorted(grads)
    groups = [tuple(mbs[0::3]), tuple(mbs[1::3]), tuple(mbs[2::3])]
    partials = [partial_sum(grads, group) for group in groups]
    chunks = [add_chunks([chunk_of(part, k, 3) for part in partials]) for k in range(3)]
    assert same_bits(from_chunks(chunks, partials[0]), add_up(partials))


def test_a_gradient_gathered_in_chunks_applies_the_same_bits_as_the_direct_exchange(tiny_models):
    """Replicas A, B and C each computed two of six micro-batches. A fetches B's and C's partial sums (the direct
    exchange); D, which computed none, is handed the reduced gradient in three chunks, each the sum of that chunk of
    every partial sum: the same state after the step."""
    mbs = _micro_batch_ids(6)
    computes = {"A": (mbs[0], mbs[3]), "B": (mbs[1], mbs[4]), "C": (mbs[2], mbs[5])}
    groups = {block: sorted(computes.values()) for block in range(2)}
    replicas = _replicas_that_computed(tiny_models["llama"], {**computes, "D": ()})
    sums = {
        name: HeldGradients(replicas[name].adapters).partial_sums("a", 0, {block: list(group) for block in range(2)})
        for name, group in computes.items()
    }
    for name in "BC":
        partials = {block: {computes[name]: by_key[SUM]} for block, by_key in sums[name].items()}
        HeldGradients(replicas["A"].adapters).add_partials("a", 0, partials)
    for block in range(2):
        parts = [sums[name][block][SUM] for name in sorted(computes, key=computes.get)]
        chunks = [add_chunks([chunk_of(part, k, 3) for part in parts]) for k in range(3)]
        HeldGradients(replicas["D"].adapters).set_gathered("a", 0, block, groups[block], chunks)
    assert HeldGradients(replicas["D"].adapters).missing("a", 0, groups) == {}
    for name in "AD":
        Commits(replicas[name].adapters).apply("a", 0, groups, HPARAMS)
    assert replicas["A"].adapters.digests("a") == replicas["D"].adapters.digests("a")


def test_a_chunk_of_a_partial_sum_summed_alone_is_that_chunk_of_the_whole_sum():
    grads = _grads(5)
    group = tuple(sorted(grads))
    whole = partial_sum(grads, group)
    for k in range(3):
        assert same_bits([partial_chunk(grads, group, k, 3)], [chunk_of(whole, k, 3)])
