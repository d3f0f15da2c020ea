"""Committing a step on every live replica of every block, exactly once, whatever fails in between.

One round: every replica is asked at once to fetch, peer to peer, the micro-batch gradients it lacks and to apply
the step. Gradients that died with a peer are replayed on a replica still at the step from the segments the client
kept, and the replicas that could not apply are asked again. Each replica sums the gradients in canonical order
and runs the same AdamW update.
Replicas that are behind (or new) first pull the state from a current one.
Then the replicas vote: each commit reply carries the blocks' state digests after the step (``_vote``).
The commit is a state machine: ``StepCommit`` holds all it knows, a transition per ``Stage`` returns the next one,
and ``TRANSITIONS`` (drawn in docs/ARCHITECTURE.md, "The commit's states") lists the moves it may make.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TypeVar

from hivemind.p2p import PeerID

from swarm.blocks import spans_text
from swarm.client.calls import PeerCalls, PeerFailure
from swarm.client.commitround import Phase, ask_round, held_by_departed, mbs_text
from swarm.client.current import CurrentPeers
from swarm.client.ledger import StepLedger
from swarm.client.remote import RemoteStack
from swarm.client.replays import replay_lost
from swarm.client.votes import tally
from swarm.net.errors import CommitError, RemoteError, ReplicasDisagreeError, SwarmUnavailableError
from swarm.net.protocol import (
    COMMIT_FLOOR,
    CommitReply,
    DigestRequest,
    ErrorKind,
    FastForwardRequest,
    Method,
    OptimizerHParams,
    RevertRequest,
    SyncRequest,
    TieBreakRequest,
)
from swarm.net.waiting import Deadline, WaitLine

logger = logging.getLogger(__name__)

MAX_COMMIT_ROUNDS = 8
LOST_GRACE = 10.0  # seconds a block without any current copy waits for its holders to restart (from_pretrained's)
T = TypeVar("T")


@dataclass(frozen=True)
class StepsLost:
    """Blocks whose every current copy died: they resumed from an older state and lost ``steps`` updates."""

    peer: PeerID
    blocks: tuple[int, ...]
    steps: int
    at_step: int


class ReplicaSet:
    """Which peers hold the adapter at the client's step; opens new peers and brings laggards up to date."""

    def __init__(
        self,
        calls: PeerCalls,
        current: CurrentPeers,
        open_on: Callable[[PeerID], tuple[dict[int, int], dict[int, int]]],
        lost_grace: float = LOST_GRACE,
        long_grace: float = 30.0,
    ):
        self.calls, self.current, self.open_on = calls, current, open_on
        # Seconds a block stays without any current copy before its newest survivor is declared current: its holders
        # may be restarting from their checkpoints, and a loss declared cannot be taken back. A survivor one step
        # behind (what a checkpoint every step can lose) is taken after lost_grace; an older one only after
        # long_grace: restarting holders would bring back many steps it does not have.
        self.lost_grace, self.long_grace = lost_grace, max(lost_grace, long_grace)
        self.orphaned: dict[int, float] = {}  # block -> since when no current copy is known
        # peers holding some blocks at the step being committed and others past it: see split_over()
        self.split: dict[PeerID, dict[int, int]] = {}
        self.standby: dict[PeerID, dict[int, int]] = {}  # peer -> block -> step of the standby copy it holds
        self.lost: list[StepsLost] = []
        # the step whose lost gradients a commit is replaying (``replay_of``): one found past it is taken back
        self.replaying: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="swarm-replicas")
        self._refreshing = threading.Lock()

    def note_standby(self, peer: PeerID, steps: dict[int, int]) -> None:
        """``peer`` said it holds standby copies of these blocks at these steps."""
        self.standby.setdefault(peer, {}).update(steps)

    def standby_holders(self, block: int, step: int) -> list[PeerID]:
        """Live peers known to hold a standby copy of ``block`` at ``step``: a source to sync or resume from."""
        router = self.calls.router
        return [p for p, held in self.standby.items() if held.get(block) == step and router.may_hold_state(p)]

    def open_many(self, peers: list[PeerID]) -> dict[PeerID, dict[int, int]]:
        """Open the adapter on ``peers`` at once, so that a dead or slow peer does not hold up the others; returns
        each answering peer's served steps per block (and notes its standby copies)."""

        def attempt(peer: PeerID) -> tuple[dict[int, int], dict[int, int]] | None:
            try:
                return self.open_on(peer)
            except (PeerFailure, RemoteError) as e:
                logger.warning("peer %s cannot be opened yet: %s", peer, e)
                return None

        answers = {}
        for peer, reply in zip(peers, self.each(attempt, peers), strict=True):
            if reply is not None:
                steps, standby = reply
                self.note_standby(peer, standby)
                answers[peer] = steps
        return answers

    def each(self, ask: Callable[[PeerID], T], peers: list[PeerID]) -> list[T]:
        """``ask`` every peer at once (a round trip for all, not one each); the answers in the order of ``peers``."""
        return list(self._pool.map(ask, peers))

    def refresh(self, step: int, accept_losses: bool = False) -> None:
        """Open the adapter on every announced peer not known current; sync those that are behind. A block whose
        current copies all died resumes from the newest surviving one once none came back within ``lost_grace`` (at
        once with ``accept_losses``), and the steps lost are reported. One refresh at a time: micro-batches in flight
        together may all find a block without a current server."""
        with self._refreshing:
            self._refresh(step, accept_losses)

    def follow(self, step: int) -> None:
        """A reader's refresh: which live peers hold the adapter at ``step`` or later, one step across their span.
        It opens without claiming and never syncs or resumes anything: the trainer keeps the replicas."""
        servers = self.calls.router.live_servers(eligible_only=False)
        for peer, steps in self.open_many(list(servers)).items():
            held = set(steps.values())
            if len(held) == 1 and min(held) >= step:
                self.current[peer] = min(held)
            else:
                self.current.pop(peer, None)

    def _refresh(self, step: int, accept_losses: bool) -> None:
        servers = self.calls.router.live_servers(eligible_only=False)
        behind: dict[PeerID, dict[int, int]] = {}
        unknown = [p for p in servers if self.current.get(p, -1) < step]  # ahead: applied this step already
        for peer, steps in self.open_many(unknown).items():
            if set(steps.values()) in ({step}, {step + 1}):
                self.current[peer] = min(steps.values())  # a peer at step + 1 applied `step`: see ahead_of()
            else:
                behind[peer] = steps
        self._learn_standby(step, [p for p in servers if p not in unknown])
        if behind:
            self._adopt_survivors(step, behind, accept_losses)
        self.split = {p: steps for p, steps in behind.items() if {step, step + 1} <= set(steps.values())}
        for peer, steps in behind.items():
            try:
                if any(s != step for s in steps.values()):
                    steps = behind[peer] = self._sync(peer, servers[peer], steps, step, behind)
            except (PeerFailure, RemoteError, CommitError) as e:
                logger.warning("peer %s cannot be brought to step %d yet: %s", peer, step, e)
                continue
            if set(steps.values()) == {step}:
                self.current[peer] = step
            else:
                logger.warning("peer %s holds steps %s, not %d; not using it", peer, sorted(set(steps.values())), step)
        if self.replaying == step and (ahead := self.ahead_of(step)):
            # a replay runs through every block at `step`: a replica that came back from its checkpoint, or moved
            # onto blocks, past the step while the replay waited for a server of them takes it back like the others
            logger.warning("taking step %d back on %d replica(s) found past it during a replay", step, len(ahead))
            self.take_back(list(ahead), step)

    def _learn_standby(self, step: int, unasked: list[PeerID]) -> None:
        """When some block has neither a current server nor a known standby copy at ``step``, ask the live peers
        not opened in this refresh (current ones) which copies they keep. Their standby copies follow the commits of
        other peers, but the client hears of them only when it opens them: a churn run declared 44 steps of a block
        lost, from a restarted peer's checkpoint, while a current peer held a copy of that block at the step."""
        if unasked and self._uncopied(step):
            self.open_many(unasked)

    def _uncopied(self, step: int) -> set[int]:
        """Blocks that neither a current server nor a known standby copy holds at ``step``."""
        current = self.peers(step)
        return {
            block
            for block in range(self.calls.router.num_blocks)
            if not any(block in span for span in current.values()) and not self.standby_holders(block, step)
        }

    def take_back(self, peers: list[PeerID], step: int) -> None:
        """Revert ``peers``, all at once, from past ``step`` to it; they apply it again, to the same bits, once the
        lost gradients are replayed. One that cannot is not current at ``step`` (it is opened again)."""

        def attempt(peer: PeerID) -> None:
            try:
                reply = self.calls.ask(peer, RevertRequest(adapter=self.calls.adapter, step=step))
            except (PeerFailure, RemoteError) as e:
                logger.warning("peer %s could not take step %d back: %s", peer, step, e)
                self.current.forget(peer)
                return
            if set(reply.steps.values()) == {step}:
                self.current[peer] = step
            else:
                self.current.forget(peer)

        self.each(attempt, peers)

    def _adopt_survivors(self, step: int, behind: dict[PeerID, dict[int, int]], accept_losses: bool) -> None:
        """For blocks that no announced peer could hold at ``step`` (none current, none unreachable) for
        ``lost_grace`` seconds, declare the newest surviving copy current: its updates since are lost, and that is
        reported."""
        uncopied = self._uncopied(step)
        announced = self.calls.router.announced()
        now = time.monotonic()
        orphaned: dict[int, int] = {}  # block -> its newest survivor's step, for blocks orphaned just now
        for block in range(self.calls.router.num_blocks):
            if block not in uncopied:
                self.orphaned.pop(block, None)
                continue  # a current copy lives: laggards sync from it
            unknown = [p for p in announced.get(block, []) if p not in behind and self.current.get(p) != step]
            survivors = [(steps[block], peer) for peer, steps in behind.items() if block in steps]
            if unknown or not survivors:
                continue  # a peer we could not ask may still be current: wait for it (or for its record to expire)
            newest, peer = max(survivors, key=lambda item: item[0])
            if newest >= step:
                continue
            since = self.orphaned.setdefault(block, now)
            grace = self.lost_grace if step - newest <= 1 else self.long_grace
            if not accept_losses and now - since < grace:
                if since == now:
                    orphaned[block] = newest
                continue
            self.orphaned.pop(block, None)
            try:
                reply = self.calls.ask(
                    peer, FastForwardRequest(adapter=self.calls.adapter, step=step, start=block, end=block + 1)
                )
            except (PeerFailure, RemoteError) as e:
                logger.warning("could not resume block %d on %s: %s", block, peer, e)
                continue
            behind[peer] = reply.steps
            lost = StepsLost(peer, (block,), step - newest, step)
            self.lost.append(lost)
            logger.error(
                "block %d lost every current copy of adapter %r: resumed from step %d on %s; %d step(s) lost",
                block,
                self.calls.adapter,
                newest,
                peer,
                lost.steps,
            )
        if orphaned:  # one line for all of them, not one per block
            logger.warning(
                "no live peer holds blocks %s at step %d (the newest survivors: steps %s); waiting up to %.0fs for "
                "their holders to come back (restarted peers load their --checkpoint-dir)",
                spans_text(orphaned),
                step,
                sorted(set(orphaned.values())),
                self.lost_grace if all(step - newest <= 1 for newest in orphaned.values()) else self.long_grace,
            )

    def _sync(
        self, peer: PeerID, span: range, steps: dict[int, int], step: int, partial: dict[PeerID, dict[int, int]]
    ) -> dict[int, int]:
        """Pull the state of the blocks of ``span`` that ``peer`` holds behind ``step`` (``steps``) from current
        copies, one source per stretch of blocks. A block it already holds at ``step`` (a takeover that started from
        its own standby copy) needs no source. ``partial``: the steps of live peers holding only some of their blocks
        at ``step``; those blocks are a source too. Two survivors resumed on one block each of the span they both
        serve, each waiting for the other to be current, stalled a churn run until the client's patience ran out."""
        block = span.start
        while block < span.stop:
            if steps.get(block) == step:
                block += 1
                continue
            sources = [
                (p, s.stop)
                for p, s in self.calls.router.live_servers().items()
                if p != peer and self.current.get(p) == step and s.start <= block < s.stop
            ]
            sources += [(holder, _run_end(held, block, step)) for holder, held in partial.items()]
            sources += [
                (holder, _run_end(self.standby[holder], block, step)) for holder in self.standby_holders(block, step)
            ]
            sources = [(p, end) for p, end in sources if p != peer and end > block]
            if not sources:
                raise CommitError(f"no current copy of block {block} to sync peer {peer} from")
            source, source_end = max(sources, key=lambda item: item[1])
            stop = min(source_end, span.stop)
            end = next((b for b in range(block, stop) if steps.get(b) == step), stop)  # not what it holds already
            try:
                reply = self.calls.ask(
                    peer, SyncRequest(adapter=self.calls.adapter, source=source, start=block, end=end)
                )
            except RemoteError as e:
                if e.kind != ErrorKind.SOURCE_UNAVAILABLE:
                    raise
                self._drop_source(source, str(e))
                continue  # the same blocks, from another source
            steps = reply.steps
            if any(steps.get(b) != step for b in range(block, end)):
                # the source was not at the step after all (its state moved since it was found current): ask it
                # again before offering it, and take these blocks from another source
                self.current.forget(source)
                self.standby.pop(source, None)
                raise CommitError(f"{source} held blocks {block}:{end} at other steps than {step}; not a source")
            logger.info("peer %s synced blocks %d:%d to step %d from %s", peer, block, end, step, source)
            block = end
        return steps

    def _drop_source(self, source: PeerID, reason: str) -> None:
        """A peer could not pull state from ``source``: do not offer it as a source (or route to it) until it
        answers again. Blaming the peer that asked, as a failed request would, left it banned and the dead source
        chosen again, for as long as its record lived."""
        self.calls.router.ban(source, reason)
        self.current.forget(source)
        self.standby.pop(source, None)

    @contextmanager
    def replay_of(self, step: int) -> Iterator[None]:
        """While the lost gradients of ``step`` are replayed: a replica found past the step meanwhile (a refresh of
        the replay's routing) is taken back like those that applied it."""
        self.replaying = step
        try:
            yield
        finally:
            self.replaying = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def peers(self, step: int) -> dict[PeerID, range]:
        return {p: s for p, s in self.calls.router.live_servers().items() if self.current.get(p) == step}

    def declared(self, block: int, step: int) -> PeerID | None:
        """The survivor this client declared current for ``block`` at ``step`` when every current copy was lost
        (``_adopt_survivors``), if it did: what the block's state at ``step`` is from then on."""
        return next((lost.peer for lost in reversed(self.lost) if block in lost.blocks and lost.at_step == step), None)

    def realign(self, block: int, step: int, opinions: Mapping[PeerID, str]) -> dict[PeerID, str]:
        """Replicas of ``block`` (``opinions``: peer -> digest) that differ from the survivor this client declared
        current at ``step`` (``declared``) take its state: a holder that came back with the lost state after the loss
        was declared holds, at the same step, a state the trainer no longer has (a churn run's replicas so
        disagreed, nobody broke the tie, and the commit failed). Returns their digests after (empty if no survivor
        was declared there, or it is not among them)."""
        source = self.declared(block, step)
        if source is None or source not in opinions:
            return {}
        calls, stale = self.calls, [p for p, digest in opinions.items() if digest != opinions[source]]

        def attempt(peer: PeerID) -> str | None:
            try:
                calls.ask(peer, SyncRequest(adapter=calls.adapter, source=source, start=block, end=block + 1))
                return calls.ask(peer, DigestRequest(adapter=calls.adapter)).digests.get(block, "")
            except (PeerFailure, RemoteError) as e:
                logger.warning("peer %s could not take block %d from %s: %s", peer, block, source, e)
                return None

        digests = {p: d for p, d in zip(stale, self.each(attempt, stale), strict=True) if d is not None}
        if digests:
            logger.warning(
                "block %d: %d replica(s) came back with a state lost before the trainer declared %s's current at "
                "step %d: they took its state",
                block,
                len(digests),
                source,
                step,
            )
        return digests

    def split_over(self, blocks: list[int], step: int) -> bool:
        """Whether a live peer, found in the last refresh, holds one of ``blocks`` at ``step`` and other blocks past
        it: it took those over from a replica that had applied the step (the holders of ``blocks`` died in the
        middle of the commit, and it restarted from their older copies). It can take part once the step is taken
        back on the replicas that applied it: it is then synced down to ``step`` like any laggard."""
        live = self.calls.router.live_servers(eligible_only=False)
        return any(peer in live and any(steps.get(b) == step for b in blocks) for peer, steps in self.split.items())

    def ahead_of(self, step: int) -> dict[PeerID, range]:
        """Live peers that already applied ``step``: a commit whose reply was lost, or one taken back elsewhere
        while this peer restarted from its checkpoint. A replica applies only with every gradient of the ledger, and
        a step taken back is redone to the same bits, so their state is the step's result: the commit counts them.
        (Not ``peers(step + 1)``: a peer past the client's step is not eligible for routing, yet it is a replica.)"""
        live = self.calls.router.live_servers(eligible_only=False)
        return {p: s for p, s in live.items() if self.current.get(p) == step + 1}


