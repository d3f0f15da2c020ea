"""Committing over replicas when a replica fails, on real peers in this process with faults injected at chosen calls:
whatever fails, each step is applied exactly once, and the adapter ends equal to local peft trained on the same data
(or, when every copy of some blocks died, the steps lost are reported and training goes on from the survivor)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from shutil import ignore_patterns

import peft
import torch
import transformers
from safetensors.torch import load_file

from peers.update import ExactAdamW
from swarm.client.commit import StepsLost
from swarm.net.protocol import Method
from swarm.net.records import ServerState, read_servers
from swarm.testing.faults import Action, Fault
from swarm.testing.inprocess import InProcessPeer, InProcessPeerError, InProcessSwarm
from swarm.testing.recipe import (
    HPARAMS,
    MAX_GRAD_NORM,
    MICRO_BATCHES,
    STEPS,
    assert_matches_local_peft,
    batches_for_step,
    connect,
)
from swarm.testing.recipe import train as train_steps

FIRED = 60.0  # seconds a test waits to see its fault fire (it fires within a step or two)


def train(
    swarm: InProcessSwarm, model_dir: Path, out: Path, adapter: str, steps: int = STEPS, **client
) -> list[StepsLost]:
    """Train ``steps`` through the swarm (replicas checked identical after each), saving the adapter before and
    after in ``out/initial`` and ``out/final``; returns the steps the client reported lost."""
    model = connect(swarm, model_dir, adapter, **client)
    try:
        model.save_adapter(out / "initial")
        train_steps(model, steps)
        model.save_adapter(out / "final")
        return list(model.steps_lost)
    finally:
        model.shutdown()


def test_a_replica_whose_commit_reply_was_lost_counts_as_applied_and_is_not_asked_again(
    inprocess_swarm, tiny_models, tmp_path
):
    """The only server of blocks 2:4 applies step 1 but its reply is lost: the client sees a failure, then finds
    the peer one step ahead. A replica applies only with every gradient of the step, so it counts as applied; asked
    again, it would have been fine too, but it must never apply the step twice."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "2:4"})
    fault = peers["b"].faults.arm(Fault(Action.DROP, Method.COMMIT, nth=2))
    train(swarm, tiny_models["llama"], tmp_path, "dropped-commit")
    assert fault.wait_fired(0)
    assert peers["b"].faults.calls[Method.COMMIT] == STEPS, "the peer that had applied the step was asked again"
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_partial_commit_is_taken_back_and_redone_once(inprocess_swarm, tiny_models, tmp_path):
    """Peer c serves all 4 blocks and computes every micro-batch: a and b, the other replicas of 0:2 and 2:4,
    announce a speed that no route takes them for (``--throughput``), so the test does not depend on how fast the
    router believes each peer is. They fetch the gradients from c at commit. The second fetch of step 0 loses its
    reply: c and the first fetcher applied the step, the second fetcher could not. Both appliers take the step back
    (REVERT), the gradients are replayed, and the step is committed everywhere, to the same bits as once."""
    swarm = inprocess_swarm()
    peers = {"c": swarm.add_peer("0:4", "c"), **swarm.start_peers({"a": "0:2", "b": "2:4"}, throughput=1.0)}
    fault = peers["c"].faults.arm(Fault(Action.DROP, Method.GRADS, nth=2))  # the second fetch of step 0
    train(swarm, tiny_models["llama"], tmp_path, "taken-back")
    assert fault.wait_fired(0)
    reverts = {name: peer.faults.calls[Method.REVERT] for name, peer in peers.items()}
    assert reverts["c"] == 1 and sorted([reverts["a"], reverts["b"]]) == [0, 1], reverts
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_replica_killed_after_applying_mid_commit_leaves_the_others_to_apply_once(
    inprocess_swarm, tiny_models, tmp_path
):
    """Peer c (all 4 blocks, and the gradients of the micro-batches routed through it) applies step 1 and dies
    before it replies, while a and b fetch its gradients: whatever they got before it died, lost gradients are
    replayed on them and each applies the step once. Training goes on without c."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"c": "0:4", "a": "0:2", "b": "2:4"})
    fault = peers["c"].faults.arm(Fault(Action.KILL, Method.COMMIT, nth=2, after=True))
    train(swarm, tiny_models["llama"], tmp_path, "killed-mid-commit")
    assert fault.wait_fired(0) and peers["c"].killed
    assert peers["a"].adapters.by_name["killed-mid-commit"].steps() == {0: STEPS, 1: STEPS}
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_replica_restarted_past_the_step_while_a_replay_waits_takes_the_step_back(
    inprocess_swarm, tiny_models, tmp_path
):
    """Two failures in one commit, as the churn test met them. As in the test above, c computes every micro-batch
    (a and b serve blocks 1 and 2 only, at a speed no route takes them for) and the second fetch of its gradients
    (step 1) loses its reply, so the step is taken back and the gradients replayed, through every block at step 1.
    But c dies as it is asked to take the step back, and restarts from its checkpoint, at step 2. The replay, waiting
    for a server of blocks 0 and 3, finds c past the step and has it take the step back (its checkpoint keeps the
    state before the apply): the step is redone, nothing is lost. Before, the restarted c could not take the step
    back and the client waited out its patience (SwarmUnavailableError)."""
    swarm = inprocess_swarm()
    checkpoints = tmp_path / "c-checkpoints"
    c = swarm.add_peer("0:4", "c", checkpoint_dir=str(checkpoints))
    swarm.start_peers({"a": "1:2", "b": "2:3"}, throughput=1.0)
    dropped = c.faults.arm(Fault(Action.DROP, Method.GRADS, nth=2, when=lambda meta: meta["step"] == 1))
    c_dies = c.faults.arm(Fault(Action.KILL, Method.REVERT))
    restarted: list[InProcessPeer] = []
    errors: list[Exception] = []

    def restart_c() -> None:
        """c again, from its checkpoint, under another identity: in this process the dead c's locks live on in the
        DHT processes forked since it took them (a restart as itself is tested end to end)."""
        if not c_dies.wait_fired(FIRED):
            return
        deadline = time.monotonic() + FIRED
        written = c.daemon.writer.written  # (adapter, block) -> step (the store's own load would discard writes)
        while any(written.get(("restarted", b)) != 2 for b in range(4)):
            if time.monotonic() > deadline:
                return  # c's checkpoint of step 1 never came: the assertions below say so
            time.sleep(0.05)
        copied = shutil.copytree(checkpoints, tmp_path / "c-checkpoints-again", ignore=ignore_patterns(".peer.lock"))
        try:
            restarted.append(swarm.add_peer("0:4", "c-again", checkpoint_dir=str(copied)))
        except InProcessPeerError as e:
            errors.append(e)

    restarter = threading.Thread(target=restart_c, daemon=True)
    restarter.start()
    train(swarm, tiny_models["llama"], tmp_path, "restarted", patience=40.0)
    restarter.join(FIRED)
    assert dropped.wait_fired(0) and c_dies.wait_fired(0) and restarted, errors
    assert restarted[0].faults.calls[Method.REVERT] == 1, "the restarted replica was not asked to take the step back"
    assert restarted[0].adapters.by_name["restarted"].steps() == {b: STEPS for b in range(4)}
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_frozen_replica_is_left_behind_then_synced_back(inprocess_swarm, tiny_models, tmp_path):
    """Peer b freezes in its commit of step 1 (it stays connected, so it may still hold state): the client gives up
    on it after the commit's timeout and commits on a alone; once b's ban is over, the client finds it behind and
    has it pull the state from a (SYNC). The frozen commit, released at the end, changes nothing."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:4", "b": "0:4"})
    fault = peers["b"].faults.arm(Fault(Action.FREEZE, Method.COMMIT, nth=2, freeze_for=120.0))
    train_left_behind(swarm, tiny_models["llama"], tmp_path, "frozen", peers["b"])
    assert fault.wait_fired(0)
    assert peers["b"].faults.calls[Method.SYNC] == 1, "the replica left behind was not synced once"
    assert peers["b"].adapters.by_name["frozen"].steps() == {b: STEPS for b in range(4)}
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_sync_whose_source_dies_pulls_from_another_replica(inprocess_swarm, tiny_models, tmp_path):
    """Replica c falls behind (frozen in a commit); the client has it sync from a current replica, which dies as it
    is asked for the state. The source, not c, is to blame: c pulls from the other current replica at once."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:4", "b": "0:4", "c": "0:4"})
    peers["c"].faults.arm(Fault(Action.FREEZE, Method.COMMIT, nth=2, freeze_for=120.0))
    source_dies = Fault(Action.KILL, Method.EXPORT)  # the first export asked of a or b: c's sync
    for name in ("a", "b"):
        peers[name].faults.arm(source_dies)
    train_left_behind(swarm, tiny_models["llama"], tmp_path, "source-dies", peers["c"])
    assert source_dies.wait_fired(0)
    assert [peers["a"].killed, peers["b"].killed].count(True) == 1
    assert peers["c"].faults.calls[Method.SYNC] == 2, "c was not asked again, from another source"
    assert peers["c"].adapters.by_name["source-dies"].steps() == {b: STEPS for b in range(4)}
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def train_left_behind(swarm: InProcessSwarm, model_dir: Path, out: Path, adapter: str, laggard: InProcessPeer) -> None:
    """``train``, with a pause after step 2 for the client's ban of ``laggard`` (which failed at step 1) to end:
    steps of a tiny model take less than a ban, and only a peer that is not banned is brought back in."""
    model = connect(swarm, model_dir, adapter)
    try:
        model.save_adapter(out / "initial")
        train_steps(model, 2)
        deadline = time.monotonic() + 30.0
        health = model.session.router.health
        while time.monotonic() < deadline and health[laggard.peer_id].banned_until > time.monotonic():
            time.sleep(0.1)
        train_steps(model, STEPS)
        model.save_adapter(out / "final")
    finally:
        model.shutdown()


def test_blocks_whose_every_copy_died_resume_from_the_survivor_and_report_the_loss(
    inprocess_swarm, tiny_models, tmp_path
):
    """The only server of blocks 2:4 dies after step 2, with no copy anywhere (no standby copies, min_copies=1); a
    fresh peer takes 2:4 over. After ``lost_grace`` the client declares its fresh state current (FAST_FORWARD, once
    per block) and reports 2 steps lost on each block; training goes on, and the adapter equals local peft with
    those blocks' LoRA and AdamW state started over at step 2."""
    model_dir = tiny_models["llama"]
    swarm = inprocess_swarm(standby_blocks=0)
    peers = swarm.start_peers({"a": "0:2", "b": "2:4"})
    model = connect(swarm, model_dir, "lost", min_copies=1, patience=16.0, lost_grace=8.0)
    try:
        model.save_adapter(tmp_path / "initial")
        train_steps(model, 2)
        peers["b"].kill()
        fresh = swarm.add_peer("2:4", "fresh")
        train_steps(model, STEPS)
        model.save_adapter(tmp_path / "final")
        lost = [(e.peer, e.blocks, e.steps, e.at_step) for e in model.steps_lost]
    finally:
        model.shutdown()
    assert lost == [(fresh.peer_id, (2,), 2, 2), (fresh.peer_id, (3,), 2, 2)]
    assert fresh.faults.calls[Method.FAST_FORWARD] == 2
    reference = reference_with_blocks_reset(model_dir, tmp_path / "initial", blocks=(2, 3), at_step=2)
    state = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert state.keys() == reference.keys()
    for key in state:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def reference_with_blocks_reset(
    model_dir: Path, initial: Path, blocks: tuple[int, ...], at_step: int
) -> dict[str, torch.Tensor]:
    """Local peft on the recipe's data, with ``blocks``' LoRA weights back to their initial values and their AdamW
    state dropped before step ``at_step``: what a block that lost every copy and resumed from a fresh one trains."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(base, initial, is_trainable=True)
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    start = {name: p.detach().clone() for name, p in named.items()}
    # the peers' AdamW: a block restarted from zero moments with B = 0 has near-zero gradients at first, where Adam
    # would turn the ulps between torch's AdamW and this update into a few thousandths of lr
    optimizer = ExactAdamW(list(named.values()), **HPARAMS)
    for step in range(STEPS):
        if step == at_step:
            for name, p in named.items():
                if any(f".layers.{block}." in name for block in blocks):
                    p.data.copy_(start[name])
                    optimizer.state.pop(p, None)
        for batch in batches_for_step(step):
            (model(**batch).loss / MICRO_BATCHES).backward()
        torch.nn.utils.clip_grad_norm_(list(named.values()), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(initial.parent / "reference")
    return load_file(initial.parent / "reference" / "adapter_model.safetensors")


def test_a_bug_in_a_peers_handler_answers_internal_and_blames_no_healthy_peer(inprocess_swarm, tiny_models, tmp_path):
    """Replica b falls behind (frozen in a commit); asked to sync from a, b's own handler raises TypeError (a bug of
    b's, not a failure of the source it pulls from). b answers ``internal`` and keeps serving; the client routes
    around b for a while but never blames a, whose state b then pulls at the next try; training ends equal to local
    peft."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:4", "b": "0:4"})
    peers["b"].faults.arm(Fault(Action.FREEZE, Method.COMMIT, nth=2, freeze_for=120.0))
    bug = peers["b"].faults.arm(Fault(Action.BUG, Method.SYNC))
    model = connect(swarm, tiny_models["llama"], "buggy-sync")
    try:
        model.save_adapter(tmp_path / "initial")
        health, deadline = model.session.router.health, time.monotonic() + FIRED
        while time.monotonic() < deadline and not (
            peers["b"].faults.calls[Method.SYNC] >= 2
            and set(peers["b"].adapters.by_name["buggy-sync"].steps().values()) == {model.step}
        ):
            train_steps(model, model.step + 1)
            while time.monotonic() < deadline and health[peers["b"].peer_id].banned_until > time.monotonic():
                time.sleep(0.1)
        model.save_adapter(tmp_path / "final")
        steps = model.step
        assert bug.wait_fired(0)
        assert health[peers["b"].peer_id].failures or health[peers["b"].peer_id].banned_until, "b's bug went unseen"
        assert peers["a"].peer_id not in health or not health[peers["a"].peer_id].banned_until, "the source was blamed"
    finally:
        model.shutdown()
    assert peers["b"].faults.calls[Method.SYNC] >= 2, "b was not asked again after its bug"
    assert peers["b"].adapters.by_name["buggy-sync"].steps() == {b: steps for b in range(4)}
    assert_matches_local_peft(tiny_models["llama"], tmp_path, steps)


