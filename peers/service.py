"""RPC handlers of a peer: each takes its method's typed request (decoded and checked by the doors), runs it on the
span's compute or the adapters' store (one at a time) and returns the typed reply. What is more than a call lives in
collaborators made with the service's parts: a chain's hops (peers/hops.py), a step's reduction
(peers/reduction/), its commit (peers/commits.py), the gradients' reports (peers/reduction/reports.py) and the moves
of state between peers (peers/statesync.py)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.commits import Commits
from peers.compute import Compute
from peers.deliveries import Deliveries
from peers.hops import Hops
from peers.peer_client import PeerClient
from peers.pullers import RecentPullers
from peers.reduction.audit import AUDIT_RATE
from peers.reduction.exchange import Reduction
from peers.reduction.reports import GradReports
from peers.statesync import StateSync
from peers.stepphase import StepPhases
from swarm.blocks import lora_config_from_wire
from swarm.net.compression import DELTAS
from swarm.net.deltas import Delta, DeltaReferences
from swarm.net.errors import RequestError
from swarm.net.gradnorm import GradNorm
from swarm.net.protocol import (
    Ack,
    BackwardRequest,
    CollectReply,
    CommitReply,
    CommitRequest,
    CommittedRequest,
    DigestReply,
    DigestRequest,
    EndSessionReply,
    EndSessionRequest,
    ForwardRequest,
    GradReply,
    GradsReply,
    GradsRequest,
    HiddenReply,
    InferRequest,
    InfoRequest,
    Method,
    NormsReply,
    NormsRequest,
    OpenReply,
    OpenRequest,
    PeerInfo,
    ReplicateRequest,
    RevertRequest,
    StepsReply,
    TieBreakRequest,
    UnservedRequest,
)
from swarm.net.security import SwarmKey
from swarm.net.servicer import Doorkeeper, FaultHook
from swarm.net.wire import DEFAULT_MAX_PAYLOAD_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerHooks:
    """What the daemon does around requests, given to the service when it is made: checkpoint after a commit (and
    tell standby holders) or a revert (so that the checkpoint is not left ahead), pull a standby copy when its
    server commits, hold the copies a trainer asks for, look at the swarm now when a client finds blocks unserved."""

    after_commit: Callable[[str], Awaitable[None]]
    after_revert: Callable[[str], Awaitable[None]]
    on_committed: Callable[[str, dict, dict[int, int], PeerID], Awaitable[None]]
    on_replicate: Callable[[str, dict, int, list[tuple[range, PeerID]]], Awaitable[dict[int, int]]]
    on_unserved: Callable[[str, list[int]], None]


class InfoDoors(Doorkeeper):
    """The doors of a peer that answer ``info``. Opened alone while the peer chooses and loads its span, so that
    other peers count it where it is going (a joiner's choice, the balancer's rounds) instead of taking its joining
    record for a dead peer's until it serves; the peer then closes them and opens ``PeerService``."""

    def __init__(
        self,
        info: Callable[[], Awaitable[PeerInfo]],
        swarm_key: SwarmKey | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        faults: FaultHook | None = None,
    ):
        super().__init__(swarm_key, max_payload_bytes, faults=faults)
        self.info = info
        self.handlers[Method.INFO] = self._info

    async def _info(self, request: InfoRequest) -> PeerInfo:
        return await self.info()