class Stage(Enum):
    """Where a step's commit stands (docs/ARCHITECTURE.md, "The commit's states", draws ``TRANSITIONS``)."""

    REFRESHING = "refreshing"  # open peers, sync laggards; which replicas are left to ask, and is every block served
    WAITING = "waiting"  # some block has no live replica at the step: wait for one (or take the step back)
    ASKING = "asking"  # a round: every replica left is asked at once to fetch the partial sums it lacks and apply
    REPLAYING = "replaying"  # gradients died with their holder: the step is taken back and they are recomputed
    JUDGING = "judging"  # a replica refused a holder's partial sum: the client checks it and bans the liar
    SETTLED = "settled"  # nobody left to ask: replicas whose digests differ commit again, audited
    VOTING = "voting"  # the replicas' digests after the step decide who is honest
    DONE = "done"


TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.REFRESHING: frozenset({Stage.WAITING, Stage.ASKING, Stage.REPLAYING, Stage.SETTLED}),
    Stage.WAITING: frozenset({Stage.REFRESHING}),
    Stage.ASKING: frozenset({Stage.JUDGING, Stage.REPLAYING, Stage.SETTLED, Stage.REFRESHING}),
    Stage.REPLAYING: frozenset({Stage.REFRESHING}),
    Stage.JUDGING: frozenset({Stage.REFRESHING}),
    Stage.SETTLED: frozenset({Stage.REFRESHING, Stage.VOTING}),
    Stage.VOTING: frozenset({Stage.DONE}),
    Stage.DONE: frozenset(),
}
FIRST = Stage.REFRESHING


