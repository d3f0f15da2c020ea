"""A client on a home link and peers on links of their own, in network namespaces (swarm.testing.netlab): the home
scenario of scripts/bench_wan.py.

The client sits behind a home router whose uplink passes ``up_mbit`` and downlink ``down_mbit`` (tbf, shared by all
its connections, as one home link is). Every TCP connection it opens is redirected (nftables) to a transparent relay
on that router (swarm.testing.wanlink) that holds each byte half the round trip each way, so the client sees
``rtt_ms`` to every peer and to the bootstrap; netem does not exist on every kernel (not on ours). Each peer is a
public host of its own, capped at ``peer_mbit`` both ways; peers reach each other with no added delay. The bootstrap
has a host of its own, uncapped. ``shape(False)`` takes every cap and the delay off: the same swarm without its
links, for the compute bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from swarm.testing.localswarm import LocalSwarm
from swarm.testing.netlab import NetLab

logger = logging.getLogger(__name__)

RELAY_PORT = 7000  # on the home router, which runs nothing else


@dataclass(frozen=True)
class HomeLinks:
    """The client's rates up and down and its round trip to every peer; each peer's rate both ways."""

    up_mbit: float = 20.0
    down_mbit: float = 100.0
    rtt_ms: float = 50.0
    peer_mbit: float = 100.0

    def describe(self) -> str:
        return (
            f"client on a home link ({self.up_mbit:g} Mbit/s up, {self.down_mbit:g} Mbit/s down, {self.rtt_ms:g} ms "
            f"to every peer), peers on {self.peer_mbit:g} Mbit/s links (no delay between peers)"
        )


class HomeLab:
    """The hosts of the home scenario in ``lab``: ``dht``, ``peers`` (public), ``client`` (behind its router), and
    the relay on the router; use as a context manager so the relay stops also on failure (the lab removes the
    rest)."""

    def __init__(self, lab: NetLab, links: HomeLinks, peers: int, workdir: Path):
        self.lab, self.links, self.shaped = lab, links, False
        self.dht = lab.public("dht")
        self.peers = [lab.public(f"peer{index}") for index in range(peers)]
        self.client = lab.home("client")
        self._processes = LocalSwarm(workdir)
        try:
            relay_args = ["--rtt-ms", str(links.rtt_ms), "--mbit", "0", "--transparent", str(RELAY_PORT)]
            router = lab.hosts[f"{self.client.name}-router"]
            relay = self._processes.start_module("relay", "swarm.testing.wanlink", relay_args, prefix=router.command())
            relay.wait_for_line("relaying on", 60)
        except BaseException:
            self.close()
            raise

    def shape(self, on: bool) -> None:
        """The scenario's links (``on``), or none of them: no caps, no delay, for connections opened from now on
        (caps apply to open ones too)."""
        if on == self.shaped:
            return
        links, lab = self.links, self.lab
        if on:
            lab.cap(self.client, links.up_mbit)
            lab.cap_down(self.client, links.down_mbit)
            for peer in self.peers:
                lab.cap(peer, links.peer_mbit)
                lab.cap_down(peer, links.peer_mbit)
            lab.detour(self.client, RELAY_PORT)
        else:
            for host in (self.client, *self.peers):
                lab.uncap(host)
            lab.direct(self.client)
        self.shaped = on
        logger.info("links %s", links.describe() if on else "off: no caps, no delay")

    def close(self) -> None:
        self._processes.close()

    def __enter__(self) -> HomeLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
