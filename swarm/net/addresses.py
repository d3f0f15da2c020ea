"""Multiaddrs a peer announces and dials: parsing user input, relayed addresses, and dialing a peer at the
addresses from its own record, so reaching it never depends on libp2p's peer routing having found it."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.net.errors import MULTIADDR_ERRORS, TRANSPORT_ERRORS, UsageError

logger = logging.getLogger(__name__)

CIRCUIT = "p2p-circuit"
P2P_CODE = 0x01A5
DIAL_TIMEOUT = 10.0


def parse_announce(texts: list[str]) -> list[str]:
    """``--announce-maddrs``: each must be a multiaddr with an explicit TCP port, like /ip4/203.0.113.5/tcp/31337."""
    out = []
    for text in texts:
        try:
            maddr = Multiaddr(text)
            port = maddr.value_for_protocol("tcp")
        except MULTIADDR_ERRORS:
            raise UsageError(
                f"--announce-maddrs {text!r} is not a TCP multiaddr; expected one like /ip4/203.0.113.5/tcp/31337"
            ) from None
        if port in (None, "0"):
            raise UsageError(f"--announce-maddrs {text!r} needs an explicit TCP port (the one forwarded to you)")
        out.append(str(maddr))
    return out


def public_ip_maddrs(ip: str, port: int) -> list[str]:
    """``--public-ip IP``: announce IP with the listening port (which must then be fixed, not 0)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise UsageError(f"--public-ip {ip!r} is not an IPv4 or IPv6 address") from None
    if port == 0:
        raise UsageError("--public-ip needs a fixed --port (the port your router forwards to this machine)")
    return [f"/ip{address.version}/{address}/tcp/{port}"]


def relayed_maddr(relay: str, peer: PeerID) -> str:
    """The address of ``peer`` through the relay at ``relay`` (a relay's full multiaddr, /p2p/ id included)."""
    return f"{relay}/{CIRCUIT}/p2p/{peer.to_base58()}"


def peer_of(maddr: str) -> PeerID:
    """The peer id a multiaddr ends with (its last /p2p/ part)."""
    return PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))


def relay_of(maddr: str) -> tuple[str, PeerID]:
    """The relay's own multiaddr and peer id in a relayed address RELAY/p2p-circuit/p2p/PEER."""
    relay = maddr.split(f"/{CIRCUIT}", 1)[0]
    return relay, peer_of(relay)


def is_relayed(maddr: str) -> bool:
    return f"/{CIRCUIT}" in maddr


def only_relayed(maddrs: list[str]) -> bool:
    """A peer announcing only relayed addresses sits behind NAT: it is reached through its relays."""
    return bool(maddrs) and all(is_relayed(m) for m in maddrs)


def is_loopback(maddr: str) -> bool:
    """Whether ``maddr`` points at this machine's loopback (a local swarm)."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 2 or parts[0] not in ("ip4", "ip6"):
        return parts[:2] == ["dns", "localhost"]
    try:
        return ipaddress.ip_address(parts[1]).is_loopback
    except ValueError:
        return False


def _wire(text: str) -> Multiaddr:
    """A multiaddr in the byte form the P2P daemon parses: /p2p/ ids as plain multihashes. (hivemind's multiaddr
    writes them as CIDs, which the daemon's control API rejects: "length greater than remaining bytes".)"""
    out, parts, i = b"", text.strip("/").split("/"), 0
    while i < len(parts):
        name = parts[i]
        if name == "p2p":
            multihash = PeerID.from_base58(parts[i + 1]).to_bytes()
            out += _uvarint(P2P_CODE) + _uvarint(len(multihash)) + multihash
            i += 2
        elif name == CIRCUIT:
            out += Multiaddr(f"/{CIRCUIT}").to_bytes()
            i += 1
        else:
            out += Multiaddr(f"/{name}/{parts[i + 1]}").to_bytes()
            i += 2
    return Multiaddr(out)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _without_peer(maddr: str, peer: PeerID) -> str:
    """Drop a trailing /p2p/PEER: the daemon takes the peer id separately."""
    suffix = f"/p2p/{peer.to_base58()}"
    return maddr[: -len(suffix)] if maddr.endswith(suffix) else maddr


async def dial(p2p: P2P, peer: PeerID, maddrs: list[str], timeout: float = DIAL_TIMEOUT) -> None:
    """Connect the P2P daemon to ``peer`` at ``maddrs`` (direct or through a relay); raises if none works."""
    wire = [_wire(_without_peer(m, peer)) for m in maddrs]
    await asyncio.wait_for(p2p._client.connect(peer, wire), timeout)  # hivemind has no public connect


async def hang_up(p2p: P2P, peer: PeerID) -> None:
    try:
        await p2p._client.disconnect(peer)
    except TRANSPORT_ERRORS as e:  # already gone: nothing to hang up
        logger.debug("hanging up on %s: %s", peer, e)