@dataclass(frozen=True)
class StepCommit:
    """Everything one commit of a step knows, at one stage. Each transition returns a new one: nothing here changes
    in place but the attempt's clock (``patience``, ``waiting``), which an audited attempt starts anew."""

    patience: Deadline
    waiting: WaitLine
    started: float
    audit: bool = False  # every partial sum checked: the replicas disagreed after an unaudited attempt
    stage: Stage = FIRST
    rounds: int = 0
    applied: Mapping[PeerID, range] = field(default_factory=dict)  # replicas that applied the step, and their spans
    votes: Mapping[PeerID, CommitReply] = field(default_factory=dict)  # each one's last commit reply: steps and digests
    failed: tuple[PeerID, ...] = ()  # replicas that did not answer a round
    history: tuple[str, ...] = ()  # what each round ran into, for the error if the rounds run out
    pending: Mapping[PeerID, range] = field(default_factory=dict)  # current replicas left to ask (REFRESHING's finding)
    uncovered: tuple[int, ...] = ()  # blocks without a live replica at the step (WAITING's)
    missing: Mapping[int, list[str]] = field(default_factory=dict)  # gradients to replay, per block (REPLAYING's)
    accused: tuple[tuple[PeerID, PeerID], ...] = ()  # (accuser, holder) pairs (JUDGING's)

    def to(self, stage: Stage, **changes: object) -> StepCommit:
        """This state moved to ``stage``, with ``changes``."""
        return replace(self, stage=stage, **changes)