def wait_standby_at(peer: InProcessPeer, adapter: str, blocks: list[int], step: int) -> None:
    """Until ``peer`` holds standby copies of ``blocks`` at ``step`` (it pulls them after each commit)."""
    deadline = time.monotonic() + FIRED
    while time.monotonic() < deadline:
        held = peer.adapters.by_name[adapter].standby_steps() if adapter in peer.adapters.by_name else {}
        if all(held.get(b) == step for b in blocks):
            return
        time.sleep(0.1)
    raise AssertionError(f"peer {peer.name} holds no standby copy of blocks {blocks} at step {step}: {held}")


def _both_servers_of_2_4_killed(
    swarm: InProcessSwarm, model_dir: Path, out: Path, adapter: str, balance_interval: float, **client
) -> InProcessPeer:
    """Peer a serves 0:2 with room for the whole model; b1 and b2 serve 2:4. Once a holds a copy of 2:4 at the
    client's step (after 2 steps), b1 and b2 die at once and stay dead, and training goes on. Checks that a took 2:4
    over, no step was lost and the adapter equals local peft; returns a."""
    servers = swarm.start_peers({"b1": "2:4", "b2": "2:4"})
    taker = swarm.add_peer("0:2", "a", rebalance=True, balance_interval=balance_interval)
    model = connect(swarm, model_dir, adapter, patience=60.0, **client)
    try:
        model.save_adapter(out / "initial")
        train_steps(model, 2)
        wait_standby_at(taker, model.adapter, [2, 3], model.step)
        for server in servers.values():
            server.kill()
        train_steps(model, STEPS)
        model.save_adapter(out / "final")
        lost = list(model.steps_lost)
    finally:
        model.shutdown()
    assert lost == []
    assert taker.daemon.standing.serving == range(0, 4)
    assert_matches_local_peft(model_dir, out)
    return taker


