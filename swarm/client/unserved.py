"""Telling peers that blocks have no live server, so that one of them takes them over now.

Peers look at the swarm every balance interval (5 s, jittered up to 7.5 s); a block whose every server died waits
that long for a peer to notice and move onto it. The client knows first: its request failed and no other server is
left. It sends every live peer an ``unserved`` notice; each holds its balance round at once, checks the swarm itself,
and the peer whose move the shared plan names takes the blocks over. A notice only hastens a look: a peer never moves
on the client's word, so a stranger's notices cost a round a second at most.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

from swarm.client.routing import Router
from swarm.net.errors import PEER_ERRORS, ReplyError
from swarm.net.protocol import UnservedRequest
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

NOTICE_EVERY = 2.0  # seconds between two notices for the same blocks: peers hold one early round a second at most
NOTICE_TIMEOUT = 2.0  # a peer that does not take a notice in this long is not waited for


class UnservedNotice:
    """Sends ``unserved`` notices for a model's blocks to every live peer, in the background, at most every
    ``every`` seconds for the same blocks."""

    def __init__(self, transport: Transport, router: Router, model: str, every: float = NOTICE_EVERY):
        self.transport, self.router, self.model, self.every = transport, router, model, every
        self.sent: dict[tuple[int, ...], float] = {}  # blocks -> when they were last told about
        self.notices = 0  # notices sent (to all live peers each)

    def send(self, blocks: list[int]) -> None:
        """Blocks ``blocks`` have no live server: tell every live peer, unless that was done in the last seconds."""
        key, now = tuple(sorted(set(blocks))), time.monotonic()
        if not key or now - self.sent.get(key, -self.every) < self.every:
            return
        self.sent = {k: t for k, t in self.sent.items() if now - t < self.every}
        self.sent[key] = now
        self.notices += 1
        request = UnservedRequest(model=self.model, blocks=list(key))
        peers = self.router.live_servers(eligible_only=False)
        logger.info("blocks %s have no live server: telling %d live peer(s) to look now", list(key), len(peers))
        for peer in peers:
            future: Future = RemoteExpertWorker.run_coroutine(
                self.transport.aask(peer, request, NOTICE_TIMEOUT), return_future=True
            )
            future.add_done_callback(self._log_failure)

    @staticmethod
    def _log_failure(future: Future) -> None:
        error = None if future.cancelled() else future.exception()
        if error is None:
            return
        if isinstance(error, (*PEER_ERRORS, ReplyError)):
            logger.debug("a peer did not take an unserved notice: %r", error)
        else:
            logger.error("sending an unserved notice failed: %r", error)
