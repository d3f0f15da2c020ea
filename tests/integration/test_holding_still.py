"""Issue 56: the swarm holds still. Two peers told their spans (``--blocks 0:2``, ``--blocks 2:4``) moved back and
forth for minutes while nothing was wrong: a peer answered ``info`` only once its compute thread got to it, behind
the forwards and backwards queued before, so under load a ping timed out, the other peer took the busy one for a
dead one and grew over its blocks. These tests hold that timing (a compute thread kept busy past the ping timeout,
the other peer looking every second) and the move itself (make before break: a client training through a peer that
grows and shrinks sees no recovery)."""

from __future__ import annotations

import asyncio
import time

from peers.orphans import CONFIRM_TIMEOUT
from swarm.net.view import PING_TIMEOUT
from swarm.testing.inprocess import InProcessPeer
from swarm.testing.recipe import assert_matches_local_peft, connect, train
from swarm.testing.tiny import make_tiny_model

BUSY = CONFIRM_TIMEOUT + 2 * PING_TIMEOUT  # longer than a round's ping and the second, patient look together
MAX_STEPS = 40  # steps the client trains at most while it waits for the moving peer to grow and shrink


def test_a_busy_peer_is_not_taken_for_a_dead_one(inprocess_swarm, tmp_path):
    model_dir = make_tiny_model(tmp_path / "still-model", layers=4, seed=1)
    local = inprocess_swarm(model=model_dir, rebalance=True, balance_interval=1.0)
    first = local.add_peer("0:2", "first")
    busy = local.add_peer("2:4", "busy")
    compute = busy.daemon.standing.parts.compute
    held = compute.executor.submit(time.sleep, BUSY)  # a queue of forwards, as under a trainer
    started = time.monotonic()
    seen = asyncio.run_coroutine_threadsafe(first.daemon._observe(), first._loop).result(30.0)
    assert busy.peer_id in seen.alive, "a peer whose compute thread is busy does not answer info within PING_TIMEOUT"
    assert time.monotonic() - started < BUSY, "the look ended after the compute thread was free again"
    held.result(BUSY + 30.0)
    time.sleep(2.0)  # rounds decided while it was busy have finished their moves by now
    assert first.daemon.moves.recent() == [], f"the idle peer moved: {first.daemon.moves.recent()}"
    assert busy.daemon.moves.recent() == []
    assert (first.daemon.standing.serving, busy.daemon.standing.serving) == (range(0, 2), range(2, 4))


def test_a_told_peer_takes_over_an_orphan_and_goes_back_once(inprocess_swarm, tmp_path):
    """The one reason a told peer leaves its span: blocks nobody serves. It grows over them, and once a server of
    them is back it returns to its span, one move each way, with the reason in its log and its info."""
    model_dir = make_tiny_model(tmp_path / "still-model", layers=4, seed=1)
    local = inprocess_swarm(model=model_dir, rebalance=True, balance_interval=1.0)
    first = local.add_peer("0:2", "first", max_blocks=4)
    second = local.add_peer("2:4", "second")
    second.kill()
    now = first.daemon.standing
    _wait_until(lambda: now.serving == range(0, 4), 90.0, "the told peer did not take the orphans over")
    local.add_peer("2:4", "back")
    _wait_until(lambda: now.serving == range(0, 2), 90.0, "the told peer did not go back to its span")
    time.sleep(5.0)  # a few more rounds: it stays
    moves = first.daemon.moves.recent()
    assert [(m.target_start, m.target_end) for m in moves] == [(0, 4), (0, 2)], moves
    assert "no other live server" in moves[0].reason and "back to its --blocks 0:2" in moves[1].reason


def test_training_through_a_peer_that_moves_sees_no_recovery(inprocess_swarm, tmp_path):
    """Make before break: a peer grows from 2:4 over 0:2 (served by another) and back while a client trains with
    pipelined micro-batches. Its moves keep the forwards of the blocks it keeps and drain the blocks it hands over,
    so the client sees neither a hole nor a refusal: no recovery, no replay, and the adapter of a run without moves."""
    model_dir = make_tiny_model(tmp_path / "still-model", layers=4, seed=1)
    local = inprocess_swarm(model=model_dir, balance_interval=0.5)
    local.add_peer("0:2", "first")
    local.add_peer("0:2", "first-b")
    local.add_peer("2:4", "steady")
    shuttle = Shuttle()
    shuttle.peer = local.add_peer("2:4", "mover", rebalance=True, plan=shuttle)
    mover = shuttle.peer
    model = connect(local, model_dir, "moving", patience=60.0)
    try:
        model.save_adapter(tmp_path / "initial")
        moves: list[tuple[int, int]] = []
        while model.step < MAX_STEPS and not ((0, 4) in moves and (2, 4) in moves):  # a shrink drains for a step
            train(model, steps=model.step + 2, pipelined=True)
            moves = [(m.target_start, m.target_end) for m in mover.daemon.moves.recent()]
        model.save_adapter(tmp_path / "final")
        assert model.recoveries == [], model.recoveries
        assert (0, 4) in moves and (2, 4) in moves, f"no grow and shrink in {model.step} steps: {moves}"
        steps = model.step
    finally:
        model.shutdown()
    assert_matches_local_peft(model_dir, tmp_path, steps=steps)


class Shuttle:
    """A plan hook that moves its peer between 2:4 and 0:4 at every round (the moves a confused balancer made)."""

    def __init__(self) -> None:
        self.peer: InProcessPeer | None = None

    def loading(self, blocks: range) -> None:
        pass

    def decided(self, target: range | None) -> range | None:
        serving = self.peer.daemon.standing.serving if self.peer is not None else range(2, 4)
        return range(0, 4) if serving == range(2, 4) else range(2, 4)


def _wait_until(condition, seconds: float, failure: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.2)
