"""swarm.client.commit's decisions over stub replicas (the commit and sync over real peers, with faults, are in
tests/integration/test_redundancy.py): which blocks a takeover syncs, and when a commit takes a step back. The stubs
stand in for peers only in what these decisions read."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID

from swarm.client.commit import ReplicaSet, StepsLost, commit, take_back_abandoned
from swarm.client.current import CurrentPeers
from swarm.client.ledger import StepLedger
from swarm.net.errors import CommitError, SwarmUnavailableError
from swarm.net.protocol import (
    CommitReply,
    CommitRequest,
    DigestReply,
    DigestRequest,
    OptimizerHParams,
    Request,
    RevertRequest,
    StepsReply,
    SyncRequest,
)

HPARAMS = OptimizerHParams(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


class _Router:
    """The routing facts ReplicaSet reads: who serves what, and who may still hold state."""

    num_blocks = 4

    def __init__(self, servers: dict[PeerID, range]):
        self.servers = servers

    def live_servers(self, eligible_only: bool = True) -> dict[PeerID, range]:
        return dict(self.servers)

    def may_hold_state(self, peer: PeerID) -> bool:
        return True


class _Stack:
    """Records the SYNC requests a ReplicaSet sends; a synced peer reports every block at the requested step."""

    adapter = "a"

    def __init__(self, router: _Router):
        self.router, self.sent = router, []
        self.calls = self  # the fake is both the calls and the hops of a commit

    def ask(self, peer: PeerID, request: SyncRequest) -> StepsReply:
        self.sent.append((peer, request.source.to_base58(), request.start, request.end))
        return StepsReply({b: 1 for b in self.router.servers[peer]})


def test_a_holder_back_with_a_lost_state_takes_the_declared_survivors():
    """Every current copy of block 2 died; after lost_grace the client declared survivor s current at step 5 (a
    StepsLost). Then r came back from its checkpoint with block 2 at step 5 too, in the state s lost: the two differ
    and nobody breaks the tie. r takes s's state of block 2 (a sync from s), and its digest after is s's. Where the
    client declared nothing, or at another step, nothing is synced."""
    survivor, back = PeerID(b"s" * 8), PeerID(b"r" * 8)
    digests = {survivor: "declared", back: "lost"}

    class _Digests(_Stack):
        def ask(self, peer: PeerID, request: Request):
            if isinstance(request, DigestRequest):
                return DigestReply({2: digests[peer]})
            digests[peer] = digests[request.source]
            return super().ask(peer, request)

    stack = _Digests(_Router({survivor: range(2, 4), back: range(2, 4)}))
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=lambda peer: ({}, {}))
    try:
        opinions = dict(digests)
        assert replicas.realign(2, 5, opinions) == {} and stack.sent == [], "no survivor declared"
        replicas.lost.append(StepsLost(survivor, (2,), 3, 5))
        assert replicas.realign(2, 6, opinions) == {} and replicas.realign(3, 5, opinions) == {}
        assert replicas.realign(2, 5, opinions) == {back: "declared"}
    finally:
        replicas.close()
    assert stack.sent == [(back, survivor.to_base58(), 2, 3)]


def test_a_takeover_holding_part_of_its_span_current_syncs_only_the_rest():
    """The only server of blocks 2:4 died after step 1; its copies were spread: one peer held block 2, the other block
    3. The peer that took 2:4 over holds block 2 at step 1 from its own copy and block 3 at step 0: block 3 comes from
    the other copy's holder, and block 2 needs no source (it used to fail: "no current copy of block 2")."""
    mover, stayer = PeerID(b"m" * 8), PeerID(b"s" * 8)
    stack = _Stack(_Router({mover: range(2, 4), stayer: range(0, 2)}))
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=lambda peer: ({}, {}))
    try:
        replicas.current[stayer] = 1
        replicas.note_standby(stayer, {3: 1})
        steps = replicas._sync(mover, range(2, 4), {2: 1, 3: 0}, step=1, partial={})
    finally:
        replicas.close()
    assert stack.sent == [(mover, stayer.to_base58(), 3, 4)]
    assert steps == {2: 1, 3: 1}


def test_a_source_found_past_the_step_by_a_sync_is_no_longer_counted_current():
    """A peer counted current at step 1533 whose blocks moved to 1534 since (an hour of churn saw a move load a
    step the trainer had taken back into the blocks it served) is a source that syncs nobody down: the sync fails,
    and the source is asked again before it is offered or routed to. Before, the client synced from it every second
    and logged success while the peer stayed past the step, until its patience ran out."""
    split, source = PeerID(b"p" * 8), PeerID(b"s" * 8)

    class _AheadSource(_Stack):
        def ask(self, peer: PeerID, request: SyncRequest) -> StepsReply:
            super().ask(peer, request)
            return StepsReply({0: 1, 1: 2, 2: 2})  # the source exported its blocks at step 2

    stack = _AheadSource(_Router({split: range(0, 3), source: range(1, 4)}))
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=lambda peer: ({}, {}))
    try:
        replicas.current[source] = 1
        replicas.note_standby(source, {1: 1, 2: 1})
        with pytest.raises(CommitError, match="not a source"):
            replicas._sync(split, range(0, 3), {0: 1, 1: 2, 2: 2}, step=1, partial={})
        assert source not in replicas.current and source not in replicas.standby
    finally:
        replicas.close()
    assert stack.sent == [(split, source.to_base58(), 1, 3)]


