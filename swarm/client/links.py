"""What a hop's transfer costs, from the links peers announce (peers/links.py measures them): the seconds for a
micro-batch's activations to pass from one peer to the next, for the router's fastest chain (swarm/client/paths.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from swarm.net.records import ServerRecord


@dataclass(frozen=True)
class LinkCosts:
    """``into``: peer -> the peer before it -> seconds over the link between them, where that one measured it;
    ``default``: seconds over any other link (the client's own included)."""

    into: dict[PeerID, dict[PeerID, float]]
    default: float


def link_costs(records: Iterable[ServerRecord], activation_bytes: float, hop_seconds: float) -> LinkCosts:
    """A measured link costs half its round trip plus ``activation_bytes`` at its bandwidth. One nobody measured
    costs what the swarm's median measured link does (a measured link is no worse for being known), and
    ``hop_seconds`` where nobody measured any (every hop then costs the same, as before links were measured)."""
    newest: dict[PeerID, ServerRecord] = {}
    for record in records:
        if record.peer_id not in newest or record.announced_at > newest[record.peer_id].announced_at:
            newest[record.peer_id] = record
    into: dict[PeerID, dict[PeerID, float]] = {}
    for sender, record in newest.items():
        for receiver, link in record.links.items():
            into.setdefault(receiver, {})[sender] = link.rtt / 2 + activation_bytes / link.bandwidth
    measured = [seconds for senders in into.values() for seconds in senders.values()]
    return LinkCosts(into, statistics.median(measured) if measured else hop_seconds)
