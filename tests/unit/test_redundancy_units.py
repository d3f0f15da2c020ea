"""Unit tests of the redundancy logic in one process: standby copies, hand-over and resume in the backend, the
swarm view's counting, record fields, the status table, and default span sizing."""

from __future__ import annotations

import time

import peft
import pytest
import torch
from hivemind.p2p import PeerID

from peers.backend import SpanBackend
from peers.daemon import PeerConfig, blocks_that_fit
from peers.state import BlockState, BlockUpdate, pack_states, unpack_states
from swarm.blocks import lora_config_to_wire
from swarm.client.commit import ReplicaSet, commit, take_back_abandoned
from swarm.client.ledger import StepLedger
from swarm.net.errors import (
    ErrorKind,
    MissingForwardError,
    NotServedError,
    RemoteError,
    RequestError,
    SwarmUnavailableError,
)
from swarm.net.protocol import (
    PEER_STATE_ERRORS,
    AdapterInfo,
    CommitRequest,
    FastForwardRequest,
    OptimizerHParams,
    PeerInfo,
    Request,
    RevertRequest,
    StepsReply,
    SyncRequest,
)
from swarm.net.records import ServerRecord, ServerState
from swarm.net.view import SwarmView
from swarm.ops.status import render
from swarm.spec import load_spec

