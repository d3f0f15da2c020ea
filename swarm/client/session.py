"""An adapter open in the swarm: the connection, the peers holding the adapter, and (for its trainer) the lease, the
step ledger, commits and durable copies, behind a small API. The model only computes. A reader is a model whose
session is an ``AdapterSession`` without training: it claims nothing and changes nothing on any peer."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID

from swarm.blocks import lora_config_from_wire, spans_text
from swarm.client.calls import PeerCalls, PeerFailure, Recovery
from swarm.client.chaindeltas import ChainDeltas
from swarm.client.clipping import step_norm
from swarm.client.commit import ReplicaSet, StepsLost, commit, take_back_abandoned
from swarm.client.config import SwarmConfig
from swarm.client.copies import CopyKeeper
from swarm.client.current import CurrentPeers
from swarm.client.joiners import judge_joiners
from swarm.client.lease import AdapterLease
from swarm.client.ledger import StepLedger
from swarm.client.remote import RemoteStack
from swarm.client.routing import Router
from swarm.client.trust import Trust, spot_check_policy
from swarm.client.unserved import UnservedNotice
from swarm.lora_options import blocks_without_lora
from swarm.net.deltas import DeltaReferences
from swarm.net.errors import AdapterStateLostError, SwarmUnavailableError, WeightsMismatchError
from swarm.net.network import check_access
from swarm.net.protocol import DigestRequest, OpenRequest, OptimizerHParams, Reply, Request, StateRequest
from swarm.net.records import RECOVERIES_KEPT, CommittedRecord, announce_committed, read_committed
from swarm.net.security import Identity, SwarmKey
from swarm.net.transport import Transport
from swarm.net.waiting import Deadline, WaitLine
from swarm.spec import ModelSpec
from swarm.weights import block_digests, differing

logger = logging.getLogger(__name__)

# per step: how many times a step whose new state died with every peer that applied it, before a copy was made, is
# committed again (a churn run lost such a step: declared lost after lost_grace at the next one)
RECOMMITS = 2
# at a step's start: how long a joiner and the replica it joined that differ, with nobody to break the tie, hold the
# step back while the client looks for another replica of their blocks (the vote after the step judges them anyway)
TIE_WAIT = 30.0


@dataclass(frozen=True)
class AdapterIdentity:
    """What names an adapter's training in the swarm: its name, LoRA config (wire form) and init seed."""

    name: str
    lora: dict
    seed: int


class TrainerTracking:
    """Bring new peers in at the trainer's step: open them, sync the laggards (``ReplicaSet.refresh``)."""

    def __init__(self, replicas: ReplicaSet, current: CurrentPeers):
        self.replicas, self.current = replicas, current

    def __call__(self) -> None:
        self.replicas.refresh(self.current.step)


class ReaderTracking:
    """Follow the adapter's newest committed step and the peers holding it; opens without claiming, syncs nothing."""

    def __init__(self, dht: DHT, model: str, adapter: str, replicas: ReplicaSet, current: CurrentPeers):
        self.dht, self.model, self.adapter, self.replicas, self.current = dht, model, adapter, replicas, current

    def __call__(self) -> None:
        recorded = read_committed(self.dht, self.model, self.adapter)
        if recorded is not None and recorded.step > self.current.step:
            self.current.step = recorded.step
        self.replicas.follow(self.current.step)


