"""Announced addresses, relayed addresses and the byte form the P2P daemon dials (no processes started)."""

from __future__ import annotations

import pytest
from hivemind.utils.multiaddr import Multiaddr

from swarm.net.addresses import (
    _wire,
    is_loopback,
    is_relayed,
    parse_announce,
    public_ip_maddrs,
    relay_of,
    relayed_maddr,
)
from swarm.net.errors import UsageError
from swarm.net.records import ServerRecord, ServerState
from swarm.net.security import Identity
from swarm.net.transport import Transport

RELAY = Identity.load_or_create(None).peer_id
HOME = Identity.load_or_create(None).peer_id
RELAY_MADDR = f"/ip4/10.231.0.2/tcp/31337/p2p/{RELAY.to_base58()}"


def test_announce_addresses_are_checked():
    assert parse_announce(["/ip4/203.0.113.5/tcp/31337"]) == ["/ip4/203.0.113.5/tcp/31337"]
    with pytest.raises(UsageError, match="not a TCP multiaddr"):
        parse_announce(["203.0.113.5:31337"])
    with pytest.raises(UsageError, match="explicit TCP port"):
        parse_announce(["/ip4/203.0.113.5/tcp/0"])
    assert public_ip_maddrs("203.0.113.5", 31337) == ["/ip4/203.0.113.5/tcp/31337"]
    assert public_ip_maddrs("2001:db8::1", 31337) == ["/ip6/2001:db8::1/tcp/31337"]
    with pytest.raises(UsageError, match="fixed --port"):
        public_ip_maddrs("203.0.113.5", 0)
    with pytest.raises(UsageError, match="not an IPv4 or IPv6"):
        public_ip_maddrs("my-router", 31337)


def test_relayed_addresses_name_their_relay():
    relayed = relayed_maddr(RELAY_MADDR, HOME)
    assert relayed == f"{RELAY_MADDR}/p2p-circuit/p2p/{HOME.to_base58()}"
    assert is_relayed(relayed) and not is_relayed(RELAY_MADDR)
    assert relay_of(relayed) == (RELAY_MADDR, RELAY)
    assert is_loopback("/ip4/127.0.0.1/tcp/5/p2p/x") and not is_loopback(RELAY_MADDR)


def test_dialed_addresses_carry_peer_ids_as_plain_multihashes():
    """The daemon's control API parses /p2p/ values as multihashes; hivemind's own encoder writes CIDs."""
    wire = _wire(f"{RELAY_MADDR}/p2p-circuit").to_bytes()
    multihash = RELAY.to_bytes()
    assert multihash in wire and bytes([len(multihash)]) + multihash in wire
    assert b"\x01\x72" + multihash not in wire  # no CID prefix (version 1, libp2p-key)
    assert str(Multiaddr(wire)) == f"{RELAY_MADDR}/p2p-circuit"


def test_records_carry_addresses_and_the_transport_routes_nat_peers_through_their_relay():
    relayed = relayed_maddr(RELAY_MADDR, HOME)
    record = ServerRecord(HOME, ServerState.ONLINE, 0, 2, 1.0, maddrs=[relayed], announced_at=5.0)
    parsed = ServerRecord.from_value(HOME, record.to_value())
    assert parsed.maddrs == [relayed] and parsed.relayed
    assert ServerRecord.from_value(HOME, {**record.to_value(), "maddrs": "not a list"}) is None
    assert ServerRecord.from_value(HOME, {**record.to_value(), "maddrs": ["x"] * 17}) is None
    direct = ServerRecord(RELAY, ServerState.ONLINE, 2, 4, 1.0, maddrs=[RELAY_MADDR])
    assert not direct.relayed

    transport = Transport(p2p=None)
    transport.learn([record, direct])
    assert transport._relays(HOME) == [RELAY] and transport._relays(RELAY) == []
    assert transport.addresses[RELAY] == [RELAY_MADDR]
