"""The auditor's verdicts on one holder's partial sum (peers/reduction/audit.py, issue 59 item 1), its fetches
answered by a stand-in for the peer client: honest sketches pass; a sum whose sketches do not add up fails with no
fetch; forged sketches pass the sum's check and fail the audit of a micro-batch; and a holder whose micro-batch
gradient does not come (gone, silent, refusing) is not passed: its sum is not taken."""

from __future__ import annotations

import asyncio
import random

import torch
from hivemind.p2p import PeerID

from peers.compute import Compute
from peers.reduction.audit import Auditor, Verdict
from swarm.net import protocol, sketch
from swarm.net.gradhash import grad_hash
from swarm.net.protocol import Held
from swarm.net.reduction import add_up
from swarm.testing.dishonest import ForgedSketches

HOLDER = PeerID(b"h" * 8).to_base58()
HPARAMS = protocol.OptimizerHParams(1e-3, (0.9, 0.999), 1e-8, 0.01)
BLOCK = 3


class Holder:
    """Answers the auditor's fetch of micro-batch gradients from ``grads`` (or with nothing: ``silent``)."""

    def __init__(self, grads: dict[str, list[torch.Tensor]], silent: bool = False) -> None:
        self.grads, self.silent, self.fetched = grads, silent, []

    async def fetch_grads(self, peer, name, step, wanted, timeout, summed=False, chunk=0, chunks=0):
        self.fetched.append(wanted)
        if self.silent:
            return {}
        return {block: {mb: self.grads[mb] for mb in mbs} for block, mbs in wanted.items()}


def _step(micro_batches: int = 4):
    generator = torch.Generator().manual_seed(micro_batches)
    grads = {
        f"s:0:{i}": [torch.randn(64, 8, generator=generator), torch.randn(300, generator=generator)]
        for i in range(micro_batches)
    }
    group = tuple(sorted(grads))
    ledger = {BLOCK: {mb: Held(HOLDER, grad_hash(grads[mb])) for mb in group}}
    request = protocol.CommitRequest(adapter="run", step=0, ledger=ledger, hparams=HPARAMS)
    return grads, group, request


def _handed(grads, group, liar=None):
    """The holder's reply: its partial sum and the sketches beside it, as ``HeldGradients.partial_sums`` makes
    them (a liar's behaviour applied as a peer applies it)."""
    found = {BLOCK: {protocol.SUM: add_up([grads[mb] for mb in group])}}
    if liar is not None:
        found = liar.partial_sums(found)
    summed = found[BLOCK][protocol.SUM]
    found[BLOCK][protocol.SKETCH] = [sketch.sketches([sketch.flat(grads[mb]) for mb in group], sketch.seed_of(summed))]
    return found if liar is None else liar.sketched(found)


def _verdict(holder: Holder, request, group, handed, audit: bool) -> Verdict:
    compute = Compute()
    auditor = Auditor(compute, holder, rate=1.0, rng=random.Random(0))
    partials = {BLOCK: {group: handed[BLOCK][protocol.SUM]}}
    sketches = {BLOCK: handed[BLOCK][protocol.SKETCH][0]}
    try:
        return asyncio.run(auditor.check(request, HOLDER, partials, sketches, audit=audit))
    finally:
        compute.shutdown()


def test_honest_sketches_pass_with_and_without_an_audit():
    grads, group, request = _step()
    for audit in (False, True):
        holder = Holder(grads)
        assert _verdict(holder, request, group, _handed(grads, group), audit) is Verdict.PASSED
        assert len(holder.fetched) == int(audit) and all(len(w[BLOCK]) == 1 for w in holder.fetched)


def test_a_sum_whose_sketches_do_not_add_up_fails_without_a_fetch():
    grads, group, request = _step()
    handed = _handed(grads, group)
    handed[BLOCK][protocol.SUM] = [t * 1.001 for t in handed[BLOCK][protocol.SUM]]
    holder = Holder(grads)
    assert _verdict(holder, request, group, handed, audit=False) is Verdict.FAILED
    assert holder.fetched == []


def test_forged_sketches_pass_the_sums_check_and_fail_the_audit_of_one_micro_batch():
    grads, group, request = _step()
    handed = _handed(grads, group, ForgedSketches())
    assert _verdict(Holder(grads), request, group, handed, audit=False) is Verdict.PASSED
    assert _verdict(Holder(grads), request, group, handed, audit=True) is Verdict.FAILED


def test_a_holder_silent_to_the_audit_is_not_passed():
    grads, group, request = _step()
    handed = _handed(grads, group, ForgedSketches())
    assert _verdict(Holder(grads, silent=True), request, group, handed, audit=True) is Verdict.UNCHECKED