def test_both_servers_of_a_span_killed_and_a_third_current_copy_takes_it_over(inprocess_swarm, tiny_models, tmp_path):
    """Both servers of 2:4 die at once and stay dead; peer a serves 0:2, has room for the whole model and holds a
    standby copy of 2:4 at the client's step: it grows to 0:4 from that copy (a takeover), nobody restarts, no step is
    lost and the adapter equals local peft."""
    _both_servers_of_2_4_killed(inprocess_swarm(), tiny_models["llama"], tmp_path, "third-copy", balance_interval=1.0)


def test_a_span_left_without_a_server_is_taken_over_at_the_clients_notice(inprocess_swarm, tiny_models, tmp_path):
    """Both servers of 2:4 die at once. Peer a serves 0:2, has room for the whole model and holds the client's third
    copy of 2:4 (``min_copies=3``), but looks at the swarm by itself only once an hour. The client, finding 2:4
    without a server, sends the live peers an ``unserved`` notice: a looks now and grows over 2:4 from that copy. No
    step is lost and the adapter equals local peft. Without the notice the client waits out its patience and fails."""
    taker = _both_servers_of_2_4_killed(
        inprocess_swarm(), tiny_models["llama"], tmp_path, "notice", balance_interval=3600.0, min_copies=3
    )
    assert taker.daemon.woken_rounds >= 1