def test_two_survivors_each_current_on_one_block_of_their_span_sync_each_other():
    """Every current copy of blocks 2:4 died. The client resumed block 2 from one server of 2:4 and block 3 from the
    other (each the newest survivor of its block), so each holds one block at the step and the other behind. Each is
    the other's source. Before, a source had to hold its whole span at the step: neither was, nothing synced, and a
    churn run in CI waited until the client's patience ran out ("no current copy of block 3 to sync ... from")."""
    first, second, head = PeerID(b"a" * 8), PeerID(b"b" * 8), PeerID(b"h" * 8)

    class _Announcing(_Router):
        def announced(self) -> dict[int, list[PeerID]]:
            return {b: [p for p, span in self.servers.items() if b in span] for b in range(self.num_blocks)}

    stack = _Stack(_Announcing({head: range(0, 2), first: range(2, 4), second: range(2, 4)}))
    held = {head: {0: 1, 1: 1}, first: {2: 1, 3: 0}, second: {2: 0, 3: 1}}
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=lambda peer: (held[peer], {}))
    try:
        replicas.refresh(1)
        assert replicas.peers(1) == {head: range(0, 2), first: range(2, 4), second: range(2, 4)}
    finally:
        replicas.close()
    assert sorted(stack.sent) == sorted([(first, second.to_base58(), 3, 4), (second, first.to_base58(), 2, 3)])
    assert replicas.lost == []


def test_a_span_that_lost_every_server_syncs_from_a_current_peers_standby_copy():
    """Both servers of 2:4 died; one came back from its checkpoint at step 1 while the client is at 5. Peer head,
    current on 0:2 (so the client does not open it again), keeps a standby copy of 2:4 that followed every commit.
    The client asks the peers it did not open which copies they keep, and syncs the restarted peer from head's:
    nothing lost. Before, it knew head's copies only from when it last opened head, and declared steps lost from
    the checkpoint while a current copy lived."""
    head, back = PeerID(b"h" * 8), PeerID(b"k" * 8)

    class _Announcing(_Router):
        def announced(self) -> dict[int, list[PeerID]]:
            return {b: [p for p, span in self.servers.items() if b in span] for b in range(self.num_blocks)}

    served = {head: {0: 5, 1: 5}, back: {2: 1, 3: 1}}
    standby = {head: {2: 5, 3: 5}, back: {}}

    class _Syncing(_Stack):
        def ask(self, peer: PeerID, request: SyncRequest) -> StepsReply:
            self.sent.append((peer, request.source.to_base58(), request.start, request.end))
            served[peer].update({b: standby[request.source][b] for b in request.blocks})
            return StepsReply(dict(served[peer]))

    stack = _Syncing(_Announcing({head: range(0, 2), back: range(2, 4)}))
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=lambda peer: (served[peer], standby[peer]))
    replicas.current[head] = 5
    try:
        replicas.refresh(5)
        assert replicas.peers(5) == {head: range(0, 2), back: range(2, 4)}
    finally:
        replicas.close()
    assert stack.sent == [(back, head.to_base58(), 2, 4)]
    assert replicas.lost == []


class _CommitRouter(_Router):
    def refresh(self) -> None:
        pass

    def announced(self) -> dict[int, list[PeerID]]:
        return {b: [p for p, span in self.servers.items() if b in span] for b in range(self.num_blocks)}

    def uncovered(self, eligible_only: bool = True) -> list[int]:
        return [b for b in range(self.num_blocks) if not any(b in span for span in self.servers.values())]


class _CommitStack:
    """Peers holding steps per block; OPEN reports them, COMMIT applies the step on every block of the peer, REVERT
    takes it back, SYNC copies a source's steps."""

    adapter = "a"
    patience = 3.0

    def __init__(self, steps: dict[PeerID, dict[int, int]]):
        self.steps = steps
        self.router = _CommitRouter({p: range(min(held), max(held) + 1) for p, held in steps.items()})
        self.commits = []
        self.calls = self  # the fake is both the calls and the hops of a commit
        self.notices: list[list[int]] = []  # blocks the commit told peers have no live server

    def unserved(self, blocks: list[int]) -> None:
        self.notices.append(blocks)

    def open_on(self, peer: PeerID) -> tuple[dict[int, int], dict[int, int]]:
        return dict(self.steps[peer]), {}

    def holder_maddrs(self, ledger: dict) -> dict[str, list[str]]:
        return {}  # the fake's peers need no addresses

    def ask(self, peer: PeerID, request: Request, floor: float = 0.0) -> StepsReply:
        held = self.steps[peer]
        if isinstance(request, SyncRequest):
            source = self.steps[request.source]
            held.update({b: source[b] for b in request.blocks})
        elif isinstance(request, DigestRequest):
            return DigestReply({b: f"state at {s}" for b, s in held.items()})
        elif isinstance(request, CommitRequest):
            self.commits.append(peer)
            self.steps[peer] = {b: s + 1 if s == request.step else s for b, s in held.items()}
            return CommitReply(dict(self.steps[peer]), {b: f"state at {s}" for b, s in self.steps[peer].items()})
        else:
            assert isinstance(request, RevertRequest), request
            self.steps[peer] = {b: request.step if s == request.step + 1 else s for b, s in held.items()}
        return StepsReply(dict(self.steps[peer]))

    def recovered(self, *args) -> None:
        pass


