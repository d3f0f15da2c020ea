"""A client's call hook as tests arm it (swarm/testing/faults.py ``CallTap``): hooks armed later see a request first,
each sends it on through those armed before it, and a disarmed one sees nothing more."""

from __future__ import annotations

from hivemind.p2p import PeerID

from swarm.net.message import Message
from swarm.testing.faults import CallTap

PEER = PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))


def test_hooks_armed_later_wrap_those_armed_before_and_disarmed_ones_are_skipped():
    tap, seen = CallTap(), []

    def named(name: str):
        def hook(peer, message, send):
            seen.append((name, peer, message.meta["method"]))
            return send(message)

        return hook

    first, second = tap.arm(named("first")), tap.arm(named("second"))
    reply = tap(PEER, Message({"method": "forward"}, []), lambda message: Message({"sent": message.meta}, []))
    assert reply.meta == {"sent": {"method": "forward"}}
    assert seen == [("second", PEER, "forward"), ("first", PEER, "forward")]
    tap.disarm(second)
    seen.clear()
    tap(PEER, Message({"method": "backward"}, []), lambda message: message)
    assert seen == [("first", PEER, "backward")]
    tap.disarm(first)
    assert tap(PEER, Message({"method": "norms"}, []), lambda message: message).meta == {"method": "norms"}