class _Commit:
    """One step's commit over its collaborators: a transition per stage, each from one ``StepCommit`` to the next."""

    def __init__(self, hops: RemoteStack, replicas: ReplicaSet, ledger: StepLedger, hparams: OptimizerHParams):
        self.hops, self.replicas, self.ledger, self.hparams = hops, replicas, ledger, hparams
        self.calls, self.step = hops.calls, ledger.step
        self.blocks = range(self.calls.router.num_blocks)
        self.transitions: dict[Stage, Callable[[StepCommit], StepCommit]] = {
            Stage.REFRESHING: self.refreshing,
            Stage.WAITING: self.waiting,
            Stage.ASKING: self.asking,
            Stage.REPLAYING: self.replaying,
            Stage.JUDGING: self.judging,
            Stage.SETTLED: self.settled,
            Stage.VOTING: self.voting,
        }

    def attempt(self, audit: bool) -> StepCommit:
        """A fresh attempt, with its own patience: nothing applied yet."""
        patience = Deadline(self.calls.patience)
        waiting = WaitLine(f"committing step {self.step}", patience, logger, logging.WARNING)
        return StepCommit(patience, waiting, time.monotonic(), audit)

    def run(self) -> dict[PeerID, range]:
        """From the first stage to DONE, each move checked against ``TRANSITIONS``."""
        state = self.attempt(audit=False)
        while state.stage is not Stage.DONE:
            following = self.transitions[state.stage](state)
            if following.stage not in TRANSITIONS[state.stage]:
                raise RuntimeError(f"a commit cannot go from {state.stage.name} to {following.stage.name}")
            state = following
        return dict(state.applied)

    def refreshing(self, s: StepCommit) -> StepCommit:
        """Bring the replicas to the step; count those past it as applied (unless the ledger is tainted); then wait,
        ask, replay what died with a holder, or settle."""
        step = self.step
        self.replicas.refresh(step)
        applied = s.applied if self.ledger.tainted else {**s.applied, **self.replicas.ahead_of(step)}
        pending = {p: span for p, span in self.replicas.peers(step).items() if p not in applied}
        done = {b for span in applied.values() for b in span}
        uncovered = tuple(b for b in self.blocks if b not in done and not any(b in span for span in pending.values()))
        if uncovered:
            return s.to(Stage.WAITING, applied=applied, pending=pending, uncovered=uncovered)
        s.waiting.done("every block has a live replica")
        if not pending:
            return s.to(Stage.SETTLED, applied=applied, pending=pending)
        rounds = s.rounds + 1
        if rounds > MAX_COMMIT_ROUNDS:
            if all(b in done for b in self.blocks):
                return s.to(Stage.SETTLED, applied=applied, pending=pending, rounds=rounds)
            raise CommitError(
                f"step {step} could not be committed in {MAX_COMMIT_ROUNDS} rounds: " + "; ".join(s.history[-3:])
            )
        missing = held_by_departed(self.ledger, pending, applied)
        if missing:
            history = (*s.history, f"round {rounds}: gradients of departed holders {mbs_text(missing)}")
            return s.to(
                Stage.REPLAYING, applied=applied, pending=pending, rounds=rounds, missing=missing, history=history
            )
        return s.to(Stage.ASKING, applied=applied, pending=pending, rounds=rounds)

    def waiting(self, s: StepCommit) -> StepCommit:
        """Some block has no live replica at the step: give up once patience runs out; take the step back where a
        split peer holds it (it then syncs down); else say what is missing, and look again in a second."""
        step, uncovered, applied = self.step, list(s.uncovered), s.applied
        if s.patience.passed:
            s.waiting.done("gave up")
            raise SwarmUnavailableError.unserved(uncovered, self.calls.patience, f"live replica at step {step}")
        if applied and self.replicas.split_over(uncovered, step):
            logger.warning(
                "blocks %s are at step %d only on peers that hold others past it; taking the step back", uncovered, step
            )
            applied = self._take_back(applied)
        else:
            s.waiting.update(f"blocks {spans_text(uncovered)} have no live replica at step {step}")
            if self.hops.unserved is not None:
                self.hops.unserved(self.calls.router.uncovered(eligible_only=False))
        s.patience.pause(1.0)
        self.calls.router.refresh()
        return s.to(Stage.REFRESHING, applied=applied)

    def asking(self, s: StepCommit) -> StepCommit:
        """One round: every replica left is asked at once; those that applied are no longer current at the step."""
        asked = ask_round(self.calls, self.replicas.each, dict(s.pending), self.ledger, self.hparams, s.audit)
        now_applied = asked.of(Phase.APPLIED)
        for peer in now_applied:
            self.replicas.current[peer] = self.step + 1  # no longer eligible for this step's work (e.g. a replay)
        applied = {**s.applied, **{peer: s.pending[peer] for peer in now_applied}}
        history = (*s.history, f"round {s.rounds}: {asked.summary()}")
        if len(now_applied) < len(s.pending):
            logger.info("committing step %d, %s", self.step, history[-1])
        after = {
            "applied": applied,
            "votes": {**s.votes, **asked.votes},
            "failed": (*s.failed, *asked.of(Phase.SILENT)),
            "history": history,
        }
        if asked.accused:
            return s.to(Stage.JUDGING, accused=tuple(asked.accused), **after)
        if asked.missing:
            return s.to(Stage.REPLAYING, missing=asked.missing, **after)
        if all(any(b in span for span in applied.values()) for b in self.blocks):
            return s.to(Stage.SETTLED, **after)
        return s.to(Stage.REFRESHING, **after)

    def replaying(self, s: StepCommit) -> StepCommit:
        """Take the step back where it was applied (so that replays can run through those blocks at the step), then
        recompute the lost gradients on live replicas."""
        applied = self._take_back(s.applied)
        with self.replicas.replay_of(self.step):
            replay_lost(self.hops, self.ledger, dict(s.missing))
        return s.to(Stage.REFRESHING, applied=applied, missing={})

    def judging(self, s: StepCommit) -> StepCommit:
        """Judge the accusations; the banned (holder or accuser) no longer count, their micro-batches are replayed
        next round as a departed holder's."""
        banned = set(judge_accused(self.hops, self.ledger, list(s.accused)))
        applied = {peer: span for peer, span in s.applied.items() if peer not in banned}
        return s.to(Stage.REFRESHING, applied=applied, accused=())

    def settled(self, s: StepCommit) -> StepCommit:
        """Nobody left to ask. Replicas whose digests differ after an unaudited attempt: the step is taken back and
        committed again by a fresh attempt, every partial sum audited; otherwise the vote."""
        if s.failed:
            self.calls.recovered(s.failed[0], Method.COMMIT, self.step, s.started)
        if s.audit or not _dissent(self.calls.router.num_blocks, self.step, s.applied, s.votes):
            return s.to(Stage.VOTING)
        logger.warning("replicas disagree on step %d; committing it again with every partial sum audited", self.step)
        self._take_back(s.applied)
        return self.attempt(audit=True)

    def voting(self, s: StepCommit) -> StepCommit:
        """The vote: the outvoted no longer count; a tie nobody breaks takes the step back and raises."""
        applied = _vote(self.hops, self.replicas, self.ledger, self.hparams, s.applied, s.votes)
        logger.debug("step %d committed on %d peers in %.2fs", self.step, len(applied), time.monotonic() - s.started)
        return s.to(Stage.DONE, applied=applied)

    def _take_back(self, applied: Mapping[PeerID, range]) -> dict[PeerID, range]:
        """Revert the replicas that applied the step: they apply it again, to the same bits, once the lost
        gradients are replayed (or the split peer synced). Returns what is applied now: nothing."""
        self.replicas.take_back(list(applied), self.step)
        return {}