class AdapterSession:
    """The adapter's peers, trainer and reader alike: who is current, calls and hops through them, and the
    adapter's state read back from them. On its own, a reader's session."""

    def __init__(
        self,
        spec: ModelSpec,
        dht: DHT,
        transport: Transport,
        router: Router,
        current: CurrentPeers,
        calls: PeerCalls,
        replicas: ReplicaSet,
        hops: RemoteStack,
        adapter: AdapterIdentity,
        catch_up: Callable[[], None],
    ):
        self.spec, self.dht, self.transport, self.router = spec, dht, transport, router
        self.current, self.calls, self.replicas, self.hops, self.adapter = current, calls, replicas, hops, adapter
        self.catch_up = catch_up  # brings peers in: while a hop waits for a server, and before reads

    @property
    def step(self) -> int:
        """The step this client works at: the trainer's step in progress, or the committed step a reader reads."""
        return self.current.step

    @property
    def recoveries(self) -> list[Recovery]:
        return self.calls.recoveries

    def start(self) -> None:
        """A reader starts at the adapter's committed step, once the swarm can serve it."""
        self.current.step = self._resume_step("committed")
        self.catch_up()

    def _resume_step(self, resume: str) -> int:
        """The adapter's last committed step, and wait (up to ``patience``) until the swarm can serve it.

        The trainer records the committed step in the DHT at every commit; peers hold their blocks' steps. The step
        to resume at is the newest of both: a restarted client never starts over on an adapter that has committed
        steps, and waits for peers that still load. It goes once every block has a live server and a live copy at
        that step (laggards sync from it), or, with nothing recorded (a new swarm), once every block has a server.
        """
        name = self.adapter.name
        recorded = read_committed(self.dht, self.spec.name, name)
        if recorded is not None and (recorded.lora != self.adapter.lora or recorded.seed != self.adapter.seed):
            raise ValueError(
                f"adapter {name!r} was trained with another LoRA config or seed (by {recorded.trainer!r}); "
                "pass the same lora_config and seed to resume it, or pick another adapter name"
            )
        for peer in recorded.dishonest if recorded is not None else []:
            self.hops.trust.ban_dishonest(PeerID.from_base58(peer), "this adapter's trainer found it dishonest")
        deadline = Deadline(self.calls.patience)
        waiting = WaitLine(f"waiting for the peers of adapter {name!r}", deadline, logger)
        while True:
            self.router.refresh()
            spans = self.router.live_servers(eligible_only=False)
            served = self.replicas.open_many(list(spans))
            held: dict[int, set[int]] = {}
            for steps in [*served.values(), *self.replicas.standby.values()]:
                for block, step in steps.items():
                    held.setdefault(block, set()).add(step)
            newest = max([recorded.step if recorded else 0, *(s for steps in held.values() for s in steps)])
            # served means announced online: a peer moving onto a block already holds it, but does not serve it yet
            covered = {block for peer, steps in served.items() for block in steps if block in spans[peer]}
            uncovered = [b for b in range(self.spec.num_blocks) if b not in covered]
            missing = [b for b in range(self.spec.num_blocks) if newest not in held.get(b, ())]
            unanswered = {p for peers in self.router.announced().values() for p in peers} - set(served)
            give_up = deadline.passed  # on peers that never answered, with resume="latest"
            if not uncovered and (
                not missing or recorded is None or (resume == "latest" and (give_up or not unanswered))
            ):
                waiting.done(f"ready at step {newest}")
                if missing:
                    logger.warning("resuming adapter %r without step %d on blocks %s", name, newest, missing)
                return newest
            if give_up:
                waiting.done("gave up")
                if uncovered:
                    raise SwarmUnavailableError.unserved(uncovered, self.calls.patience)
                newest_held = {b: max(held[b]) for b in missing if b in held}
                raise AdapterStateLostError(
                    f"adapter {name!r} is at step {newest}, but no live peer holds blocks {missing} at that "
                    f"step (the newest they hold: {newest_held or 'none'}). Restart the peers that held them with "
                    'their --checkpoint-dir, or pass resume="latest" to continue from the newest state they hold '
                    "(the steps in between are lost and listed in model.steps_lost)"
                )
            # a new adapter waits for servers only; a recorded one also for copies at its step
            behind = f"; not at step {newest} yet: {spans_text(missing)}" if recorded is not None else ""
            waiting.update(f"blocks without a server yet: {spans_text(uncovered)}{behind}")
            deadline.pause(1.0)

    def _each_block(self, request: Request) -> list[tuple[PeerID, range, Reply]]:
        """Ask every current replica (used for exports and checks), waiting up to ``patience`` for every block
        to have answered at least once: a replica banned a moment ago may be back in seconds."""
        deadline = Deadline(self.calls.patience)
        waiting = WaitLine(f"waiting for the replicas of adapter {self.adapter.name!r} to answer", deadline, logger)
        answers: dict[PeerID, tuple[PeerID, range, Reply]] = {}
        while True:
            self.catch_up()
            current = {p: span for p, span in self.router.live_servers().items() if self.current.eligible(p)}
            for peer, span in current.items():
                if peer in answers and answers[peer][1] == span:
                    continue  # asked already; a peer that moved since is asked again for its new blocks
                try:
                    answers[peer] = (peer, span, self.calls.ask(peer, request))
                except PeerFailure:
                    continue
            covered = {b for _, span, _ in answers.values() for b in span}
            if len(covered) == self.spec.num_blocks or deadline.passed:
                waiting.done("every block answered" if len(covered) == self.spec.num_blocks else "gave up")
                return list(answers.values())
            waiting.update(f"blocks not answered yet: {spans_text(sorted(set(range(self.spec.num_blocks)) - covered))}")
            deadline.pause(1.0)

    def adapter_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """LoRA tensors of every block, from live replicas at the current step."""
        bare = blocks_without_lora(lora_config_from_wire(self.adapter.lora), self.spec)
        state: dict[int, dict[str, torch.Tensor]] = {block: {} for block in bare}
        for _, span, reply in self._each_block(StateRequest(adapter=self.adapter.name)):
            for block, tensors in reply.state.items():
                if block in span:  # a peer handing blocks over may still hold them, not current any more
                    state.setdefault(block, {}).update(tensors)
        missing = [b for b in range(self.spec.num_blocks) if b not in state]
        if missing:
            raise SwarmUnavailableError(
                f"no live replica holds blocks {spans_text(missing)} of adapter {self.adapter.name!r} at step "
                f"{self.step} (waited {self.calls.patience:.0f}s); start or restart peers serving them, or raise "
                "the client's patience"
            )
        return state

    def replica_digests(self) -> dict[int, dict[PeerID, str]]:
        """Per block, the state digest each live replica reports: equal digests mean identical replicas."""
        digests: dict[int, dict[PeerID, str]] = {}
        for peer, span, reply in self._each_block(DigestRequest(adapter=self.adapter.name)):
            for block, digest in reply.digests.items():
                if block in span:
                    digests.setdefault(block, {})[peer] = digest
        return digests

    def close(self) -> None:
        """Leave the swarm: stop routing, close this client's P2P connection and DHT node."""
        self.router.refresher.stop()
        self.replicas.close()
        self.hops.collects.close()
        RemoteExpertWorker.run_coroutine(self.transport.shutdown())
        self.dht.shutdown()