def _commit_step(stack: _CommitStack, step: int, holders: dict[int, PeerID]) -> dict[PeerID, range]:
    """Commit ``step`` of one micro-batch whose gradients of each block are held by ``holders[block]``."""
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=stack.open_on)
    ledger = StepLedger(step=step, session="s")
    for block, holder in holders.items():
        ledger.acknowledge(f"s:{step}:000000001", range(block, block + 1), holder, {block: "0" * 64})
    try:
        return commit(stack, replicas, ledger, HPARAMS)
    finally:
        replicas.close()


def test_a_peer_holding_blocks_on_both_sides_of_a_commit_is_brought_in_by_taking_the_step_back():
    """Chaos found it (one event every 5 s): both servers of blocks 2:4 died in the middle of the commit of step 42,
    after the servers of 0:2 had applied it. The peers that came back for 1:4 took block 1 over at 43 from an applied
    replica and blocks 2:4 at 42 from their own copies: the client refused them ("holds steps [42, 43]"), waited for a
    server of 2:4 at 42 and died of impatience with two of them alive. Taking the step back on the replicas that
    applied it lets the split peer sync block 1 down to 42; then the step is committed everywhere, once."""
    done, split = PeerID(b"d" * 8), PeerID(b"s" * 8)
    stack = _CommitStack({done: {0: 43, 1: 43}, split: {1: 43, 2: 42, 3: 42}})
    stack.patience = 5.0
    applied = _commit_step(stack, 42, {0: done, 1: done, 2: split, 3: split})
    assert applied == {done: range(0, 2), split: range(1, 4)}
    assert sorted(stack.commits) == sorted([done, split])
    assert stack.steps == {done: {0: 43, 1: 43}, split: {1: 43, 2: 43, 3: 43}}


def _commit_gives_up_on_2_3(stack: _CommitStack, ledger: StepLedger) -> None:
    """Commit step 45 over ``stack``'s peers: blocks 2 and 3 never get a replica at the step, so it gives up."""
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=stack.open_on)
    try:
        with pytest.raises(SwarmUnavailableError, match=r"blocks \[2, 3\] have had no live replica at step 45"):
            commit(stack, replicas, ledger, HPARAMS)
    finally:
        replicas.close()


def test_a_replica_past_the_step_is_not_counted_for_gradients_that_replaced_discarded_ones():
    """The other side of counting a replica past the step as applied: if the user discarded the gradients of a commit
    that failed part-way (zero_grad without a step) and trains the step again, a replica that applied the discarded
    gradients holds another state. It must never pass for having applied the new ones: exactly once."""
    ahead, behind = PeerID(b"x" * 8), PeerID(b"w" * 8)
    stack = _CommitStack({ahead: {2: 46, 3: 46}, behind: {0: 45, 1: 45}})
    stack.patience = 1.0
    ledger = StepLedger(step=45, session="s", committing=True).discarded()
    for block, holder in ((0, behind), (1, behind), (2, behind), (3, behind)):
        ledger.acknowledge("s:45:000000002", range(block, block + 1), holder, {block: "0" * 64})
    _commit_gives_up_on_2_3(stack, ledger)
    assert stack.commits == []
    replicas = ReplicaSet(stack, CurrentPeers(0, exact=True), open_on=stack.open_on)
    replicas.current[ahead] = 46
    try:
        take_back_abandoned(replicas, 45)  # what discard_step does first
    finally:
        replicas.close()
    assert stack.steps[ahead] == {2: 45, 3: 45} and replicas.current[ahead] == 45


def test_a_commit_waiting_for_blocks_without_any_server_tells_the_peers():
    """Both servers of 2:4 died: the commit waits for a server, and meanwhile tells the live peers that 2:4 has none
    (they look at the swarm at once: one of them takes the blocks over, rather than at its next balance round)."""
    alive = PeerID(b"a" * 8)
    stack = _CommitStack({alive: {0: 45, 1: 45}})
    stack.patience = 1.0
    ledger = StepLedger(step=45, session="s")
    for block in range(4):
        ledger.acknowledge("s:45:000000001", range(block, block + 1), alive, {block: "0" * 64})
    _commit_gives_up_on_2_3(stack, ledger)
    assert stack.notices and all(blocks == [2, 3] for blocks in stack.notices)