HPARAMS = OptimizerHParams(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def _backend(model_dir, blocks: range) -> SpanBackend:
    return SpanBackend(load_spec(model_dir), blocks, torch.device("cpu"), torch.float32, "none")


def _train_one_step(backend: SpanBackend, name: str, blocks: range, step: int) -> None:
    hidden = torch.randn(1, 6, backend.spec.hidden_size, generator=torch.Generator().manual_seed(step))
    mb = f"s:{step}:0"
    backend.forward(name, blocks, step, hidden, None, mb)
    backend.backward(name, blocks, step, mb, hidden, None, torch.ones_like(hidden))
    backend.apply(name, step, {b: [mb] for b in blocks}, HPARAMS)


def test_standby_copies_take_over_exactly_and_moves_keep_state(tiny_models):
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    server, other = _backend(tiny_models["llama"], range(2, 4)), _backend(tiny_models["llama"], range(0, 2))
    server.open_adapter("a", wire, seed=3, session="s")
    for step in range(2):
        _train_one_step(server, "a", range(2, 4), step)
    exported, _ = server.export_state("a", range(2, 4))
    other.keep_standby("a", {"lora": wire, "seed": 3}, exported, keep={2, 3})
    assert other.adapters["a"].standby_steps() == {2: 2, 3: 2}
    assert other.export_state("a", range(2, 4))[0][2].step == 2  # a standby copy can be passed on
    other.install(other.load_layers(range(2, 4)))  # takeover: the served block starts from the copy
    assert other.digests("a")[2] == server.digests("a")[2] and other.digests("a")[3] == server.digests("a")[3]
    assert other.adapters["a"].standby_steps() == {}
    other.remove([0, 1])  # handed over: the state stays as a standby copy
    assert sorted(other.layers) == [2, 3] and set(other.adapters["a"].standby_steps()) == {0, 1}


def test_a_copy_one_step_behind_catches_up_from_the_last_update_exactly(tiny_models):
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    server, holder = _backend(tiny_models["llama"], range(2, 4)), _backend(tiny_models["llama"], range(0, 2))
    server.open_adapter("a", wire, seed=3, session="s")
    _train_one_step(server, "a", range(2, 4), 0)
    states, updates = server.export_state("a", range(2, 4), held={})
    assert updates == {}, "a peer holding no copy gets the whole state"
    holder.keep_standby("a", {"lora": wire, "seed": 3}, states, keep={2, 3})
    for step in (1, 2):
        _train_one_step(server, "a", range(2, 4), step)
        states, updates = server.export_state("a", range(2, 4), held=holder.adapters["a"].standby_steps())
        assert states == {} and sorted(updates) == [2, 3]
        index, flat = pack_states({block: update.as_state() for block, update in updates.items()})  # the wire form
        back = {b: BlockUpdate.from_state(u, updates[b].hparams) for b, u in unpack_states(index, flat).items()}
        assert holder.apply_updates("a", back) == [2, 3]
    for block in (2, 3):  # the same AdamW on the same gradients: the copy equals the server's state bit for bit
        copy, served = holder.adapters["a"].standby[block], BlockState.of(server.adapters["a"].blocks[block])
        assert copy.step == served.step == 3 and copy.tensors.keys() == served.tensors.keys()
        for name, entry in served.tensors.items():
            assert entry.keys() == copy.tensors[name].keys()
            assert all(torch.equal(copy.tensors[name][key], tensor) for key, tensor in entry.items()), name
    states, updates = server.export_state("a", range(2, 4), held={2: 1, 3: 1})
    assert sorted(states) == [2, 3] and updates == {}, "a copy two steps behind gets the whole state"


def test_states_pack_into_one_tensor_and_back_exactly():
    states = {
        3: BlockState(2, {"a.lora_A.weight": {"param": torch.randn(4, 8).bfloat16(), "step": torch.tensor(2.0)}}),
        1: BlockState(5, {"b.lora_B.weight": {"param": torch.randn(8, 4), "exp_avg": torch.randn(8, 4)}}),
    }
    index, flat = pack_states(states)
    back = unpack_states(index, flat)
    assert {b: s.step for b, s in back.items()} == {3: 2, 1: 5}
    for block, state in states.items():
        for name, entry in state.tensors.items():
            for key, tensor in entry.items():
                assert back[block].tensors[name][key].dtype == tensor.dtype
                assert torch.equal(back[block].tensors[name][key], tensor)
    with pytest.raises(ValueError):
        unpack_states(index, flat[:-1])


def test_fast_forward_declares_an_older_state_current_and_reports_the_loss(tiny_models):
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    backend = _backend(tiny_models["llama"], range(0, 2))
    backend.open_adapter("a", wire, seed=0)
    assert backend.fast_forward("a", range(0, 2), 3) == {0: 3, 1: 3}
    assert backend.adapters["a"].steps() == {0: 3, 1: 3}
    assert backend.fast_forward("a", range(0, 2), 3) == {}  # nothing lost twice


def test_view_counts_only_live_peers_and_settles_joiners_by_id():
    alive_id, dead_id, joiner_small, joiner_big = (PeerID(bytes([i]) * 8) for i in (1, 2, 3, 4))
    records = {
        0: [ServerRecord(alive_id, ServerState.ONLINE, 0, 2, 10.0), ServerRecord(dead_id, ServerState.ONLINE, 0, 2, 9)],
        1: [ServerRecord(alive_id, ServerState.ONLINE, 0, 2, 10.0)],
        2: [
            ServerRecord(joiner_small, ServerState.JOINING, 2, 3, 1.0),
            ServerRecord(joiner_big, ServerState.JOINING, 2, 3, 1.0),
        ],
    }
    info = PeerInfo("m", 0, 2, "online", 10.0, {"a": AdapterInfo({"lora": {}, "seed": 0}, {0: 5, 1: 5}, {2: 4})}, [2])
    assert PeerInfo.from_meta(info.to_meta()) == info  # what `info` sends is what the view reads
    empty = PeerInfo("m", 2, 3, "joining", 1.0, {}, [])
    view = SwarmView(records, {alive_id: info, joiner_small: empty, joiner_big: empty})
    assert view.coverage(exclude=joiner_big) == {0: 1, 1: 1, 2: 1}  # the dead peer does not count
    assert view.coverage(exclude=joiner_big, joining_before=joiner_big) == {0: 1, 1: 1, 2: 1}
    assert view.coverage(exclude=joiner_small, joining_before=joiner_small) == {0: 1, 1: 1, 2: 0}
    assert view.newest("a", 2, exclude=joiner_big) == (4, alive_id)
    assert view.trainer_step("a") == 5 and view.watchers([2, 3]) == [alive_id]
    table = render("m", 4, view, replication=2)
    assert "unreachable" in table and "UNCOVERED blocks [2, 3]" in table
    assert "copies: a@5: 1  (one failure would lose it)" in table  # block 0: served at 5 by one live peer


def test_records_carry_a_move_and_span_sizing_fits_the_model(tiny_models):
    record = ServerRecord(PeerID(b"x" * 8), ServerState.ONLINE, 0, 2, 1.0, {"a": 3}, moving_to=range(2, 4))
    back = ServerRecord.from_value(record.peer_id, record.to_value())
    assert back == record
    config = PeerConfig(model=str(tiny_models["llama"]), initial_peers=[])
    assert blocks_that_fit(load_spec(tiny_models["llama"]), config) == 4  # a tiny model fits whole


def test_a_backward_without_its_input_uses_the_cached_forward_and_equals_one_with_it(tiny_models):
    """Leaving the hidden states out of a backward (the peer kept the forward) changes no bit of the gradients;
    without a cached forward it is refused with missing_forward, and the client sends the input after all."""
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    hidden = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for send_hidden in (True, False):
        backend = _backend(tiny_models["llama"], range(0, 2))
        backend.open_adapter("a", wire, seed=3, session="s")
        backend.forward("a", range(0, 2), 0, hidden, None, "s:0:0")
        grad_in = backend.backward("a", range(0, 2), 0, "s:0:0", hidden if send_hidden else None, None, grad)
        lora = [g for b in (0, 1) for g in backend.adapters["a"].blocks[b].grads["s:0:0"]]
        results.append((grad_in, lora))
        none = backend.backward("a", range(0, 2), 0, "s:0:1", hidden, None, grad, input_grad=False)
        assert none is None and "s:0:1" in backend.adapters["a"].blocks[0].grads
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    with pytest.raises(MissingForwardError, match="send its input"):
        backend.backward("a", range(0, 2), 0, "s:0:2", None, None, grad)


def test_a_step_taken_back_is_redone_to_the_same_bits(tiny_models):
    """A replica that applied a step while another could not (its gradients died with their holder) takes it back;
    applied again it matches the first apply exactly, and its gradients are still there to be served."""
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    backend = _backend(tiny_models["llama"], range(0, 2))
    backend.open_adapter("a", wire, seed=3, session="s")
    _train_one_step(backend, "a", range(0, 2), 0)
    before = backend.digests("a")
    _train_one_step(backend, "a", range(0, 2), 1)
    applied = backend.digests("a")
    assert backend.revert("a", 1) == {0: 1, 1: 1}
    assert backend.digests("a") == before, "taking a step back restores the state before it exactly"
    assert backend.micro_batch_grads("a", 1, {0: ["s:1:0"]})[0].keys() == {"s:1:0"}
    assert backend.revert("a", 1) == {0: 1, 1: 1}, "nothing to take back twice"
    backend.apply("a", 1, {b: ["s:1:0"] for b in range(2)}, HPARAMS)
    assert backend.digests("a") == applied
    exported, _ = backend.export_state("a", range(0, 2))
    backend.import_state("a", exported)
    assert backend.revert("a", 1) == {0: 2, 1: 2}, "a state replaced since (by a sync) keeps no undo"


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
        self.router, self.on_peer_state, self.sent = router, [], []

    def ask(self, peer: PeerID, request: SyncRequest) -> StepsReply:
        self.sent.append((peer, request.source.to_base58(), request.start, request.end))
        return StepsReply({b: 1 for b in self.router.servers[peer]})


def test_a_takeover_holding_part_of_its_span_current_syncs_only_the_rest():
    """The only server of blocks 2:4 died after step 1; its copies were spread: one peer held block 2, the other block
    3. The peer that took 2:4 over holds block 2 at step 1 from its own copy and block 3 at step 0: block 3 comes from
    the other copy's holder, and block 2 needs no source (it used to fail: "no current copy of block 2")."""
    mover, stayer = PeerID(b"m" * 8), PeerID(b"s" * 8)
    stack = _Stack(_Router({mover: range(2, 4), stayer: range(0, 2)}))
    replicas = ReplicaSet(stack, open_on=lambda peer: ({}, {}))
    try:
        replicas.current[stayer] = 1
        replicas.note_standby(stayer, {3: 1})
        steps = replicas._sync(mover, range(2, 4), {2: 1, 3: 0}, step=1)
    finally:
        replicas.close()
    assert stack.sent == [(mover, stayer.to_base58(), 3, 4)]
    assert steps == {2: 1, 3: 1}


class _BanningRouter(_Router):
    def __init__(self, servers: dict[PeerID, range]):
        super().__init__(servers)
        self.banned: list[PeerID] = []

    def ban(self, peer: PeerID, reason: str) -> float:
        self.banned.append(peer)
        self.servers.pop(peer, None)
        return 2.0


class _DeadSourceStack(_Stack):
    """A SYNC from ``dead`` fails the way a peer reports it: the source, not the asking peer, is unavailable."""

    def __init__(self, router: _Router, dead: PeerID):
        super().__init__(router)
        self.dead = dead

    def ask(self, peer: PeerID, request: SyncRequest) -> StepsReply:
        if request.source == self.dead:
            self.sent.append((peer, request.source.to_base58(), request.start, request.end))
            raise RemoteError(ErrorKind.SOURCE_UNAVAILABLE, "could not pull blocks 2:4")
        return super().ask(peer, request)


def test_a_sync_whose_source_died_pulls_from_another_and_blames_the_source():
    """Chaos found it: the client chose a dead replica (its record still fresh) as the source of a sync; the syncing
    peer's refusal was taken as its own failure, so the healthy peer was banned and the dead source chosen again,
    for 15 s of a stalled step. Now the source is dropped and another one used at once."""
    mover, dead, alive = PeerID(b"m" * 8), PeerID(b"d" * 8), PeerID(b"a" * 8)
    router = _BanningRouter({mover: range(2, 4), dead: range(2, 4), alive: range(2, 4)})
    stack = _DeadSourceStack(router, dead)
    replicas = ReplicaSet(stack, open_on=lambda peer: ({}, {}))
    try:
        replicas.current.update({dead: 1, alive: 1})
        steps = replicas._sync(mover, range(2, 4), {2: 0, 3: 0}, step=1)
    finally:
        replicas.close()
    assert stack.sent == [(mover, dead.to_base58(), 2, 4), (mover, alive.to_base58(), 2, 4)]
    assert router.banned == [dead] and dead not in replicas.current
    assert steps == {2: 1, 3: 1}


class _CommitRouter(_Router):
    def refresh(self) -> None:
        pass

    def announced(self) -> dict[int, list[PeerID]]:
        return {b: [p for p, span in self.servers.items() if b in span] for b in range(self.num_blocks)}


class _CommitStack:
    """Peers holding steps per block; OPEN reports them, COMMIT applies the step on every block of the peer."""

    adapter = "a"
    patience = 3.0

    def __init__(self, steps: dict[PeerID, dict[int, int]]):
        self.steps = steps
        self.router = _CommitRouter({p: range(min(held), max(held) + 1) for p, held in steps.items()})
        self.on_peer_state, self.commits, self.fast_forwards = [], [], []

    def open_on(self, peer: PeerID) -> tuple[dict[int, int], dict[int, int]]:
        return dict(self.steps[peer]), {}

    def ask(self, peer: PeerID, request: Request, floor: float = 0.0) -> StepsReply:
        held = self.steps[peer]
        if isinstance(request, SyncRequest):
            source = self.steps[request.source]
            held.update({b: source[b] for b in request.blocks})
        elif isinstance(request, CommitRequest):
            self.commits.append(peer)
            self.steps[peer] = {b: s + 1 if s == request.step else s for b, s in held.items()}
        elif isinstance(request, RevertRequest):
            self.steps[peer] = {b: request.step if s == request.step + 1 else s for b, s in held.items()}
        else:
            assert isinstance(request, FastForwardRequest), request
            self.fast_forwards.append((peer, request.start))
            held[request.start] = request.step
        return StepsReply(dict(self.steps[peer]))

    def recovered(self, *args) -> None:
        pass


def _commit_step(stack: _CommitStack, step: int, holders: dict[int, PeerID]) -> dict[PeerID, range]:
    """Commit ``step`` of one micro-batch whose gradients of each block are held by ``holders[block]``."""
    replicas = ReplicaSet(stack, open_on=stack.open_on)
    ledger = StepLedger(step=step, session="s")
    for block, holder in holders.items():
        ledger.acknowledge(f"s:{step}:000000001", range(block, block + 1), holder)
    try:
        return commit(stack, replicas, ledger, HPARAMS)
    finally:
        replicas.close()


def test_a_replica_that_already_applied_the_step_counts_as_committed():
    """Chaos found it: the only server of blocks 2:4 applied step 45, that commit was taken back elsewhere, and the
    peer came back (restarted from its checkpoint) already at 46. The client, still committing 45, refused it ("holds
    steps [46], not 45") and waited for a server of 2:4 at 45 that never came: the training loop died one step behind
    its own peers. A replica applies a step only with every gradient of the ledger, so its state is the step's result:
    the commit counts it as applied and does not ask it again."""
    ahead, behind = PeerID(b"x" * 8), PeerID(b"w" * 8)
    stack = _CommitStack({ahead: {2: 46, 3: 46}, behind: {0: 45, 1: 45}})
    applied = _commit_step(stack, 45, {0: behind, 1: behind, 2: ahead, 3: ahead})
    assert applied == {ahead: range(2, 4), behind: range(0, 2)}
    assert stack.commits == [behind]
    assert stack.steps[behind] == {0: 46, 1: 46}


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


def test_a_replica_past_the_step_is_not_counted_for_gradients_that_replaced_discarded_ones():
    """The other side of counting a replica past the step as applied: if the user discarded the gradients of a commit
    that failed part-way (zero_grad without a step) and trains the step again, a replica that applied the discarded
    gradients holds another state. It must never pass for having applied the new ones: exactly once."""
    ahead, behind = PeerID(b"x" * 8), PeerID(b"w" * 8)
    stack = _CommitStack({ahead: {2: 46, 3: 46}, behind: {0: 45, 1: 45}})
    stack.patience = 1.0
    replicas = ReplicaSet(stack, open_on=stack.open_on)
    ledger = StepLedger(step=45, session="s", committing=True).discarded()
    for block, holder in ((0, behind), (1, behind), (2, behind), (3, behind)):
        ledger.acknowledge("s:45:000000002", range(block, block + 1), holder)
    try:
        with pytest.raises(SwarmUnavailableError, match=r"blocks \[2, 3\] have had no live replica at step 45"):
            commit(stack, replicas, ledger, HPARAMS)
    finally:
        replicas.close()
    assert stack.commits == []
    replicas = ReplicaSet(stack, open_on=stack.open_on)
    replicas.current[ahead] = 46
    try:
        take_back_abandoned(stack, replicas, 45)  # what discard_step does first
    finally:
        replicas.close()
    assert stack.steps[ahead] == {2: 45, 3: 45} and replicas.current[ahead] == 45


def test_a_block_without_a_current_copy_waits_for_its_holders_before_declaring_a_loss():
    """Chaos found it: both servers of a block were killed within seconds and restarted from their checkpoints; a
    peer that had just joined with a fresh state answered first, and the client declared 148 steps lost on the spot
    (the restarted peers came back holding the step moments later). A loss is declared only after ``lost_grace``
    seconds without any holder of the step, or at once when the user asked for it (``resume="latest"``)."""
    current, survivor = PeerID(b"w" * 8), PeerID(b"x" * 8)
    stack = _CommitStack({current: {0: 5, 1: 5}, survivor: {2: 3, 3: 3}})
    replicas = ReplicaSet(stack, open_on=stack.open_on, lost_grace=0.3)
    try:
        replicas.refresh(5)
        assert stack.fast_forwards == [] and replicas.lost == []
        time.sleep(0.35)
        replicas.refresh(5)
        assert stack.fast_forwards == [(survivor, 2), (survivor, 3)]
        assert [(e.blocks, e.steps) for e in replicas.lost] == [((2,), 2), ((3,), 2)]
        assert replicas.current[survivor] == 5
    finally:
        replicas.close()
    stack = _CommitStack({current: {0: 5, 1: 5}, survivor: {2: 3, 3: 3}})
    replicas = ReplicaSet(stack, open_on=stack.open_on, lost_grace=60.0)
    try:
        replicas.refresh(5, accept_losses=True)
        assert stack.fast_forwards == [(survivor, 2), (survivor, 3)]
    finally:
        replicas.close()


def test_a_request_for_blocks_a_peer_no_longer_serves_sends_the_client_elsewhere(tiny_models):
    """Chaos found it: a peer restarted with its identity and chose other blocks; the client, whose records still
    showed the old span, sent it a backward and got "bad request", which ended the training loop. Blocks a peer does
    not serve are a stale view, not a wrong request: the refusal is one the client routes around."""
    backend = _backend(tiny_models["llama"], range(2, 4))
    backend.open_adapter("a", lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj"])), 0)
    hidden = torch.randn(1, 4, backend.spec.hidden_size)
    with pytest.raises(NotServedError, match="blocks 0:2 are not all served here") as refused:
        backend.forward("a", range(0, 2), 0, hidden, None, "s:0:0")
    assert refused.value.kind in PEER_STATE_ERRORS
    with pytest.raises(RequestError) as malformed:
        backend.forward("a", range(3, 3), 0, hidden, None, "s:0:1")
    assert malformed.value.kind == ErrorKind.BAD_REQUEST


def test_a_cached_forward_is_counted_at_what_autograd_keeps(tiny_models):
    """The activation cache's budget is spent on the bytes a forward's graph really holds, which grow with the span
    (a fixed multiple of the output undercounted a 32-block span about 180 times)."""
    backend = _backend(tiny_models["llama"], range(0, 4))
    backend.open_adapter("a", lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj"])), 0)
    hidden = torch.randn(2, 8, backend.spec.hidden_size)
    backend.forward("a", range(0, 1), 0, hidden, None, "s:0:0")
    one = backend.cache.bytes
    backend.forward("a", range(0, 4), 0, hidden, None, "s:0:1")
    four = backend.cache.bytes - one
    output = hidden.numel() * hidden.element_size()
    assert one > 8 * output, (one, output)  # a block keeps many hidden-sized tensors, not the output alone
    assert 3.5 * one <= four <= 4.5 * one, (one, four)
