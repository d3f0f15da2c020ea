"""peers.backend and the adapters' store it runs on (peers.adapters, with its commits and moves of state) in one
process: standby copies, hand-over and catch-up, fast-forward, taking a step back, cached forwards, and refusals the
client routes around."""

from __future__ import annotations

import gc
from dataclasses import replace

import peft
import pytest
import torch

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.commits import Commits
from peers.reduction.held import HeldGradients
from peers.state import BlockState, BlockUpdate, SavedBytes, pack_states, unpack_states
from peers.transfer import StateTransfer
from swarm.blocks import lora_config_to_wire
from swarm.net.errors import ErrorKind, MissingForwardError, NotServedError, RequestError
from swarm.net.gradhash import grad_hash
from swarm.net.protocol import PEER_STATE_ERRORS, InferRequest, OptimizerHParams
from swarm.spec import load_spec
from swarm.testing.dishonest import CorruptUpdates

HPARAMS = OptimizerHParams(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def _backend(model_dir, blocks: range) -> SpanBackend:
    spec = load_spec(model_dir)
    return SpanBackend(spec, blocks, torch.device("cpu"), torch.float32, "none", AdapterStore(spec))


def _train_one_step(backend: SpanBackend, name: str, blocks: range, step: int) -> None:
    hidden = torch.randn(1, 6, backend.spec.hidden_size, generator=torch.Generator().manual_seed(step))
    mb = f"s:{step}:0"
    backend.forward(name, blocks, step, hidden, None, mb)
    backend.backward(name, blocks, step, mb, hidden, None, torch.ones_like(hidden))
    Commits(backend.adapters).apply(name, step, {b: [(mb,)] for b in blocks}, HPARAMS)


def _server_and_copies(model_dir) -> tuple[SpanBackend, SpanBackend]:
    """A server of blocks 2:4 one step into adapter "a", and a peer of 0:2 holding copies of its blocks at step 1."""
    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    server, holder = _backend(model_dir, range(2, 4)), _backend(model_dir, range(0, 2))
    server.adapters.open_adapter("a", wire, seed=3, session="s")
    _train_one_step(server, "a", range(2, 4), 0)
    holder.adapters.keep_standby(
        "a", {"lora": wire, "seed": 3}, StateTransfer(server.adapters).export_state("a", range(2, 4))[0], keep={2, 3}
    )
    return server, holder


def test_standby_copies_take_over_exactly_and_moves_keep_state(tiny_models):
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    server, other = _backend(tiny_models["llama"], range(2, 4)), _backend(tiny_models["llama"], range(0, 2))
    server.adapters.open_adapter("a", wire, seed=3, session="s")
    for step in range(2):
        _train_one_step(server, "a", range(2, 4), step)
    exported, _ = StateTransfer(server.adapters).export_state("a", range(2, 4))
    other.adapters.keep_standby("a", {"lora": wire, "seed": 3}, exported, keep={2, 3})
    assert other.adapters.adapter("a").standby_steps() == {2: 2, 3: 2}
    # a standby copy can be passed on
    assert StateTransfer(other.adapters).export_state("a", range(2, 4))[0][2].step == 2
    other.install(other.load_layers(range(2, 4)))  # takeover: the served block starts from the copy
    assert (
        other.adapters.digests("a")[2] == server.adapters.digests("a")[2]
        and other.adapters.digests("a")[3] == server.adapters.digests("a")[3]
    )
    assert other.adapters.adapter("a").standby_steps() == {}
    other.remove([0, 1])  # handed over: the state stays as a standby copy
    assert sorted(other.layers) == [2, 3] and set(other.adapters.adapter("a").standby_steps()) == {0, 1}


def test_a_copy_never_changes_a_served_block_behind_the_trainers_back(tiny_models):
    """Only the trainer moves a served block (commit, sync, revert, or a copy it asks for at its step: a peer
    handing the block over is asked as a holder): a newer copy, pulled in the background or taken by a move, may be
    a step the trainer has taken back. Loaded into served blocks, it once left a peer past the step
    the trainer replayed, and the replay waited for that step until its patience ran out."""
    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ahead, served = _backend(tiny_models["llama"], range(2, 4)), _backend(tiny_models["llama"], range(1, 4))
    for backend in (ahead, served):
        backend.adapters.open_adapter("a", wire, seed=3, session="s")
    for step in range(2):
        _train_one_step(ahead, "a", range(2, 4), step)
    _train_one_step(served, "a", range(1, 4), 0)
    before = served.adapters.digests("a")
    exported, _ = StateTransfer(ahead.adapters).export_state("a", range(2, 4))
    served.adapters.keep_standby("a", {"lora": wire, "seed": 3}, exported, keep=None)
    assert served.adapters.adapter("a").steps() == {1: 1, 2: 1, 3: 1} and served.adapters.digests("a") == before
    assert served.adapters.adapter("a").standby_steps() == {}, "a served block keeps no second copy"
    served.adapters.keep_standby(
        "a", {"lora": wire, "seed": 3}, exported, keep=None, trainer_step=2
    )  # the trainer's hold
    assert (
        served.adapters.adapter("a").steps() == {1: 1, 2: 2, 3: 2}
        and served.adapters.digests("a")[2] == ahead.adapters.digests("a")[2]
    )


def test_a_copy_one_step_behind_catches_up_from_the_last_update_exactly(tiny_models):
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    server, holder = _backend(tiny_models["llama"], range(2, 4)), _backend(tiny_models["llama"], range(0, 2))
    server.adapters.open_adapter("a", wire, seed=3, session="s")
    _train_one_step(server, "a", range(2, 4), 0)
    states, updates = StateTransfer(server.adapters).export_state("a", range(2, 4), held={})
    assert updates == {}, "a peer holding no copy gets the whole state"
    holder.adapters.keep_standby("a", {"lora": wire, "seed": 3}, states, keep={2, 3})
    for step in (1, 2):
        _train_one_step(server, "a", range(2, 4), step)
        states, updates = StateTransfer(server.adapters).export_state(
            "a", range(2, 4), held=holder.adapters.adapter("a").standby_steps()
        )
        assert states == {} and sorted(updates) == [2, 3]
        index, flat = pack_states({block: update.as_state() for block, update in updates.items()})  # the wire form
        back = {
            b: BlockUpdate.from_state(u, updates[b].hparams, updates[b].base)
            for b, u in unpack_states(index, flat).items()
        }
        assert StateTransfer(holder.adapters).apply_updates("a", back) == [2, 3]
    for block in (2, 3):  # the same AdamW on the same gradients: the copy equals the server's state bit for bit
        copy, served = (
            holder.adapters.adapter("a").standby[block],
            BlockState.of(server.adapters.adapter("a").blocks[block]),
        )
        assert copy.step == served.step == 3 and copy.tensors.keys() == served.tensors.keys()
        for name, entry in served.tensors.items():
            assert entry.keys() == copy.tensors[name].keys()
            assert all(torch.equal(copy.tensors[name][key], tensor) for key, tensor in entry.items()), name
    states, updates = StateTransfer(server.adapters).export_state("a", range(2, 4), held={2: 1, 3: 1})
    assert sorted(states) == [2, 3] and updates == {}, "a copy two steps behind gets the whole state"


def test_a_copy_from_a_step_its_server_took_back_and_redid_otherwise_is_dropped_not_brought_forward(tiny_models):
    """A copy follows its server's last apply of step 1; the server takes step 1 back and redoes it with other
    gradients (a replay). The copy is at the right step in other bits: brought forward by the next update it would
    drift from the servers for good (seen under churn: the copy took the block over and broke the replicas' vote).
    It is dropped instead, and the next pull brings the whole state."""
    server, holder = _server_and_copies(tiny_models["llama"])
    _train_one_step(server, "a", range(2, 4), 1)
    _, updates = StateTransfer(server.adapters).export_state(
        "a", range(2, 4), held=holder.adapters.adapter("a").standby_steps()
    )
    assert StateTransfer(holder.adapters).apply_updates("a", updates) == [2, 3]
    Commits(server.adapters).revert("a", 1)
    hidden = torch.randn(1, 6, server.spec.hidden_size, generator=torch.Generator().manual_seed(99))
    server.forward("a", range(2, 4), 1, hidden, None, "s:1:1")
    server.backward("a", range(2, 4), 1, "s:1:1", hidden, None, torch.ones_like(hidden))
    Commits(server.adapters).apply("a", 1, {b: [("s:1:0", "s:1:1")] for b in range(2, 4)}, HPARAMS)
    _train_one_step(server, "a", range(2, 4), 2)
    held = holder.adapters.adapter("a").standby_steps()
    assert held == {2: 2, 3: 2}
    _, updates = StateTransfer(server.adapters).export_state("a", range(2, 4), held=held)
    assert sorted(updates) == [2, 3] and all(u.base for u in updates.values())
    assert StateTransfer(holder.adapters).apply_updates("a", updates) == [], (
        "a copy in other bits is not brought forward"
    )
    assert holder.adapters.adapter("a").standby_steps() == {}
    states, updates = StateTransfer(server.adapters).export_state(
        "a", range(2, 4), held=holder.adapters.adapter("a").standby_steps()
    )
    assert sorted(states) == [2, 3] and updates == {}
    holder.adapters.keep_standby("a", holder.adapters.adapter("a").meta, states, keep={2, 3})
    for block in (2, 3):
        assert holder.adapters.adapter("a").standby[block].digest() == server.adapters.digests("a")[block]


def test_fast_forward_declares_an_older_state_current_and_reports_the_loss(tiny_models):
    import peft

    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    backend = _backend(tiny_models["llama"], range(0, 2))
    backend.adapters.open_adapter("a", wire, seed=0)
    assert StateTransfer(backend.adapters).fast_forward("a", range(0, 2), 3) == {0: 3, 1: 3}
    assert backend.adapters.adapter("a").steps() == {0: 3, 1: 3}
    assert StateTransfer(backend.adapters).fast_forward("a", range(0, 2), 3) == {}  # nothing lost twice


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
        backend.adapters.open_adapter("a", wire, seed=3, session="s")
        backend.forward("a", range(0, 2), 0, hidden, None, "s:0:0")
        grad_in = backend.backward("a", range(0, 2), 0, "s:0:0", hidden if send_hidden else None, None, grad)
        lora = [g for b in (0, 1) for g in backend.adapters.adapter("a").blocks[b].grads["s:0:0"]]
        results.append((grad_in, lora))
        none = backend.backward("a", range(0, 2), 0, "s:0:1", hidden, None, grad, input_grad=False)
        assert none is None and "s:0:1" in backend.adapters.adapter("a").blocks[0].grads
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
    backend.adapters.open_adapter("a", wire, seed=3, session="s")
    _train_one_step(backend, "a", range(0, 2), 0)
    before = backend.adapters.digests("a")
    _train_one_step(backend, "a", range(0, 2), 1)
    applied = backend.adapters.digests("a")
    assert Commits(backend.adapters).revert("a", 1) == {0: 1, 1: 1}
    assert backend.adapters.digests("a") == before, "taking a step back restores the state before it exactly"
    assert HeldGradients(backend.adapters).micro_batch_grads("a", 1, {0: ["s:1:0"]})[0].keys() == {"s:1:0"}
    assert Commits(backend.adapters).revert("a", 1) == {0: 1, 1: 1}, "nothing to take back twice"
    Commits(backend.adapters).apply("a", 1, {b: [("s:1:0",)] for b in range(2)}, HPARAMS)
    assert backend.adapters.digests("a") == applied

    other = _backend(tiny_models["llama"], range(0, 2))  # a peer that syncs from it, or moves onto its blocks
    other.adapters.open_adapter("a", wire, seed=3, session="s")
    exported, _ = StateTransfer(backend.adapters).export_state("a", range(0, 2))
    index, flat = pack_states(exported)
    StateTransfer(other.adapters).import_state("a", unpack_states(index, flat))
    assert other.adapters.digests("a") == applied
    assert Commits(other.adapters).revert("a", 1) == {0: 1, 1: 1}, (
        "a copy takes the step back like the replica it came from"
    )
    assert other.adapters.digests("a") == before
    assert HeldGradients(other.adapters).micro_batch_grads("a", 1, {0: ["s:1:0"]}) == {0: {}}, (
        "without the gradients: a redo fetches them"
    )
    assert Commits(other.adapters).revert("a", 1) == {0: 1, 1: 1}, "nothing to take back twice"


def test_a_request_for_blocks_a_peer_no_longer_serves_sends_the_client_elsewhere(tiny_models):
    """Chaos found it: a peer restarted with its identity and chose other blocks; the client, whose records still
    showed the old span, sent it a backward and got "bad request", which ended the training loop. Blocks a peer does
    not serve are a stale view, not a wrong request: the refusal is one the client routes around."""
    backend = _backend(tiny_models["llama"], range(2, 4))
    backend.adapters.open_adapter("a", lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj"])), 0)
    hidden = torch.randn(1, 4, backend.spec.hidden_size)
    with pytest.raises(NotServedError, match="blocks 0:2 are not all served here") as refused:
        backend.forward("a", range(0, 2), 0, hidden, None, "s:0:0")
    assert refused.value.kind in PEER_STATE_ERRORS
    with pytest.raises(RequestError) as malformed:
        backend.forward("a", range(3, 3), 0, hidden, None, "s:0:1")
    assert malformed.value.kind == ErrorKind.BAD_REQUEST


def test_a_cached_forward_is_counted_at_what_it_keeps(tiny_models):
    """The activation cache's budget is spent on the bytes a forward really keeps, which grow with the span (a fixed
    multiple of the output undercounted a 32-block span about 180 times). A backward recomputes one block at a time
    (tests/unit/test_block_recompute.py), so a forward keeps each block's input: one hidden-sized tensor a block."""
    backend = _backend(tiny_models["llama"], range(0, 4))
    backend.adapters.open_adapter("a", lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj"])), 0)
    hidden = torch.randn(2, 8, backend.spec.hidden_size)
    backend.forward("a", range(0, 1), 0, hidden, None, "s:0:0")
    one = backend.adapters.cache.bytes
    backend.forward("a", range(0, 4), 0, hidden, None, "s:0:1")
    four = backend.adapters.cache.bytes - one
    output = hidden.numel() * hidden.element_size()
    assert one == output and four == 4 * output, (one, four, output)
    mask = torch.ones(2, 8, dtype=torch.long)
    backend.forward("a", range(0, 4), 0, hidden, mask, "s:0:2")
    assert backend.adapters.cache.bytes - one - four == 4 * output + mask.nbytes  # the mask too


def test_forward_graphs_are_freed_after_a_backward_for_the_lora_gradients_only(tiny_models):
    """A chain's head computes no input gradient: its backward leaves the graph's input branch unexecuted. A graph
    kept with hooked saved tensors that form a cycle through C++ outlived its step, and the head grew by every
    micro-batch's activations, forever (a peer alone on its span: +46 KB a step at hidden 64). After a step's
    commit nothing of its graphs may be left."""
    backend = _backend(tiny_models["llama"], range(0, 2))
    backend.adapters.open_adapter(
        "a", lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), 0, "s"
    )
    hidden = torch.randn(2, 8, backend.spec.hidden_size)

    def live_graphs() -> int:
        gc.collect()
        return sum(isinstance(o, SavedBytes) for o in gc.get_objects())

    for step in range(3):
        for mb in (f"s:{step}:0", f"s:{step}:1"):
            backend.forward("a", range(0, 2), step, hidden, None, mb)
            backend.backward("a", range(0, 2), step, mb, None, None, torch.ones_like(hidden), input_grad=False)
        backend.forward("a", range(0, 2), step, hidden, None, f"s:{step}:2")  # a forward whose backward never came
        Commits(backend.adapters).apply("a", step, {b: [(f"s:{step}:0", f"s:{step}:1")] for b in range(2)}, HPARAMS)
        assert backend.adapters.cache.bytes == 0
        assert live_graphs() == 0, f"step {step}: forward graphs outlived their commit"


def test_gradients_computed_here_in_other_bits_than_the_ledgers_holder_are_dropped_to_be_fetched(tiny_models):
    """A micro-batch whose backward ran on two replicas (a retry) is held by both, in other bits where their kernels
    round differently; the ledger names one holder, and every replica must apply its bits, not its own."""
    backend = _backend(tiny_models["llama"], range(0, 2))
    backend.adapters.open_adapter("a", lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj"])), 0, "s")
    hidden = torch.randn(1, 6, backend.spec.hidden_size)
    for mb in ("s:0:0", "s:0:1"):
        backend.backward("a", range(0, 2), 0, mb, hidden, None, torch.ones_like(hidden), input_grad=False)
    held = backend.adapters.adapter("a").blocks[0].grads
    same = grad_hash(held["s:0:0"])
    HeldGradients(backend.adapters).drop_unlike("a", 0, {0: {"s:0:0": same, "s:0:1": "f" * 64}})
    assert set(backend.adapters.adapter("a").blocks[0].grads) == {"s:0:0"}  # the one in the holder's bits stays
    assert HeldGradients(backend.adapters).missing("a", 0, {0: [("s:0:0",), ("s:0:1",)]}) == {
        0: ["s:0:1"]
    }  # the other is fetched at commit


def test_a_commit_of_blocks_held_but_no_longer_served_is_refused_not_applied(tiny_models):
    """Chaos found it (the replicas' vote showed it): a peer restarted on blocks 0:2 from a checkpoint that also held
    2:4, which it served before; a client with the old records sent it a commit of 2:4, and it applied that step to its
    stale states and voted with them. Blocks it does not serve are refused (the client routes around it)."""
    lora = lora_config_to_wire(peft.LoraConfig(r=4, target_modules=["q_proj"]))
    before = _backend(tiny_models["llama"], range(0, 4))
    before.adapters.open_adapter("a", lora, 0)
    _train_one_step(before, "a", range(0, 4), 0)
    exported, _ = StateTransfer(before.adapters).export_state("a", range(0, 4))
    restarted = _backend(tiny_models["llama"], range(0, 2))
    restarted.adapters.open_adapter("a", lora, 0)
    StateTransfer(restarted.adapters).import_state("a", exported)
    with pytest.raises(NotServedError, match=r"blocks \[2, 3\] are not served here") as refused:
        Commits(restarted.adapters).apply("a", 1, {2: [("s:1:0",)], 3: [("s:1:0",)]}, HPARAMS)
    assert refused.value.kind in PEER_STATE_ERRORS


def test_generation_runs_under_the_clients_autocast(tiny_models):
    """A generation request carries the caller's autocast: the peer decodes as the local model would under it."""
    backend = _backend(tiny_models["llama"], range(0, 2))
    hidden = torch.randn(1, 5, backend.spec.hidden_size, generator=torch.Generator().manual_seed(0))

    def infer(session: str, autocast: str | None) -> torch.Tensor:
        return backend.infer(
            InferRequest(session=session, start=0, end=2, position=0, max_length=8, hidden=hidden, autocast=autocast),
            hidden,
            None,
        )

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        local = backend.run(hidden, None, range(0, 2)).float()
    assert torch.equal(infer("bf16", "bfloat16"), local)
    assert not torch.equal(infer("fp32", None), local)


def test_a_server_that_altered_its_state_after_its_update_is_found_out_by_the_copies_it_updates(tiny_models, caplog):
    """Issue 59: a copy one step behind applies the server's last update itself; where the result is not the
    server's state (``BlockUpdate.reaches``), the server altered its adapter outside the step. The copy keeps what
    the update gives, and the server is named. ``explains`` tells the same from the server's own state before."""
    server, holder = _server_and_copies(tiny_models["llama"])
    _train_one_step(server, "a", range(2, 4), 1)
    CorruptUpdates().updated([server.adapters.adapter("a").blocks[2]])  # block 2 altered after its update
    _, updates = StateTransfer(server.adapters).export_state(
        "a", range(2, 4), held=holder.adapters.adapter("a").standby_steps()
    )
    assert sorted(updates) == [2, 3] and all(u.after for u in updates.values())
    # the server's states, with the state before
    whole = StateTransfer(server.adapters).export_state("a", range(2, 4))[0]
    assert updates[3].explains(whole[3]) and not updates[2].explains(whole[2])
    with caplog.at_level("ERROR", logger="peers.transfer"):
        applied = StateTransfer(holder.adapters).apply_updates("a", updates, dict.fromkeys(updates, "the-server"))
    assert applied == [2, 3]
    named = [r.getMessage() for r in caplog.records if "is not its own last update applied" in r.getMessage()]
    assert len(named) == 1 and "blocks [2]" in named[0] and "the-server" in named[0], named
    copies, digests = holder.adapters.adapter("a").standby, server.adapters.digests("a")
    assert copies[3].digest() == digests[3] and copies[2].digest() != digests[2]
    assert copies[2].digest() == updates[2].apply_to(replace(whole[2].before, before=None)).digest()


def test_a_served_block_takes_an_update_onto_its_own_state_only_when_told_to(tiny_models):
    """A trainer's sync from a server whose state was found altered: the replica's own state, in other bits than the
    server's state before the step, is brought forward with the server's update (``own_lineage``), not left behind
    nor replaced by the altered state."""
    wire = lora_config_to_wire(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    liar, replica = _backend(tiny_models["llama"], range(2, 4)), _backend(tiny_models["llama"], range(2, 4))
    for backend in (liar, replica):
        backend.adapters.open_adapter("a", wire, seed=3, session="s")
        _train_one_step(backend, "a", range(2, 4), 0)
    CorruptUpdates().updated(list(liar.adapters.adapter("a").blocks.values()))
    _train_one_step(liar, "a", range(2, 4), 1)
    _, updates = StateTransfer(liar.adapters).export_state("a", range(2, 4), held=replica.adapters.adapter("a").steps())
    assert sorted(updates) == [2, 3]
    assert StateTransfer(replica.adapters).apply_updates("a", updates) == [], (
        "the replica's state is not the liar's at step 1"
    )
    served = replica.adapters.adapter("a").blocks
    before = {block: BlockState.of(state, with_before=False) for block, state in served.items()}
    assert StateTransfer(replica.adapters).apply_updates("a", updates, own_lineage=True) == [2, 3]
    for block, state in replica.adapters.adapter("a").blocks.items():
        assert state.step == 2 and state.digest() == updates[block].apply_to(before[block]).digest()
        assert state.digest() != liar.adapters.digests("a")[block]
