"""Tell this process's DHT node to skip a peer the transport found unresponsive.

A frozen peer (SIGSTOP, a laptop gone to sleep, a link cut without a reset) keeps its connections open, so every DHT
lookup that asks it waits hivemind's RPC timeout (3 s) before trying others; two frozen peers made a churn run's
takeover wait 6 s on its first announcement (BENCHMARKS.md). The transport knows first: a ``hello`` or ``info`` to
the peer timed out while its connection stayed open. hivemind's own blacklist then keeps the peer out of lookups for
a while, growing on each repeat, and clears it when the peer answers the DHT again."""

from __future__ import annotations

import logging
from functools import partial

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)


async def _blacklist(_dht: DHT, node: DHTNode, peer: PeerID) -> None:
    node.blacklist.register_failure(peer)


async def _blacklisted(_dht: DHT, node: DHTNode, peer: PeerID) -> bool:
    return peer in node.blacklist


def suspect(dht: DHT, peer: PeerID) -> None:
    """Have ``dht`` skip ``peer`` in its lookups for a while; returns at once (the DHT runs in its own process)."""
    if dht.is_alive():
        logger.debug("peer %s does not answer: DHT lookups skip it for a while", peer)
        dht.run_coroutine(partial(_blacklist, peer=peer), return_future=True)


def is_suspected(dht: DHT, peer: PeerID) -> bool:
    """Whether ``dht`` skips ``peer`` in its lookups now."""
    return dht.run_coroutine(partial(_blacklisted, peer=peer))
