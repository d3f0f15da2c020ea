"""Gradient hashes: canonical (stable, in the parameter order, bit-exact), carried by backward acks, kept by the
ledger and sent with commits, read strictly; a bad_gradients refusal names the holders."""

from __future__ import annotations

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.client.ledger import StepLedger
from swarm.net import protocol
from swarm.net.chain import HopAck, read_acks, write_acks
from swarm.net.errors import BadGradientsError, ErrorKind, RemoteError, RequestError
from swarm.net.gradhash import grad_hash
from swarm.net.message import Message
from swarm.net.protocol import Held, ReplyError, read_request
from swarm.net.wire import decode, encode

PEER, OTHER = PeerID(b"p" * 8), PeerID(b"q" * 8)
HPARAMS = protocol.OptimizerHParams(1e-3, (0.9, 0.999), 1e-8, 0.01)


def _grads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=generator), torch.randn(8, 4, generator=generator)]


def test_the_hash_is_stable_ordered_and_bit_exact():
    grads = _grads()
    assert grad_hash(grads) == grad_hash([g.clone() for g in grads])  # the values, not the objects
    assert grad_hash(grads) == grad_hash([g.t().contiguous().t() for g in grads])  # nor their memory layout
    assert grad_hash(grads) != grad_hash(grads[::-1])  # the parameter order is part of it
    one_ulp = grads[0].clone()
    one_ulp[1, 2] = torch.nextafter(one_ulp[1, 2], torch.tensor(float("inf")))
    assert grad_hash([one_ulp, grads[1]]) != grad_hash(grads)
    assert grad_hash([grads[0].reshape(8, 4), grads[1]]) != grad_hash(grads)  # the shape
    assert grad_hash([g.double() for g in grads]) != grad_hash(grads)  # the dtype
    assert grad_hash([g.bfloat16() for g in grads]) != grad_hash([g.half() for g in grads])
    assert grad_hash(grads[:1]) != grad_hash(grads)
    assert len(grad_hash([])) == 64


def test_acks_carry_each_blocks_hash_and_refuse_odd_ones():
    ack = HopAck(PEER.to_base58(), 2, 4, 0.5, (), ((2, grad_hash(_grads())), (3, "0" * 64)))
    wired = decode(encode(Message({"acks": write_acks([ack])}, []))).meta
    assert read_acks(wired, "acks") == [ack]
    assert read_acks({"acks": [[PEER.to_base58(), 2, 4, 0.5]]}, "acks")[0].hashes == ()  # before any backward
    twice = [[2, "0" * 64], [2, "1" * 64]]
    for hashes in ([[1, "0" * 64]], [[2, "0" * 63]], [[2, "A" * 64]], twice, [["2", "0" * 64]]):
        with pytest.raises(RequestError, match="acks"):
            read_acks({"acks": [[PEER.to_base58(), 2, 4, 0.5, [], hashes]]}, "acks")


def test_the_ledger_keeps_holder_and_hash_and_the_commit_carries_both():
    ledger = StepLedger(step=3, session="s")
    first, second = ledger.new_micro_batch(), ledger.new_micro_batch()
    ledger.acknowledge(first, range(0, 2), PEER, {0: "a" * 64, 1: "b" * 64})
    ledger.acknowledge(second, range(0, 1), OTHER, {0: "c" * 64})
    assert ledger.held_by(PEER) == {0: [first], 1: [first]} and ledger.held_by(OTHER) == {0: [second]}
    holders = ledger.wire_holders(range(0, 2))
    assert holders == {
        0: {first: Held(PEER.to_base58(), "a" * 64), second: Held(OTHER.to_base58(), "c" * 64)},
        1: {first: Held(PEER.to_base58(), "b" * 64)},
    }
    request = protocol.CommitRequest(adapter="run", step=3, ledger=holders, hparams=HPARAMS)
    received = read_request(decode(encode(request.to_message())))
    assert received.ledger == holders and received.micro_batches() == {0: sorted([first, second]), 1: [first]}


def test_a_ledger_entry_is_a_peer_id_or_peer_and_hash_nothing_else():
    meta = protocol.CommitRequest(
        adapter="run", step=3, ledger={0: {"mb": Held(PEER.to_base58())}}, hparams=HPARAMS
    ).to_meta()
    assert read_request(Message(meta, [])).ledger == {0: {"mb": Held(PEER.to_base58())}}  # no hash: not checked
    for entry in ([PEER.to_base58()], [PEER.to_base58(), "xyz"], ["", "0" * 64], [PEER.to_base58(), "0" * 64, 1], 7):
        with pytest.raises(RequestError, match="ledger"):
            read_request(Message({**meta, "ledger": {"0": {"mb": entry}}}, []))


def test_a_bad_gradients_refusal_names_the_holders():
    refusal = protocol.refusal(BadGradientsError("mismatch", [PEER.to_base58(), OTHER.to_base58()]))
    error = pytest.raises(RemoteError, protocol.raise_if_error, decode(encode(refusal))).value
    assert error.kind == ErrorKind.BAD_GRADIENTS and protocol.bad_holders(error) == [PEER, OTHER]
    for holders in (None, [], [7], ["not a peer id!"]):
        with pytest.raises(ReplyError, match="bad_gradients"):
            protocol.bad_holders(RemoteError(ErrorKind.BAD_GRADIENTS, "x", {protocol.BAD_HOLDERS: holders}))