def test_a_standby_copy_follows_each_commit_of_a_server_whose_view_does_not_know_its_holder(
    inprocess_swarm, tiny_models, tmp_path
):
    """Servers b1 and b2 of 2:4 look at the swarm once an hour, so their views never learn that peer a keeps a
    standby copy of 2:4. a pulls it once (a balance round), naming itself: from then on the server it pulled from
    tells it of every commit, and its copy follows each step within seconds (before, it stayed where it was until
    a's next round, and a double failure of 2:4 in between found no current copy)."""
    swarm = inprocess_swarm(balance_interval=3600.0)
    swarm.start_peers({"b1": "2:4", "b2": "2:4"})
    holder = swarm.add_peer("0:2", "a")
    model = connect(swarm, tiny_models["llama"], "pullers", min_copies=1)
    try:
        train_steps(model, 1)
        _look_then_follow(model, holder, steps=3)
    finally:
        model.shutdown()
    assert holder.daemon.woken_rounds == 1


def _look_then_follow(model, holder: InProcessPeer, steps: int) -> None:
    """``holder`` holds a balance round (it pulls its standby copies of 2:4 once); then its copy must be at the
    client's step after each of ``steps`` more steps, where only commit notices can bring it (no more rounds)."""
    holder.look_now()
    wait_standby_at(holder, model.adapter, [2, 3], model.step)
    for step in range(model.step + 1, model.step + 1 + steps):
        train_steps(model, step)
        wait_standby_at(holder, model.adapter, [2, 3], model.step)


