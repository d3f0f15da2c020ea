"""A peer's bound on tokens in flight (issue 57): training micro-batches forwarded to it whose backward has not run.
The client keeps within the bounds peers announce; a forward past a peer's bound is refused with its own kind and
the run goes on through another replica, equal to local peft (promise 1), the peer never holding more."""

from __future__ import annotations

import time

import swarm
from swarm.net.protocol import Method, method_of
from swarm.testing.faults import CallTap
from swarm.testing.recipe import (
    HPARAMS,
    MAX_GRAD_NORM,
    MICRO_BATCHES,
    STEPS,
    assert_matches_local_peft,
    batches_for_step,
    connect,
    train,
)

ONE = 2 * 12  # tokens of one of the recipe's micro-batches


def test_the_client_keeps_within_the_bound_a_peer_announces(inprocess_swarm, tiny_models, tmp_path):
    """One peer admitting one micro-batch at a time: ``train_step`` left to choose how many to send at once sends
    them one by one (nothing refused, nothing routed around), and the run equals local peft."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    peer = local.add_peer("0:4", "tight", max_tokens_in_flight=ONE)
    model = connect(local, model_dir, "within-bound")
    try:
        model.save_adapter(tmp_path / "initial")
        assert model.in_flight(ONE) == 1
        assert model.in_flight() >= 4  # micro-batches of unknown size: the count alone
        optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
        while model.step < STEPS:
            model.train_step(batches_for_step(model.step), MICRO_BATCHES)
            model.clip_grad_norm_(MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad()
        model.save_adapter(tmp_path / "final")
        assert model.recoveries == [], model.recoveries
    finally:
        model.shutdown()
    assert peer.adapters.in_flight_tokens.peak == ONE
    assert_matches_local_peft(model_dir, tmp_path)


def test_a_forward_past_the_bound_is_refused_and_the_run_goes_on(inprocess_swarm, tiny_models, tmp_path):
    """Two replicas; the faster one admits one micro-batch. The client, told to keep both micro-batches of a step in
    flight, sends both there (backwards held back a second, so both forwards come first): the second is refused
    with ``tokens_in_flight``, goes to the other replica, and the step commits over both, equal to local peft."""
    model_dir = tiny_models["llama"]
    local = inprocess_swarm()
    tight = local.add_peer("0:4", "tight", max_tokens_in_flight=ONE, throughput=1e9)
    local.add_peer("0:4", "roomy", throughput=1.0)
    tap = CallTap()

    def backwards_later(peer, message, send):
        if method_of(message.meta) == Method.BACKWARD:
            time.sleep(1.0)
        return send(message)

    model = connect(local, model_dir, "past-bound", call_hook=tap)
    try:
        model.save_adapter(tmp_path / "initial")
        tap.arm(backwards_later)
        train(model, pipelined=True)
        model.save_adapter(tmp_path / "final")
        refusals = [r for r in model.recoveries if "tokens_in_flight" in r.reason]
    finally:
        model.shutdown()
    assert refusals, model.recoveries
    assert all(r.peer == tight.peer_id for r in refusals)
    assert tight.adapters.in_flight_tokens.peak == ONE
    assert_matches_local_peft(model_dir, tmp_path)
