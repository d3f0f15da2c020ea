"""Where a peer stands in the swarm now, shared by its daemon and the collaborators it is made of instead of each
reaching into the others: the span it serves, the one it loads, its state, speed, move cost, block digests and
addresses, and once its blocks are loaded the parts it runs. The loader (peers/spanloader.py) and the mover
(peers/mover.py) change it; the announcer (peers/announcer.py) tells it."""

from __future__ import annotations

from dataclasses import dataclass, field

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.compute import Compute
from peers.links import LinkProber
from peers.peer_client import PeerClient
from peers.pullers import RecentPullers
from peers.replication import Replicator
from peers.service import PeerService
from swarm.net.records import MoveCost, ServerState


@dataclass
class PeerParts:
    """What a peer runs once its blocks are loaded, made together so that nothing is half-built."""

    backend: SpanBackend  # the span's compute
    adapters: AdapterStore  # the adapters' state, which the compute runs on
    compute: Compute
    peers: PeerClient
    service: PeerService
    replicator: Replicator
    links: LinkProber
    pullers: RecentPullers  # who pulled copies of these blocks lately: told of each commit with the view's watchers


@dataclass
class Standing:
    """What a peer is now. ``serving`` is what it announces online; ``joining`` the span it loads (at its start, or a
    move's new blocks beside the ones it serves); ``moving_to`` a move's target once loaded, announced while it checks
    that the blocks it hands over stay covered."""

    serving: range = range(0)
    joining: range | None = None
    moving_to: range | None = None
    state: ServerState = ServerState.JOINING
    throughput: float = 0.0  # tokens/s through its span, as told or last measured
    cost: MoveCost | None = None  # what a move costs this peer (announced once it has loaded)
    digests: dict[int, str] = field(default_factory=dict)  # block -> digest of its base weights in this folder
    maddrs: list[str] = field(default_factory=list)  # where others dial this peer: direct, or through relays
    parts: PeerParts | None = None  # once its blocks are loaded

    def digests_of(self, blocks: range) -> dict[int, str]:
        """The digests of ``blocks`` that are known (a block whose shards are not here yet has none)."""
        return {block: self.digests[block] for block in blocks if block in self.digests}