class PeerService(InfoDoors):
    """The doors of a peer. Every request is validated; a refused request never stops the peer."""

    def __init__(
        self,
        backend: SpanBackend,
        adapters: AdapterStore,
        compute: Compute,
        info: Callable[[], Awaitable[PeerInfo]],
        peers: PeerClient,
        hooks: PeerHooks,
        pullers: RecentPullers,
        swarm_key: SwarmKey | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        faults: FaultHook | None = None,
        audit_rate: float = AUDIT_RATE,
        references: DeltaReferences | None = None,
        deliveries: Deliveries | None = None,
    ):
        """``references``: the samples' last hidden states this peer received and passed on, for delta-coded
        forwards (swarm.net.deltas; default: a store of at most 1 GiB). ``deliveries``: the chain outputs this peer
        holds for the client's ``collect`` (peers/deliveries.py; default: its bounds)."""
        super().__init__(info, swarm_key, max_payload_bytes, faults=faults)
        self.backend, self.adapters, self.compute, self.hooks = backend, adapters, compute, hooks
        self.deliveries = Deliveries() if deliveries is None else deliveries
        self.phases = StepPhases()  # where each block's step stands here (peers/stepphase.py)
        self.reduction = Reduction(lambda: self.me, adapters, compute, peers, self.phases, audit_rate, random.Random())
        self.hops = Hops(lambda: self.me, peers, DeltaReferences() if references is None else references)
        self.sync = StateSync(adapters, compute, peers, pullers, self.phases)
        self.commits, self.reports = Commits(adapters), GradReports(adapters)
        self.handlers.update(
            {
                Method.OPEN: self._open,
                Method.FORWARD: self._forward,
                Method.BACKWARD: self._backward,
                Method.COMMIT: self._commit,
                Method.NORMS: self._norms,
                Method.REVERT: self._revert,
                Method.GRADS: self._grads,
                Method.EXPORT: self.sync.export,
                Method.SYNC: self.sync.sync,
                Method.STATE: self.sync.state,
                Method.DIGEST: self._digest,
                Method.TIEBREAK: self._tiebreak,
                Method.FAST_FORWARD: self.sync.fast_forward,
                Method.COMMITTED: self._committed,
                Method.UNSERVED: self._unserved,
                Method.REPLICATE: self._replicate,
                Method.INFER: self._infer,
                Method.END_SESSION: self._end_session,
                Method.COLLECT: self.deliveries.collect,
            }
        )
        self._background: set[asyncio.Task] = set()

    async def _open(self, request: OpenRequest) -> OpenReply:
        def open_adapter() -> OpenReply:
            steps = self.adapters.open_adapter(
                request.adapter, request.lora, request.seed, request.session, request.weights
            )
            return OpenReply(steps, self.adapters.adapter(request.adapter).standby_steps())

        return await self.compute(open_adapter)

    async def _forward(self, request: ForwardRequest) -> HiddenReply:
        """The span, then (in a chain) the rest of the route, passed on from here: the answer is the last hop's.
        Delta-coded (a ``sample`` and a delta compression): the input may come as a change since the sample's last
        pass, the output goes on as one, and the chain's end answers with one from the client's reference. The
        chain's end hands its output to the client's collect where the request names a ``deliver`` token."""

        delta_coded = request.sample is not None and request.compression in DELTAS

        def forward() -> tuple[torch.Tensor, Delta | None]:
            outputs = self.backend.forward(
                request.adapter,
                request.blocks,
                request.step,
                self.hops.received(request),
                request.mask,
                request.micro_batch,
                request.autocast,
            )
            if not delta_coded:
                return outputs, None
            encode = self.hops.delta_onward if request.route else self.hops.delta_back
            return outputs, encode(request, outputs)

        arrived = time.monotonic()
        (outputs, delta), spent = await self.compute.timed(forward)
        if not request.route:  # the chain's end: its answer to the client
            answer = delta if delta_coded else outputs
            if request.deliver is not None and self.deliveries.offer(
                request.deliver.token, CollectReply(answer, request.compression), request.deliver.hold
            ):
                answer = None  # straight to the client's collect: the chain carries the ack only
            return HiddenReply(answer, request.compression, [self.hops.ack(request.blocks, arrived, spent, (), ())])
        if not delta_coded:
            carried, acks, failure = await self.hops.chain_on(request, arrived, spent, outputs, (), (), hidden=outputs)
            return HiddenReply(carried, request.compression, acks, failure)
        carried, acks, failure = await self.hops.chain_on(
            request,
            arrived,
            spent,
            outputs,
            (),
            (),
            resend=lambda: {"hidden": self.hops.delta_onward(request, outputs, value_only=True)},
            hidden=delta,
        )
        return HiddenReply(carried, request.compression, acks, failure)

    async def _backward(self, request: BackwardRequest) -> GradReply:
        """The span's backward, then (in a chain) the spans before it, handed the gradient of this span's input."""
        arrived = time.monotonic()

        def backward() -> tuple[torch.Tensor | None, tuple[GradNorm, ...], tuple[tuple[int, str], ...]]:
            grad_inputs = self.backend.backward(
                request.adapter,
                request.blocks,
                request.step,
                request.micro_batch,
                request.hidden,
                request.mask,
                request.grad,
                request.input_grad or bool(request.route),
                request.autocast,
            )
            name, blocks, step = request.adapter, request.blocks, request.step
            norms = self.reports.grad_norms(name, blocks, step)
            return grad_inputs, norms, self.reports.grad_hashes(name, blocks, step, request.micro_batch)

        (grad_inputs, norms, hashes), spent = await self.compute.timed(backward)
        self.phases.held(request.adapter, request.blocks, request.step)
        carried, acks, failure = await self.hops.chain_on(
            request, arrived, spent, grad_inputs, norms, hashes, grad=grad_inputs, hidden=None
        )
        return GradReply(carried, request.compression, acks, failure)

    async def _infer(self, request: InferRequest) -> HiddenReply:
        if isinstance(request.hidden, Delta):
            raise RequestError("a generation's hidden states cannot travel as a delta; send them as they are")
        arrived = time.monotonic()
        outputs, spent = await self.compute.timed(self.backend.infer, request, request.hidden, request.mask)
        carried, acks, failure = await self.hops.chain_on(request, arrived, spent, outputs, (), (), hidden=outputs)
        return HiddenReply(carried, request.compression, acks, failure)

    async def _end_session(self, request: EndSessionRequest) -> EndSessionReply:
        return EndSessionReply(await self.compute(self.backend.sessions.end, request.session))

    async def _commit(self, request: CommitRequest) -> CommitReply:
        """Commit a step in one call: fetch the partial sums this peer lacks from the replicas holding them (peer to
        peer, all at once), then one AdamW update from the ledger's reduced gradient, identical on every replica.
        Gradients nobody could provide are reported (``missing_gradients``) and nothing is applied: the client
        replays them and asks again. Idempotent: blocks already past the step are left alone. The reply carries the
        ledger blocks' digests after the step: the replicas' vote (swarm/client/votes.py)."""
        name, step, groups = request.adapter, request.step, request.groups()
        await self.reduction.fetch_missing(request)

        def apply() -> tuple[CommitReply, list[int]]:
            before = self.adapters.adapter(name).steps()
            steps = self.commits.apply(name, step, groups, request.hparams, request.grad_scale)
            digests = self.adapters.digests(name)
            moved = [block for block in groups if before.get(block) == step and steps.get(block) == step + 1]
            return CommitReply(steps, {block: digests[block] for block in groups if block in digests}), moved

        reply, moved = await self.compute(apply)
        self.phases.applied(name, moved, step)
        self.phases.acknowledged(name, moved, step)
        self.in_background(self._after_commit(name, moved, step))  # queued on the compute thread before the next
        return reply

    async def _after_commit(self, name: str, blocks: list[int], step: int) -> None:
        await self.hooks.after_commit(name)
        self.phases.copied(name, blocks, step)

    async def _tiebreak(self, request: TieBreakRequest) -> DigestReply:
        """Break two replicas' tie: the commit's ledger applied to this peer's standby copies, the gradients fetched
        from the ledger's holders (and checked against their hashes) like a commit does; only the digests come
        back."""
        grads = await self.reduction.checked_grads(request)
        digests = await self.compute(
            self.commits.tiebreak,
            request.adapter,
            request.step,
            request.groups(),
            grads,
            request.hparams,
            request.grad_scale,
        )
        return DigestReply(digests)

    async def _norms(self, request: NormsRequest) -> NormsReply:
        """The step's gradient norm shares of the ledger's blocks, for clipping, after fetching the gradients this
        peer lacks like a commit does (the commit then finds them here)."""
        await self.reduction.fetch_missing(request)
        groups = request.groups()
        parts = await self.compute(self.reports.norm_parts, request.adapter, request.step, groups, request.norm_type)
        return NormsReply(parts)

    async def _revert(self, request: RevertRequest) -> StepsReply:
        steps = await self.compute(self.commits.revert, request.adapter, request.step)
        self.phases.taken_back(request.adapter, [b for b, at in steps.items() if at == request.step], request.step)
        self.in_background(self.hooks.after_revert(request.adapter))
        return StepsReply(steps)

    async def _grads(self, request: GradsRequest) -> GradsReply:
        return GradsReply(await self.reduction.serve(request))

    async def _committed(self, request: CommittedRequest) -> Ack:
        """A server of blocks this peer keeps on standby committed a step: pull the new state, in the background."""
        notice = self.hooks.on_committed(request.adapter, request.adapter_meta, request.steps, request.source)
        self.in_background(notice)
        return Ack()

    async def _unserved(self, request: UnservedRequest) -> Ack:
        """A client found blocks without a live server: hold a balance round now (the daemon limits how often)."""
        self.hooks.on_unserved(request.model, request.blocks)
        return Ack()

    async def _replicate(self, request: ReplicateRequest) -> StepsReply:
        """The trainer asks this peer to hold a copy of some blocks' state at ``step`` (pulled from the named
        sources) before it acknowledges the step: what makes a committed step survive the loss of any one peer."""
        try:
            lora_config_from_wire(request.lora)
        except (ValueError, TypeError) as e:
            raise RequestError(f"'lora' is not a LoRA config this swarm can train: {e}") from None
        num_blocks = self.backend.spec.num_blocks
        if any(blocks.stop > num_blocks for blocks, _ in request.sources):
            raise RequestError(f"'sources' must name non-empty block ranges within the model's 0:{num_blocks}")
        held = await self.hooks.on_replicate(request.adapter, request.adapter_meta, request.step, request.sources)
        return StepsReply(held)

    def in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _digest(self, request: DigestRequest) -> DigestReply:
        return DigestReply(await self.compute(self.adapters.digests, request.adapter))