def test_a_copy_the_trainer_stops_asking_for_follows_the_commits_again(inprocess_swarm, tiny_models, tmp_path):
    """z is the only server of 2:4, so the trainer has a peer of 0:2 hold a copy of 2:4 at every step (a pin: that
    copy waits for the trainer, so that it can break a tie in the replicas' vote). Then w joins on 2:4: the trainer
    needs no copy any more and stops asking. The holder keeps 2:4 on standby (its balance round chose it), and its
    copy follows each commit again; before, a block pinned once was left out of the commit notices for good, and
    stayed up to a balance round behind."""
    swarm = inprocess_swarm(balance_interval=3600.0)
    peers = swarm.start_peers({"x": "0:2", "y": "0:2", "z": "2:4"})
    model = connect(swarm, tiny_models["llama"], "lapsed-pin", min_copies=2)
    try:
        train_steps(model, 1)
        holder = next(p for p in (peers["x"], peers["y"]) if p.adapters.by_name[model.adapter].standby_steps())
        swarm.add_peer("2:4", "w")
        train_steps(model, 3)  # the trainer brings w in and pins no copy of 2:4 from now on
        assert model.copies == {0: 2, 1: 2, 2: 2, 3: 2}
        _look_then_follow(model, holder, steps=3)
    finally:
        model.shutdown()


def test_a_copy_whose_source_dies_is_made_from_the_other_replica(inprocess_swarm, tiny_models, tmp_path):
    """``min_copies=3`` over x, y (0:2) and z, w (2:4): at every step (step 0 as the adapter opens) a peer of the
    other span copies the new state of each block from one of its replicas. The first source of 0:2 dies as it is
    asked for the state of step 0: the holders, which answered without the copy, are asked again with the other
    replica as the source, so step 0 is held three times all the same. (Before, the same source was named again,
    or the holders were not asked again at all, and the step returned short of copies.)"""
    model_dir = tiny_models["llama"]
    swarm = inprocess_swarm(standby_blocks=0)  # no standby pulls: every export is a trainer's copy
    peers = swarm.start_peers({"x": "0:2", "y": "0:2", "z": "2:4", "w": "2:4"})
    first = min((peers["x"], peers["y"]), key=lambda peer: peer.peer_id.to_bytes())
    fault = first.faults.arm(Fault(Action.KILL, Method.EXPORT))
    model = connect(swarm, model_dir, "copy-source", min_copies=3)
    try:
        assert fault.wait_fired(0)
        copies = model.copies
        model.save_adapter(tmp_path / "initial")
        train_steps(model, STEPS)
        model.save_adapter(tmp_path / "final")
        lost = list(model.steps_lost)
    finally:
        model.shutdown()
    assert copies == {0: 3, 1: 3, 2: 3, 3: 3}
    assert lost == []
    assert_matches_local_peft(model_dir, tmp_path)