def commit(
    hops: RemoteStack, replicas: ReplicaSet, ledger: StepLedger, hparams: OptimizerHParams
) -> dict[PeerID, range]:
    """Apply ``ledger.step`` on every live replica, all asked at once; each fetches the partial sums it lacks peer
    to peer and applies in the same call. Gradients that died with a peer are replayed (``hops``) on a replica still
    at the step first. Returns the replicas that applied it (and their spans). Raises CommitError if impossible.

    Replicas whose states disagree after the step commit it again, every partial sum audited (each replica checks
    the micro-batch gradients behind every partial sum it uses against their reported hashes): a holder that handed
    on a partial sum other than the sum of what it reported is named and its micro-batches replayed, before a vote
    could count the replicas it misled as the majority. A disagreement that survives the audit goes to the vote
    (``_vote``). The stages and their transitions: ``Stage``, ``TRANSITIONS``."""
    ledger.committing = True
    return _Commit(hops, replicas, ledger, hparams).run()


def _dissent(num_blocks: int, step: int, applied: Mapping[PeerID, range], votes: Mapping[PeerID, CommitReply]) -> bool:
    """Whether the replicas that replied for a block report other states after the step."""
    for block in range(num_blocks):
        digests = {
            reply.digests.get(block, "")
            for peer, reply in votes.items()
            if peer in applied and block in applied[peer] and reply.steps.get(block, step + 1) == step + 1
        }
        if len(digests) > 1:
            return True
    return False


