"""Which peers hold the adapter at which step: the one record that routing, calls and the replica set share."""

from __future__ import annotations

from hivemind.p2p import PeerID


class CurrentPeers(dict[PeerID, int]):
    """Peer -> the adapter step it was last seen holding, and the step this client works at.

    The router asks it who may serve (``eligible``), a failed call makes a peer unknown again (``forget``), and the
    replica set writes what peers answered. Made first and handed to all three, so none reaches through another.
    """

    def __init__(self, step: int, exact: bool):
        super().__init__()
        self.step = step
        self.exact = exact  # a trainer needs peers at its step; a reader takes its step or a later one

    def eligible(self, peer: PeerID) -> bool:
        step = self.get(peer)
        return step == self.step if self.exact else step is not None and step >= self.step

    def forget(self, peer: PeerID) -> None:
        """After a failure or refusal the peer's state is unknown: re-check it before it serves again."""
        self.pop(peer, None)
