"""Gradients that died with a peer, computed again: the client kept each micro-batch's segments (inputs, output
gradients) until its step commits (swarm/client/ledger.py), and replays the lost ones on live replicas."""

from __future__ import annotations

import logging

import torch

from swarm.client.ledger import Segment, StepLedger
from swarm.client.remote import RemoteStack

logger = logging.getLogger(__name__)


def replay_lost(hops: RemoteStack, ledger: StepLedger, missing: dict[int, list[str]]) -> None:
    """Recompute lost gradients (block -> micro-batches) on live replicas from the segments the client kept."""
    plan = ledger.replay_plan(missing)
    logger.warning("replaying %d segment(s) whose gradients died with a peer (step %d)", len(plan), ledger.step)
    for micro_batch, segment in plan:
        replay(hops, micro_batch, segment, ledger.masks.get(micro_batch), ledger)


def replay(
    hops: RemoteStack, micro_batch: str, segment: Segment, mask: torch.Tensor | None, ledger: StepLedger
) -> None:
    """Recompute a micro-batch's gradients on a segment the client kept: along a chain when it is the whole stack
    (the client's link carries its input, output and gradient once), else hop by hop. Peers that still hold their
    gradients keep them: a backward counts once per block."""
    if not hops.chain or segment.start != 0 or segment.end != hops.router.num_blocks:
        hops.backward_segment(segment, mask, ledger, micro_batch, input_grad=False)
        return
    _, forwarded = hops.forward_chain(segment.hidden, mask, ledger.step, micro_batch)
    hops.backward_chain(forwarded, segment.grad_outputs, mask, ledger, micro_batch, input_grad=False)