def _vote(
    hops: RemoteStack,
    replicas: ReplicaSet,
    ledger: StepLedger,
    hparams: OptimizerHParams,
    applied: Mapping[PeerID, range],
    votes: Mapping[PeerID, CommitReply],
) -> dict[PeerID, range]:
    """The replicas' vote on the step: per block, the digests of the replicas that report it applied (the same step:
    a replica elsewhere is not compared). Where this client declared a survivor current at the step, replicas that
    differ from it take its state first (``ReplicaSet.realign``: they came back with the state it lost). One
    outvoted by two that agree is banned for good; two that disagree alone are judged by a standby copy holder that
    applies the same ledger (``TieBreakRequest``). Without one, the step is
    taken back everywhere and ReplicasDisagreeError raised. Returns the replicas of ``applied`` that kept their vote."""
    calls, step = hops.calls, ledger.step
    # Asked again: a replica counted without a reply of this call (it was lost), and one whose reply lacks blocks it
    # counts for (it moved onto them in the middle of the commit, after it replied for its old span). A reply read
    # for blocks it never covered made honest replicas disagree under churn.
    votes = dict(votes)
    unheard = [p for p in applied if p not in votes or not set(applied[p]).issubset(votes[p].digests)]
    for peer in unheard:
        try:
            votes[peer] = CommitReply({}, calls.ask(peer, DigestRequest(adapter=calls.adapter)).digests)
        except (PeerFailure, RemoteError) as e:
            logger.warning("peer %s could not report its digests of step %d: %s", peer, step, e)
    outvoted: dict[PeerID, int] = {}
    disputes: list[tuple[int, tuple[PeerID, ...]]] = []
    for block in range(calls.router.num_blocks):
        opinions = {
            peer: reply.digests.get(block, "")  # none for a block it applied: a digest nobody else has
            for peer, reply in votes.items()
            if peer in applied and block in applied[peer] and reply.steps.get(block, step + 1) == step + 1
        }
        opinions.update(replicas.realign(block, step, opinions))
        verdict = tally(opinions)
        if verdict.undecided:
            opinions.update(_tiebreak(hops, replicas, ledger, hparams, block, opinions))
            verdict = tally(opinions)
        if verdict.undecided:
            disputes.append((block, tuple(opinions)))
        for peer in verdict.outvoted:
            outvoted.setdefault(peer, block)
    for peer, block in outvoted.items():
        reason = f"its state of block {block} after step {step} disagrees with the majority of its replicas'"
        hops.trust.ban_dishonest(peer, reason)
        replicas.standby.pop(peer, None)
    kept = {peer: span for peer, span in applied.items() if peer not in outvoted}
    if disputes:
        block, peers = disputes[0]
        logger.error("replicas %s of block %d disagree on step %d and nobody breaks the tie", peers, block, step)
        replicas.take_back(list(kept), step)
        raise ReplicasDisagreeError(block, step, tuple(p.to_base58() for p in peers))
    return kept


