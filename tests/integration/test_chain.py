"""Chains on real peers in this process, with faults injected at chosen calls: a peer dying in the middle of a
forward or a backward chain is routed around from the last hop that still holds its result (the spans before are
not recomputed), a hop that cannot reach the next one falls back to the client, the peers' kept inputs are bounded
with a clear refusal, and whatever fails, the adapter equals local peft trained on the same data."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.net.errors import ErrorKind, RemoteError
from swarm.net.protocol import Method, method_of
from swarm.testing.faults import Action, CallTap, Fault
from swarm.testing.parity import client_requests
from swarm.testing.recipe import MICRO_BATCHES, STEPS, assert_matches_local_peft, batches_for_step, connect
from swarm.testing.recipe import train as train_steps


def train(swarm, model_dir, out, adapter: str, **client) -> list[dict]:
    """Train the recipe's steps through chains; the adapter before and after in ``out``; the client's requests."""
    tap = CallTap()
    model = connect(swarm, model_dir, adapter, call_hook=tap, **client)
    try:
        sent = client_requests(tap)
        model.save_adapter(out / "initial")
        train_steps(model, STEPS)
        model.save_adapter(out / "final")
    finally:
        model.shutdown()
    return sent


def test_a_peer_killed_in_a_forward_chain_is_routed_around_from_the_hop_before(inprocess_swarm, tiny_models, tmp_path):
    """b and c both serve 2:4. The first forward that reaches either of them from a kills it before it computes: a
    answers the client with its own output and the failure, and the client goes on from block 2 on the survivor.
    a never computes that micro-batch again, and the adapter equals local peft's."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "2:4", "c": "2:4"})
    dies = Fault(Action.KILL, Method.FORWARD, when=lambda meta: meta["start"] == 2)
    for name in ("b", "c"):
        peers[name].faults.arm(dies)
    sent = train(swarm, tiny_models["llama"], tmp_path, "forward-broken")
    assert dies.wait_fired(0) and peers["b"].killed != peers["c"].killed
    # one forward per micro-batch on a: the chain's break did not make the client send the first span again
    assert peers["a"].faults.calls[Method.FORWARD] == STEPS * MICRO_BATCHES
    forwards = [meta for meta in sent if method_of(meta) == Method.FORWARD]
    assert [meta["start"] for meta in forwards].count(2) == 1, "the client re-entered the chain more than once"
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_peer_killed_in_a_backward_chain_leaves_the_rest_to_a_replica(inprocess_swarm, tiny_models, tmp_path):
    """a and b serve 0:2, c serves 2:4. The first backward c hands on kills its receiver: c answers with the
    gradient of its input, the client runs the rest on the other replica of 0:2 from the input it holds, and the
    gradients that died with the peer are replayed at commit: the adapter equals local peft's."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "0:2", "c": "2:4"})
    dies = Fault(Action.KILL, Method.BACKWARD, nth=2, when=lambda meta: meta["start"] == 0)
    for name in ("a", "b"):
        peers[name].faults.arm(dies)
    sent = train(swarm, tiny_models["llama"], tmp_path, "backward-broken")
    assert dies.wait_fired(0) and peers["a"].killed != peers["b"].killed
    backwards = [meta for meta in sent if method_of(meta) == Method.BACKWARD]
    assert any(meta["start"] == 0 and not meta["route"] for meta in backwards), "the client did not take over"
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_hop_that_cannot_reach_the_next_falls_back_to_the_client(inprocess_swarm, tiny_models, tmp_path):
    """a cannot connect to b (as from behind a NAT that b cannot be dialed through): each chain breaks after a with
    'unreachable', and the client, which can reach b, sends to b itself. b is not banned for it, every step
    commits, and the adapter equals local peft's."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "2:4"})
    a_transport = peers["a"].daemon.transport
    a_transport.gone[peers["b"].peer_id] = time.time() + 3600  # a's calls to b fail at once, for this whole test
    sent = train(swarm, tiny_models["llama"], tmp_path, "unreachable")
    forwards = [meta for meta in sent if method_of(meta) == Method.FORWARD]
    assert [meta["start"] for meta in forwards] == [0, 2] * (STEPS * MICRO_BATCHES)
    assert peers["b"].faults.calls[Method.FORWARD] == STEPS * MICRO_BATCHES
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


@pytest.mark.parametrize("chain", [True, False], ids=["chained", "client-driven"])
def test_kept_inputs_past_their_bound_are_refused_with_what_to_do(inprocess_swarm, tiny_models, chain):
    """A peer keeps the step's span inputs in host memory up to --kept-inputs-mb (here none: 0); a training forward
    past it is refused with a message that names the flag and what to change, whether it came from the client or
    from the hop before, and the peer serves on: an evaluation, which keeps nothing, runs."""
    swarm = inprocess_swarm()
    swarm.add_peer("0:2", "a")
    small = swarm.add_peer("2:4", "small", kept_inputs_mb=0)
    batch = batches_for_step(0)[0]
    model = connect(swarm, tiny_models["llama"], f"kept-{'chained' if chain else 'hops'}", chain=chain)
    try:
        with pytest.raises(RemoteError, match="--kept-inputs-mb") as refused:
            model(**batch)
        assert refused.value.kind == ErrorKind.KEPT_INPUTS_FULL
        with torch.no_grad():
            logits = model(batch["input_ids"]).logits
        assert logits.shape[:2] == batch["input_ids"].shape and small.alive
    finally:
        model.shutdown()
