"""A chain's output goes straight from its last peer to the client (issue 60, item 2), on real peers in this process:
three spans, and the hidden states a micro-batch's forward sends are counted where each party sends them. The
output does not travel back through the middle peers; training equals local peft's; and a last peer that dies
after computing its output (before its chain answers, or before the client collects) is routed around with no step
lost."""

from __future__ import annotations

import pytest
import torch

from swarm.client.calls import Recovery
from swarm.net.protocol import Method
from swarm.testing.faults import Action, Fault
from swarm.testing.recipe import MICRO_BATCHES, STEPS, assert_matches_local_peft, connect
from swarm.testing.recipe import train as train_steps

SPANS = {"a": "0:2", "b": "2:3", "c": "3:4"}
BATCH, LENGTH, HIDDEN = 2, 12, 64  # the recipe's micro-batches through the tiny model (fp32 on the wire)
HIDDEN_BYTES = BATCH * LENGTH * HIDDEN * 4
MASK_BYTES = BATCH * LENGTH * 8


def train(swarm, model_dir, out, adapter: str) -> tuple[dict[str, int], list[Recovery]]:
    """Train the recipe's steps through chains; the adapter before and after in ``out``. Returns the tensor bytes
    the client's requests carried, by method, and the failures it routed around."""
    model = connect(swarm, model_dir, adapter)
    try:
        model.save_adapter(out / "initial")
        train_steps(model, STEPS)
        model.save_adapter(out / "final")
        return dict(model.session.transport.sent), list(model.recoveries)
    finally:
        model.shutdown()


def forwards_sent(peer) -> tuple[int, int, int]:
    """(tensor bytes of the forwards a peer passed on, of its forward replies, of its collect replies)."""
    service, transport = peer.daemon.standing.parts.service, peer.daemon.transport
    return transport.sent[Method.FORWARD], service.replied[Method.FORWARD], service.replied[Method.COLLECT]


def test_the_output_goes_straight_to_the_client(inprocess_swarm, tiny_models, tmp_path):
    """a 0:2 -> b 2:3 -> c 3:4, every micro-batch chained: each hop passes hidden states and mask on once; c hands
    the output to the client's collect, and the forward replies along the chain carry acks only: 4 hidden-state
    transfers a micro-batch, not 6. The adapter equals local peft's."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers(SPANS)
    client, recoveries = train(swarm, tiny_models["llama"], tmp_path, "direct")
    assert recoveries == []
    forwards = STEPS * MICRO_BATCHES
    passed = forwards * (HIDDEN_BYTES + MASK_BYTES)
    assert client.get(Method.FORWARD) == passed
    assert forwards_sent(peers["a"]) == (passed, 0, 0)
    assert forwards_sent(peers["b"]) == (passed, 0, 0)
    assert forwards_sent(peers["c"]) == (0, 0, forwards * HIDDEN_BYTES)
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


@pytest.mark.parametrize("dies_at", [Method.FORWARD, Method.COLLECT])
def test_a_last_peer_that_dies_after_computing_is_routed_around(inprocess_swarm, tiny_models, tmp_path, dies_at):
    """c and d both serve 3:4. The first of them to compute an output dies right after it, before it answers: its
    chain (``forward``: b answers with its own output and the failure; the client goes on from block 3) or the
    client's collect (``collect``: the chain's acks came back, the output never does; the client sends the
    micro-batch again on a route without it). Training goes on, every step commits, and the adapter equals local
    peft's."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({**SPANS, "d": "3:4"})
    dies = Fault(Action.KILL, dies_at, when=lambda meta: dies_at == Method.COLLECT or meta["start"] == 3, after=True)
    for name in ("c", "d"):
        peers[name].faults.arm(dies)
    _, recoveries = train(swarm, tiny_models["llama"], tmp_path, f"dies-at-{dies_at}")
    assert dies.wait_fired(0) and peers["c"].killed != peers["d"].killed
    killed = peers["c"] if peers["c"].killed else peers["d"]
    assert any(r.peer == killed.peer_id and r.during == Method.FORWARD for r in recoveries), recoveries
    assert_matches_local_peft(tiny_models["llama"], tmp_path)


def test_a_large_output_comes_back_over_lanes_with_the_same_bits(inprocess_swarm, tiny_models):
    """An output past one lane's chunk (4 x 256 tokens of hidden 64 in fp32: 256 KiB) comes back to the collect over
    lanes, as it would in a forward's reply, and the logits are those of the same peers run hop by hop."""
    swarm = inprocess_swarm()
    peers = swarm.start_peers({"a": "0:2", "b": "2:4"})
    ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(5))
    logits = {}
    for chain in (True, False):
        model = connect(swarm, tiny_models["llama"], f"lanes-{chain}", chain=chain)
        try:
            with torch.no_grad():
                logits[chain] = model(ids).logits
            laned = model.session.transport.laned[Method.COLLECT]
        finally:
            model.shutdown()
        assert laned == int(chain)
    assert peers["b"].daemon.standing.parts.service.replied[Method.COLLECT] == 4 * 256 * HIDDEN * 4
    assert torch.equal(logits[True], logits[False])