def _tiebreak(
    hops: RemoteStack,
    replicas: ReplicaSet,
    ledger: StepLedger,
    hparams: OptimizerHParams,
    block: int,
    opinions: dict[PeerID, str],
) -> dict[PeerID, str]:
    """The first standby holder of ``block`` at the step (other than the disputing replicas) that applies the
    ledger's gradients to its copy: its digest, the deciding vote. Empty if none can."""
    calls, step = hops.calls, ledger.step
    for holder in replicas.standby_holders(block, step):
        if holder in opinions or holder in hops.trust.dishonest:
            continue
        holders = ledger.wire_holders(range(block, block + 1))
        request = TieBreakRequest(
            adapter=calls.adapter,
            step=step,
            ledger=holders,
            hparams=hparams,
            grad_scale=ledger.grad_scale,
            holder_maddrs=calls.holder_maddrs(holders),
        )
        try:
            digest = calls.ask(holder, request, floor=COMMIT_FLOOR).digests[block]
        except (PeerFailure, RemoteError, KeyError) as e:
            logger.warning("peer %s could not break the tie on block %d at step %d: %r", holder, block, step, e)
            continue
        logger.warning("replicas of block %d disagree on step %d; peer %s broke the tie", block, step, holder)
        return {holder: digest}
    return {}