def test_a_step_whose_only_server_dies_before_it_is_copied_is_committed_again(inprocess_swarm, tiny_models, tmp_path):
    """x is the only server of 0:2 and z of 2:4, which has room for the whole model; with ``min_copies=2`` each keeps
    a copy of the other's blocks at every step. x applies step 1 and dies as z asks it for that state, so no peer
    holds 0:2 at step 2. The client finds x gone and commits step 1 again: z grows over 0:2 from its copy at step 1,
    takes its own step back, the gradients that died with x are replayed on it and it applies the step. Nothing is
    lost and the adapter equals local peft. Before, the step was acknowledged with a single copy and declared lost at
    the next one, after ``lost_grace``."""
    model_dir, adapter = tiny_models["llama"], "recommitted"
    swarm = inprocess_swarm(standby_blocks=0)  # no standby pulls: every export is a trainer's copy
    x = swarm.add_peer("0:2", "x")
    z = swarm.add_peer("2:4", "z", rebalance=True, balance_interval=1.0)

    def applied_step_1(meta: dict) -> bool:
        state = x.adapters.by_name.get(adapter)
        return state is not None and set(state.steps().values()) == {2}

    fault = x.faults.arm(Fault(Action.KILL, Method.EXPORT, when=applied_step_1))
    lost = train(swarm, model_dir, tmp_path, adapter, min_copies=2, patience=60.0)
    assert fault.wait_fired(0) and x.killed
    assert lost == []
    assert z.daemon.standing.serving == range(0, 4)
    assert_matches_local_peft(model_dir, tmp_path)


def test_a_peer_restarted_on_other_blocks_withdraws_what_its_previous_run_announced(inprocess_swarm, tmp_path):
    """Killed, a peer leaves its records to expire; restarted with the same identity on other blocks, its first
    announcement replaces them (one value per peer), so that no client routes or syncs its old blocks there."""
    swarm = inprocess_swarm()
    identity = str(tmp_path / "volunteer.key")
    swarm.start_peers({"b": "2:4"})
    first = swarm.add_peer("0:2", "first-run", identity=identity)
    first.kill()
    first.stop()  # its loop gone, its claim on the identity released (a crashed process's lock dies with it)
    again = swarm.add_peer("2:4", "second-run", identity=identity)
    deadline = time.monotonic() + FIRED
    while True:  # it serves before its first announcement as online reaches the DHT
        records = read_servers(again.daemon.dht, again.daemon.spec.name, again.daemon.spec.num_blocks)
        mine = {b: [r for r in found if r.peer_id == again.peer_id] for b, found in records.items()}
        online = {b for b, found in mine.items() if any(r.state == ServerState.ONLINE for r in found)}
        if {2, 3} <= online or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert online == {2, 3}, f"announced online: blocks {sorted(online)}"


def test_a_replica_that_found_a_holder_gone_dials_it_where_the_client_reaches_it(
    inprocess_swarm, tiny_models, tmp_path
):
    """Peer c computes every micro-batch; a and b fetch its partial sums at commit. Both found c gone at an address it
    no longer listens on, as after c restarted on another port (their own view of the swarm, which would tell them
    the new one, is not refreshed during the test). The commit request carries the client's addresses of the
    ledger's holders: they dial c there, and every step commits (without them, each fetch failed at once, the
    replays landed on c, which held the gradients already, and the commit ran out of rounds)."""
    swarm = inprocess_swarm()
    c = swarm.add_peer("0:4", "c")
    peers = swarm.start_peers({"a": "0:2", "b": "2:4"}, throughput=1.0, balance_interval=600.0)
    stale = [f"/ip4/127.0.0.1/tcp/9/p2p/{c.peer_id.to_base58()}"]
    for peer in peers.values():
        transport = peer.daemon.transport
        transport.addresses[c.peer_id] = stale
        transport.gone[c.peer_id] = time.time()
    train(swarm, tiny_models["llama"], tmp_path, "stale-address")
    for peer in peers.values():
        assert peer.daemon.transport.addresses[c.peer_id] != stale
    assert_matches_local_peft(tiny_models["llama"], tmp_path)
