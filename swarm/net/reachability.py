"""Can others dial this peer? Ask a bootstrap node to dial it back; if nobody can, serve through a relay.

A peer behind a home router can dial out but not be dialed. At start it asks a bootstrap node (``reachable``) to
dial it back from a separate P2P daemon of the bootstrap's own, at the addresses it would announce. If that fails,
it joins with libp2p's auto-relay, reserving a slot on the bootstrap nodes (which keeps its connection to them
open), makes sure a relay passes requests on to it, and announces its relayed address
(RELAY/p2p-circuit/p2p/PEER). Callers then hand requests for it to the relay, which passes them on over that
connection (swarm/transport.py); libp2p's own relayed connections are reset after 128 KiB in hivemind's p2pd.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import P2P, PeerID

from swarm.net.addresses import dial, hang_up, is_loopback, peer_of, relayed_maddr
from swarm.net.errors import MULTIADDR_ERRORS, PEER_ERRORS, TRANSPORT_ERRORS
from swarm.net.protocol import ReachableReply, ReachableRequest
from swarm.net.security import SwarmKey
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 8.0  # how long a bootstrap tries to dial a peer back
ASK_TIMEOUT = PROBE_TIMEOUT + 5.0
RELAY_TIMEOUT = 30.0  # how long a relayed peer waits for its reservation to work end to end


class ReachabilityProbe:
    """The bootstrap side of ``reachable``: dial the asking peer back, at the addresses it names, from a P2P daemon
    that shares no connection with it (a connection the peer opened itself would prove nothing)."""

    def __init__(self):
        self._p2p: P2P | None = None
        self._lock = asyncio.Lock()

    async def handle(self, request: ReachableRequest) -> ReachableReply:
        """Dial ``request.peer`` at the addresses it named (the schema checked them: 1 to MAX_MADDRS)."""
        p2p = await self._probe()
        try:
            await dial(p2p, request.peer, request.maddrs, PROBE_TIMEOUT)
            return ReachableReply(True)
        except (*TRANSPORT_ERRORS, *MULTIADDR_ERRORS) as e:
            return ReachableReply(False, str(e) or type(e).__name__)
        finally:
            await hang_up(p2p, request.peer)

    async def _probe(self) -> P2P:
        async with self._lock:
            if self._p2p is None:
                self._p2p = await P2P.create(auto_nat=False, nat_port_map=False, use_relay=False)
            return self._p2p

    async def shutdown(self) -> None:
        if self._p2p is not None:
            await self._p2p.shutdown()


async def _ask(transport: Transport, checker: str, question: ReachableRequest) -> ReachableReply | None:
    """Ask ``checker`` (``reachable``) about a peer: whether it can dial it at ``maddrs``, or will pass requests on
    to it (``relayed``); None if it did not answer."""
    try:
        reply = await transport.aask(peer_of(checker), question, ASK_TIMEOUT, direct=True)
    except (*PEER_ERRORS, *MULTIADDR_ERRORS) as e:
        logger.debug("%s did not answer a reachability check: %s", checker, e)
        return None
    if not reply.reachable:
        logger.debug("%s says it cannot reach %s: %s", checker, question, reply.why)
    return reply


async def check_direct(
    initial_peers: list[str], host: str, port: int, announce: list[str], swarm_key: SwarmKey | None
) -> bool | None:
    """Start a throwaway P2P daemon where this peer will listen, and ask the initial peers to dial it: True if one
    could, False if they answered but could not, None if none answered."""
    temp = await P2P.create(
        initial_peers=initial_peers,
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        announce_maddrs=announce or None,
        auto_nat=False,
        use_relay=False,
    )
    try:
        mine = [str(m) for m in await temp.get_visible_maddrs(latest=True)]
        mine = [m for m in mine if not is_loopback(m)] or mine
        transport = Transport(temp, swarm_key)
        question = ReachableRequest(peer=temp.peer_id, maddrs=mine)
        replies = [await _ask(transport, checker, question) for checker in initial_peers]
    finally:
        await temp.shutdown()
    if any(reply is not None and reply.reachable for reply in replies):
        return True
    return False if any(reply is not None for reply in replies) else None


async def verify_relayed(
    transport: Transport, relays: list[str], me: PeerID, timeout: float = RELAY_TIMEOUT
) -> list[str]:
    """This peer's addresses through the relays that work: each relay is asked whether it will pass requests on
    to this peer (it relays, and holds this peer's connection); keep asking until ``timeout``, as the connection
    may still be coming up, but not a relay that refused (``swarm dht --no-relay``)."""
    deadline, asking = time.monotonic() + timeout, list(relays)
    while True:
        question = ReachableRequest(peer=me, relayed=True)
        replies = {relay: await _ask(transport, relay, question) for relay in asking}
        working = [relayed_maddr(relay, me) for relay, reply in replies.items() if reply and reply.reachable]
        asking = [relay for relay, reply in replies.items() if reply is None or not reply.refused]
        for relay in replies.keys() - set(asking):
            logger.warning("%s refuses to relay: %s", relay, replies[relay].why)
        if working or not asking or time.monotonic() > deadline:
            return working
        await asyncio.sleep(1.0)


async def choose_relays(
    initial_peers: list[str],
    host: str,
    port: int,
    announce: list[str],
    relay: str,
    swarm_key: SwarmKey | None,
) -> list[str]:
    """The relays to serve through: none when others can dial this peer directly (``relay`` auto, the default),
    or when told so (never); all initial peers when this peer cannot be dialed, or when told so (always)."""
    if relay != "auto":
        return list(initial_peers) if relay == "always" else []
    if not announce and all(is_loopback(m) for m in initial_peers):
        return []  # a swarm on this machine: loopback always works
    direct = await check_direct(initial_peers, host, port, announce, swarm_key)
    if direct is None:
        logger.warning("no initial peer could check whether this peer is reachable; serving directly")
        return []
    if direct:
        logger.info("reachable from outside: serving directly")
        return []
    if announce:
        logger.warning(
            "the initial peers could not dial the announced addresses %s: check the port forward; serving "
            "directly as asked",
            " ".join(announce),
        )
        return []
    return list(initial_peers)