def judge_accused(hops: RemoteStack, ledger: StepLedger, accused: list[tuple[PeerID, PeerID]]) -> list[PeerID]:
    """Replicas said that holders handed them partial sums that are not the sums of the gradients the holders
    reported: the client asks each holder for its gradients and its partial sums itself. One that hands on other
    gradients than it reported, or partial sums that are not theirs, is dishonest; where the client gets the
    reported ones and their sums, the accuser lied (a holder that hands the client other bits than it handed the
    accuser is not told apart: ARCHITECTURE.md, "One reduction per step"). Returns the peers banned for good (their
    micro-batches are replayed on honest replicas: they count as departed)."""
    banned = []
    for accuser, holder in dict.fromkeys(accused):
        if holder in hops.trust.dishonest or accuser in hops.trust.dishonest:
            continue
        held = ledger.held_by(holder)
        try:
            honest = bool(held) and hops.trust.reported_sums(holder, ledger.step, held, ledger.hashes)
        except (PeerFailure, RemoteError) as e:  # it does not answer: its gradients are replayed elsewhere
            hops.calls.router.ban(holder, f"could not hand on the gradients of step {ledger.step}: {e}")
            continue
        culprit, reason = (
            (accuser, f"it refused step {ledger.step}'s gradients from {holder}, which hash as reported")
            if honest
            else (holder, f"it handed on gradients of step {ledger.step} that differ from those it reported")
        )
        hops.trust.ban_dishonest(culprit, reason)
        banned.append(culprit)
    return banned


def take_back_abandoned(replicas: ReplicaSet, step: int) -> None:
    """The user discarded gradients whose commit failed part-way: take the step back on the replicas that applied
    it, so they redo it with the gradients that will be committed instead. One that cannot (it restarted since) stays
    past the step and is never counted as having applied the new gradients (see ``StepLedger.tainted``)."""
    ahead = replicas.ahead_of(step)
    if ahead:
        logger.warning("taking step %d back on %d replica(s) that applied discarded gradients", step, len(ahead))
        replicas.take_back(list(ahead), step)


def _run_end(held: dict[int, int], block: int, step: int) -> int:
    """The end of the stretch of blocks from ``block`` that ``held`` (block -> step) has at ``step``."""
    end = block
    while held.get(end) == step:
        end += 1
    return end
