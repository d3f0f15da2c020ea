"""Global gradient clipping: the norm of the step's whole LoRA gradient, over every block of every peer, and the
factor every replica applies at commit (``SwarmModelForCausalLM.clip_grad_norm_``).

The shares of the norm come with the backward replies (each peer reports its blocks' gradients summed over the
micro-batches it holds), so clipping costs no round trip when one peer holds all of a block's micro-batches, as it
does unless a failure re-routed part of the step. Other blocks, and norm types other than 2 and inf, are asked for:
one request per replica, which first fetches the gradients it lacks (as a commit does; the commit then finds them
there), with the lost ones replayed from what the client kept. A block of three replicas or more is asked of all of
them: they reduce its gradient in chunks together (peers/reduction/scatter.py).
"""

from __future__ import annotations

import logging
import time
from functools import partial

from hivemind.p2p import PeerID

from swarm.client.calls import PeerFailure
from swarm.client.commit import ReplicaSet, judge_accused
from swarm.client.ledger import StepLedger
from swarm.client.remote import RemoteStack
from swarm.client.replays import replay_lost
from swarm.net.errors import CommitError, ErrorKind, RemoteError, ReplyError
from swarm.net.gradnorm import combine
from swarm.net.protocol import NormsRequest, bad_holders, commit_floor, missing_gradients
from swarm.net.reduction import MIN_REDUCERS

logger = logging.getLogger(__name__)

MAX_NORM_ROUNDS = 8
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_factor(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``, as torch computes it."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


def step_norm(hops: RemoteStack, replicas: ReplicaSet, ledger: StepLedger, norm_type: float) -> float:
    """The ``norm_type``-norm of the gradient the commit of ``ledger`` would apply (before any clipping)."""
    parts: dict[int, float] = {}
    for block in ledger.holders:
        reported = ledger.reported_norm(block)
        part = None if reported is None else reported.part(norm_type)
        if part is not None:
            parts[block] = part
    wanted = sorted(block for block in ledger.holders if block not in parts)
    if wanted:
        logger.debug("asking for the gradient norms of blocks %s (step %d)", wanted, ledger.step)
        parts.update(_ask_parts(hops, replicas, ledger, wanted, norm_type))
    return combine(parts.values(), norm_type)


def _ask_parts(
    hops: RemoteStack, replicas: ReplicaSet, ledger: StepLedger, wanted: list[int], norm_type: float
) -> dict[int, float]:
    """Ask current replicas for the norm shares of ``wanted`` blocks: for each block, the replica that already holds
    the most of its micro-batches (the fewest to fetch), or every replica of a block reduced in chunks. Gradients
    that died with a peer are replayed first. Replicas whose shares of a block differ (one was handed a wrong chunk
    or partial sum) are asked again, one of them, with every partial sum fetched and audited, as a commit is."""
    step = ledger.step
    parts: dict[int, float] = {}
    audit = False
    for _ in range(MAX_NORM_ROUNDS):
        replicas.refresh(step)
        left = [block for block in wanted if block not in parts]
        asked = _askees(replicas.peers(step), ledger, left, every=not audit)
        if not asked:
            time.sleep(1.0)  # no current replica of some block right now: it may be syncing or restarting
            hops.calls.router.refresh()
            continue
        lost: dict[int, set[str]] = {}
        ask = partial(_ask, hops, ledger, asked, {} if audit else _reducers(asked), norm_type, audit)
        answers: dict[int, set[float]] = {}
        for shares, lacking in replicas.each(ask, list(asked)):
            for block, share in shares.items():
                answers.setdefault(block, set()).add(share)
            for block, mbs in lacking.items():
                lost.setdefault(block, set()).update(mbs)
        parts.update({block: next(iter(got)) for block, got in answers.items() if len(got) == 1})
        disputed = sorted(block for block, got in answers.items() if len(got) > 1)
        if disputed:
            logger.warning(
                "replicas disagree on the gradient norm of blocks %s (step %d); asking again with every partial sum "
                "audited",
                disputed,
                step,
            )
            audit = True
        if all(block in parts for block in wanted):
            return parts
        if lost:
            replay_lost(hops, ledger, {block: sorted(mbs) for block, mbs in lost.items()})
    raise CommitError(
        f"the gradient norm of step {step} could not be computed in {MAX_NORM_ROUNDS} rounds (blocks "
        f"{[b for b in wanted if b not in parts]}); see the log for why"
    )


def _askees(
    spans: dict[PeerID, range], ledger: StepLedger, blocks: list[int], every: bool = True
) -> dict[PeerID, list[int]]:
    """For each block, the current replica holding the most of its micro-batches' gradients; or, where the block has
    ``MIN_REDUCERS`` replicas or more (and ``every``), every one of them: they reduce its gradient in chunks together
    (each then holds the whole reduced gradient, which its commit finds there)."""
    asked: dict[PeerID, list[int]] = {}
    for block in blocks:
        holders = list(ledger.holders[block].values())
        serving = [peer for peer, span in spans.items() if block in span]
        chosen = serving if every and len(serving) >= MIN_REDUCERS else [max(serving, key=holders.count)]
        for peer in chosen if serving else []:
            asked.setdefault(peer, []).append(block)
    return asked


def _reducers(asked: dict[PeerID, list[int]]) -> dict[int, list[str]]:
    """The blocks asked of several replicas, and those replicas, sorted: they reduce it in chunks."""
    by_block: dict[int, list[str]] = {}
    for peer, blocks in asked.items():
        for block in blocks:
            by_block.setdefault(block, []).append(peer.to_base58())
    return {block: sorted(peers) for block, peers in by_block.items() if len(peers) >= MIN_REDUCERS}


def _ask(
    hops: RemoteStack,
    ledger: StepLedger,
    asked: dict[PeerID, list[int]],
    reducers: dict[int, list[str]],
    norm_type: float,
    audit: bool,
    peer: PeerID,
) -> tuple[dict[int, float], dict[int, list[str]]]:
    """One replica's shares of its ``asked`` blocks, or the gradients nobody could give it (nothing at all when it
    failed), counting those of a holder caught handing on gradients unlike those it reported (it is banned)."""
    calls = hops.calls
    holders = {block: ledger.wire_holders(range(block, block + 1))[block] for block in asked[peer]}
    try:
        request = NormsRequest(
            adapter=calls.adapter,
            step=ledger.step,
            ledger=holders,
            norm_type=norm_type,
            holder_maddrs=calls.holder_maddrs(holders),
            reducers={block: reducers[block] for block in asked[peer] if block in reducers},
            audit=audit,
        )
        return calls.ask(peer, request, floor=commit_floor(request.reducers)).parts, {}
    except PeerFailure:
        return {}, {}
    except RemoteError as e:
        if e.kind not in (ErrorKind.MISSING_GRADIENTS, ErrorKind.BAD_GRADIENTS):
            raise
        try:
            if e.kind == ErrorKind.MISSING_GRADIENTS:
                return {}, missing_gradients(e)
            lost: dict[int, list[str]] = {}
            for banned in judge_accused(hops, ledger, [(peer, holder) for holder in bad_holders(e)]):
                for block, mbs in ledger.held_by(banned).items():
                    lost.setdefault(block, []).extend(mbs)
            return {}, lost
        except ReplyError as bad:  # a garbled refusal: the peer failed
            logger.warning("peer %s: %s", peer, bad)
            return {}, {}