class TrainingSession(AdapterSession):
    """The adapter's one trainer: it holds the lease, keeps the step's ledger, commits it on every replica and
    makes the new state durable before ``commit`` returns."""

    def __init__(
        self,
        *parts,
        lease: AdapterLease,
        copies: CopyKeeper,
        trainer: str,
        owner: bytes,
        session_id: str,
        **named,
    ):
        super().__init__(*parts, **named)
        self.lease, self.copies, self.trainer, self.owner = lease, copies, trainer, owner
        self.ledger = StepLedger(step=self.current.step, session=session_id)
        self.judged: set[PeerID] = set()  # the replicas whose states were compared at the step: the last vote's
        self.opened: int | None = None  # the step whose first micro-batch was made

    def start(self, resume: str = "committed") -> None:
        """Take the lease and resume at the adapter's last committed step, with its copies in place."""
        self.lease.acquire(self.calls.patience)
        self._set_ledger(StepLedger(step=self._resume_step(resume), session=self.ledger.session))
        self.replicas.refresh(self.step, accept_losses=resume == "latest")
        self.copies.ensure(self.step, self.replicas.peers(self.step))

    def _set_ledger(self, ledger: StepLedger) -> None:
        self.ledger, self.current.step = ledger, ledger.step

    @property
    def steps_lost(self) -> list[StepsLost]:
        return self.replicas.lost

    def commit(self, hparams: OptimizerHParams) -> int:
        """Commit the step in progress on every live replica of every block; returns the new step."""
        if self.ledger.empty:
            logger.warning("optimizer step with no backward since the last step: nothing to commit")
            return self.step
        ledger = self.ledger
        for attempt in range(RECOMMITS + 1):
            applied = commit(self.hops, self.replicas, ledger, hparams)
            self._set_ledger(ledger.next())
            self.copies.ensure(self.step, applied)
            died = self.copies.died_uncopied(applied) if attempt < RECOMMITS else []
            if not died:
                break
            logger.warning(
                "blocks %s of step %d died with every peer that applied it, before any copy was made: committing "
                "the step again on the peers left, from the copies of the step before",
                spans_text(died),
                ledger.step,
            )
            self._set_ledger(ledger)
        recent = [
            {"peer": r.peer.to_base58(), "during": r.during, "step": r.step, "seconds": round(r.seconds, 2)}
            for r in self.recoveries[-RECOVERIES_KEPT:]
        ]
        lost = sum(e.steps for e in self.steps_lost)
        dishonest = [peer.to_base58() for peer in self.hops.trust.dishonest]  # for `swarm status`, health, a restart
        adapter, weights = self.adapter, dict(self.router.weights)
        record = CommittedRecord(self.step, adapter.lora, adapter.seed, self.trainer, recent, lost, dishonest, weights)
        announce_committed(self.dht, self.spec.name, self.adapter.name, self.owner, record)
        self.judged = set(applied)
        return self.step

    def new_micro_batch(self) -> str:
        """A micro-batch id of the step in progress; the step's first brings in the replicas that joined first."""
        if self.opened != self.step:
            self.opened = self.step
            self._admit_joiners()
        return self.ledger.new_micro_batch()

    def _admit_joiners(self) -> None:
        """A fresh look at the swarm, the peers that joined or moved opened and synced, and the replicas not in the
        last vote compared with the others (``judge_joiners``): before any micro-batch of the step is routed, so
        that none runs through a state its replicas outvote."""
        deadline = time.monotonic() + TIE_WAIT
        while True:
            self.router.refresher.refresh_soon()
            self.router.refresher.wait_fresh(timeout=self.router.options.refresh_every)
            self.replicas.refresh(self.step)
            judgement = judge_joiners(self.hops.trust, self.replicas, self.step, self.judged)
            if not judgement.undecided or time.monotonic() >= deadline:
                break
            # A joiner and the replica it joined differ: whichever is honest, the step must not run through both.
            # Another replica on its way (a joiner still syncing, a slow machine's DHT) breaks the tie.
            logger.info("blocks %s: two replicas differ; looking for a third", spans_text(judgement.undecided))
        self.judged = judgement.judged

    def grad_norm(self, norm_type: float) -> float:
        """The norm of the step's gradient so far, as the commit would apply it (its clipping factor included)."""
        return step_norm(self.hops, self.replicas, self.ledger, norm_type) * self.ledger.grad_scale

    def discard_step(self) -> None:
        """Forget the micro-batches of the step in progress (their gradients are never committed)."""
        if self.ledger.committing:
            take_back_abandoned(self.replicas, self.ledger.step)
        self._set_ledger(self.ledger.discarded())

    def close(self) -> None:
        """Stop the copies, release the lease, then leave."""
        self.copies.close()
        self.lease.release()
        super().close()


