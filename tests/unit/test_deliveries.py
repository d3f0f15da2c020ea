"""Direct outputs on the peer's side (issue 60, item 2): a chain's last hop that is told a ``deliver`` token answers
the hop before it with its ack only and hands the output to the client's ``collect`` of that token, whichever comes
first; an unknown, expired or taken token is refused with what happened, and what a peer holds is bounded."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peers.compute import Compute
from peers.deliveries import Deliveries
from peers.service import PeerService
from swarm.net.chain import Delivery
from swarm.net.errors import ErrorKind, ReplyError, RequestError, UndeliveredError
from swarm.net.message import Message
from swarm.net.protocol import (
    PEER_STATE_ERRORS,
    CollectReply,
    CollectRequest,
    ForwardRequest,
    HiddenReply,
    Method,
    read_reply,
    read_request,
)
from swarm.net.wire import decode, encode

HIDDEN = torch.randn(2, 3, 8)


class Doubling:
    """A span that doubles its input: the service's chain logic without a model."""

    def forward(self, adapter, blocks, step, hidden, mask, micro_batch, autocast) -> torch.Tensor:
        return hidden * 2


def chain_end(token: str | None, hold: float = 5.0) -> ForwardRequest:
    deliver = None if token is None else Delivery(token, hold)
    return ForwardRequest(adapter="run", start=2, end=4, step=0, hidden=HIDDEN, micro_batch="mb", deliver=deliver)


def run_on_service(work, deliveries: Deliveries | None = None):
    """``work(service)`` on an event loop, with a service whose span doubles its input."""
    compute = Compute()
    service = PeerService(
        Doubling(), None, compute, info=None, peers=None, hooks=None, pullers=None, deliveries=deliveries
    )
    try:
        return asyncio.run(work(service))
    finally:
        compute.shutdown()


def through_the_wire(request, reply):
    """The reply as the caller reads it, after both went through encode and decode."""
    read_request(decode(encode(request.to_message())))
    return read_reply(request, decode(encode(reply.to_message())))


def test_the_chains_end_answers_with_its_ack_only_and_the_collect_gets_the_output_after():
    async def work(service):
        reply = await service.handlers[Method.FORWARD](chain_end("t1"))
        collected = await service.handlers[Method.COLLECT](CollectRequest(token="t1", wait=1.0))
        return reply, collected

    reply, collected = run_on_service(work)
    request = chain_end("t1")
    sent = through_the_wire(request, reply)
    assert sent.outputs is None and reply.to_message().tensors == [] and [a.blocks for a in sent.acks] == [range(2, 4)]
    assert torch.equal(through_the_wire(CollectRequest(token="t1", wait=1.0), collected).outputs, HIDDEN * 2)


def test_a_collect_that_arrives_first_waits_for_the_output():
    async def work(service):
        collect = asyncio.ensure_future(service.handlers[Method.COLLECT](CollectRequest(token="t2", wait=5.0)))
        await asyncio.sleep(0.05)
        assert not collect.done()
        reply = await service.handlers[Method.FORWARD](chain_end("t2"))
        return reply, await collect

    reply, collected = run_on_service(work)
    assert reply.outputs is None and torch.equal(collected.outputs, HIDDEN * 2)


def test_without_a_token_the_chains_end_answers_with_its_output_as_before():
    reply = run_on_service(lambda service: service.handlers[Method.FORWARD](chain_end(None)))
    assert torch.equal(reply.outputs, HIDDEN * 2)


def test_unknown_taken_and_expired_tokens_are_refused_with_what_happened():
    async def work(deliveries: Deliveries) -> None:
        with pytest.raises(UndeliveredError, match="within 0.1s"):
            await deliveries.collect(CollectRequest(token="never", wait=0.1))
        with pytest.raises(UndeliveredError, match="gave up"):  # and its output, if it comes late, is dropped
            await deliveries.collect(CollectRequest(token="never", wait=1.0))
        assert deliveries.offer("never", CollectReply(HIDDEN), 5.0) and not deliveries.held
        assert deliveries.offer("once", CollectReply(HIDDEN), 5.0)
        await deliveries.collect(CollectRequest(token="once", wait=1.0))
        with pytest.raises(UndeliveredError, match="taken"):
            await deliveries.collect(CollectRequest(token="once", wait=1.0))
        assert deliveries.offer("late", CollectReply(HIDDEN), 0.05)
        await asyncio.sleep(0.2)
        assert not deliveries.held
        with pytest.raises(UndeliveredError, match="without a collect"):
            await deliveries.collect(CollectRequest(token="late", wait=1.0))

    asyncio.run(work(Deliveries()))
    assert ErrorKind.UNDELIVERED in PEER_STATE_ERRORS  # the client treats it as the last hop lost


def test_past_its_bounds_a_peer_answers_along_the_chain_and_lets_the_oldest_waiting_collect_go():
    async def work(service):
        first = await service.handlers[Method.FORWARD](chain_end("held"))
        second = await service.handlers[Method.FORWARD](chain_end("over"))
        oldest = asyncio.ensure_future(service.deliveries.collect(CollectRequest(token="w", wait=5.0)))
        await asyncio.sleep(0.01)
        newer = asyncio.ensure_future(service.deliveries.collect(CollectRequest(token="w2", wait=5.0)))
        with pytest.raises(UndeliveredError, match="the oldest, is let go"):
            await oldest
        assert service.deliveries.offer("w2", CollectReply(HIDDEN), 5.0)
        assert torch.equal((await newer).outputs, HIDDEN) and not service.deliveries.waiting
        return first, second

    first, second = run_on_service(work, Deliveries(max_held=1, max_waiting=1))
    assert first.outputs is None and torch.equal(second.outputs, HIDDEN * 2)


@pytest.mark.parametrize("deliver", [["t"], ["", 1.0], ["t", 0], ["t", 1e9], ["t", True], [1, 1.0], "t"])
def test_a_malformed_delivery_is_refused(deliver):
    meta = {**chain_end("t").to_meta(), "deliver": deliver}
    with pytest.raises(RequestError, match="deliver"):
        read_request(Message(meta, [HIDDEN]))


def test_a_forward_reply_without_outputs_survives_the_wire_and_a_collect_needs_its_tensor():
    assert through_the_wire(chain_end("t"), HiddenReply(None)).outputs is None
    with pytest.raises(ReplyError, match="expected 1 tensors"):
        read_reply(CollectRequest(token="t", wait=1.0), Message({}, []))