def training_session_of(session: AdapterSession) -> TrainingSession:
    """The trainer's session; a reader's (``is_trainable=False``) has no training: refused, saying why."""
    if not isinstance(session, TrainingSession):
        raise ValueError(
            f"training needs a trainer: this client opened adapter {session.adapter.name!r} with is_trainable=False "
            "(it reads the adapter and generates, while its trainer trains)"
        )
    return session


def committed_or_raise(dht: DHT, spec: ModelSpec, adapter: str) -> CommittedRecord:
    """The adapter's committed record, which a reader needs: there is nothing to read without one."""
    recorded = read_committed(dht, spec.name, adapter)
    if recorded is None:
        raise AdapterStateLostError(
            f"adapter {adapter!r} has no committed step in this swarm: there is nothing to read yet. Train it first "
            "(is_trainable=True), or check its name"
        )
    return recorded


def pinned_weights(dht: DHT, spec: ModelSpec, adapter: str) -> dict[int, str]:
    """The base weights (block -> digest, swarm/weights.py) the adapter trains on: this client's own folder's when it
    holds every block's tensors, else those its committed record pins, else none yet (the router pins what the
    peers announce). A folder whose weights differ from the committed pin is another model: refused."""
    recorded = read_committed(dht, spec.name, adapter)
    pinned = recorded.weights if recorded is not None else {}
    local = block_digests(spec)
    if len(local) < spec.num_blocks:
        return dict(pinned)
    differ = differing(local, pinned, range(spec.num_blocks))
    if differ:
        raise WeightsMismatchError(
            f"adapter {adapter!r} was trained on other base weights of blocks {spans_text(differ)} than those in "
            f"{spec.path} (same folder name, another model: a fine-tune, revision or renamed copy); load the folder "
            "it was trained on, or pick another adapter name"
        )
    return local


def _opener(
    calls: PeerCalls, adapter: AdapterIdentity, session_id: str | None
) -> Callable[[PeerID], tuple[dict[int, int], dict[int, int]]]:
    """Open (or claim) the adapter on a peer: its committed step per served block and per standby copy. Without a
    session id (a reader) it claims nothing. The request pins the base weights: a peer with others refuses it."""

    def open_on(peer_id: PeerID) -> tuple[dict[int, int], dict[int, int]]:
        request = OpenRequest(
            adapter=adapter.name,
            lora=adapter.lora,
            seed=adapter.seed,
            session=session_id,
            weights=dict(calls.router.weights),
        )
        reply = calls.ask(peer_id, request)
        return reply.steps, reply.standby

    return open_on


def open_session(
    spec: ModelSpec,
    dht: DHT,
    identity: Identity,
    swarm_key: SwarmKey | None,
    initial_peers: list[str],
    adapter: AdapterIdentity,
    config: SwarmConfig,
) -> AdapterSession:
    """Assemble a session over a joined DHT, each part given what it needs of ``config`` when it is made: a reader's
    if it is not trainable. Everything started is stopped again if a later part fails (the DHT included)."""
    with contextlib.ExitStack() as undo:
        undo.callback(dht.shutdown)
        transport = Transport.for_dht(dht, swarm_key)
        undo.callback(lambda: RemoteExpertWorker.run_coroutine(transport.shutdown()))
        RemoteExpertWorker.run_coroutine(check_access(transport, initial_peers))
        trainer = config.trainer_name()
        reading = trainer is None
        if reading:
            committed_or_raise(dht, spec, adapter.name)
        current = CurrentPeers(step=0, exact=not reading)
        router = _router(dht, transport, spec, adapter.name, config, current)
        undo.callback(router.refresher.stop)
        calls = PeerCalls(transport, router, current, adapter.name, config.patience, config.wire, config.call_hook)
        session_id = uuid.uuid4().hex[:16]
        replicas = _replica_set(calls, current, _opener(calls, adapter, None if reading else session_id), config)
        undo.callback(replicas.close)
        if reading:
            catch_up: Callable[[], None] = ReaderTracking(dht, spec.name, adapter.name, replicas, current)
        else:
            catch_up = TrainerTracking(replicas, current)
        unserved = UnservedNotice(transport, router, spec.name)
        hops = _remote_stack(calls, catch_up, unserved, config, private=swarm_key is not None)
        parts = (spec, dht, transport, router, current, calls, replicas, hops, adapter, catch_up)
        session: AdapterSession
        if reading:
            session = AdapterSession(*parts)
            session.start()
        else:
            copies = CopyKeeper(calls, replicas, config.min_copies, adapter.lora, adapter.seed)
            undo.callback(copies.close)
            lease = AdapterLease(dht, spec.name, adapter.name, identity.owner, trainer, session_id)
            undo.callback(lease.release)
            session = TrainingSession(
                *parts,
                lease=lease,
                copies=copies,
                trainer=trainer,
                owner=identity.owner,
                session_id=session_id,
            )
            session.start(config.resume)
        router.refresher.start()
        undo.pop_all()
    logger.info("adapter %r at step %d", adapter.name, session.step)
    return session


def _router(
    dht: DHT, transport: Transport, spec: ModelSpec, adapter: str, config: SwarmConfig, current: CurrentPeers
) -> Router:
    """Routing over the swarm's announcements, to the peers ``current`` calls eligible, weights pinned by the
    adapter's committed record."""
    return Router(
        dht,
        transport,
        spec.name,
        spec.num_blocks,
        config.router_options(spec.hidden_size),
        eligible=current.eligible,
        on_moved=current.forget,
        weights=pinned_weights(dht, spec, adapter),
    )


def _replica_set(
    calls: PeerCalls,
    current: CurrentPeers,
    opener: Callable[[PeerID], tuple[dict[int, int], dict[int, int]]],
    config: SwarmConfig,
) -> ReplicaSet:
    """The replicas; lost copies waited for ``lost_grace`` when the newest left is a step behind, else half the
    patience (restarting holders may bring back more steps)."""
    return ReplicaSet(calls, current, opener, lost_grace=config.lost_grace, long_grace=config.patience / 2)


def _remote_stack(
    calls: PeerCalls, catch_up: Callable[[], None], unserved: UnservedNotice, config: SwarmConfig, private: bool
) -> RemoteStack:
    """The hops forward and backward, spot-checked as the policy says for a public or private swarm."""
    rate, voters = spot_check_policy(config.spot_check, private=private)
    return RemoteStack(
        calls,
        catch_up,
        Trust(calls, rate, min_voters=voters),
        chain=config.chain,
        unserved=unserved.send,
        deltas=ChainDeltas(calls, None if calls.wire.delta_bits is None else DeltaReferences()),
    )
