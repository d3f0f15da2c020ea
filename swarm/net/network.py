"""Joining the swarm's DHT with the right identity, record validators and (for private swarms) key."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import psutil
from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from swarm.net.addresses import peer_of
from swarm.net.dhtstorage import compact_on_store
from swarm.net.errors import MULTIADDR_ERRORS, PEER_ERRORS, IdentityInUseError, SwarmAccessError
from swarm.net.protocol import HelloRequest
from swarm.net.records import record_validators
from swarm.net.security import Identity, SwarmKey
from swarm.net.transport import Transport

logger = logging.getLogger(__name__)

# Serve through the relays we name, at once: p2pd's autorelay otherwise waits for AutoNAT's verdict and then up
# to minutes for relay candidates. hivemind passes no such flags, so they ride on its reachability presets.
RELAYED = "swarm-relayed"
JOIN_BACKOFF_MAX = 10.0  # seconds between two tries of initial peers that did not answer
P2P.FORCE_REACHABILITY_MAPPING[RELAYED] = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}


ORPHAN_CHECK_EVERY = 1.0  # seconds between a DHT process's looks at whether the process that started it lives


class OwnedDHT(DHT):
    """hivemind's DHT, whose process (and the p2pd it runs) ends when the process that started it dies.

    hivemind's DHT process holds both ends of its pipe, so it never learns that its parent is gone: after a SIGKILL of
    the peer alone (the OOM killer's), it and its p2pd lived on with the peer's identity, and every restart of the
    peer was refused as a second process with that identity."""

    def __init__(self, *args, **kwargs):
        self._owner = os.getpid()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        threading.Thread(target=_end_with, args=(self._owner,), name="swarm-dht-owner", daemon=True).start()
        super().run()


def _end_with(owner: int) -> None:
    """In the DHT's process: once ``owner`` is no longer its parent, kill its own children (p2pd) and exit."""
    while os.getppid() == owner:
        time.sleep(ORPHAN_CHECK_EVERY)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(0)


def initial_peers_or_env(initial_peers: list[str] | None) -> list[str]:
    """``--initial-peers`` / ``initial_peers=``, else ``SWARM_INITIAL_PEERS`` (space or comma separated)."""
    if initial_peers:
        return list(initial_peers)
    return os.environ.get("SWARM_INITIAL_PEERS", "").replace(",", " ").split()


def load_swarm_key(path: str | Path | None) -> SwarmKey | None:
    return None if path is None else SwarmKey.load(path)


def join_dht(
    initial_peers: list[str],
    identity: Identity,
    swarm_key: SwarmKey | None,
    client_mode: bool = False,
    host: str = "0.0.0.0",
    port: int = 0,
    announce_maddrs: list[str] | None = None,
    relays: list[str] | None = None,
    join_timeout: float = 0.0,
    check_identity: bool = True,
) -> DHT:
    """A DHT node whose records are signed by ``identity`` and, in a private swarm, sealed with the key.

    ``announce_maddrs``: the only addresses to announce. ``relays``: this node cannot be dialed; it reserves a slot on
    these relays and is reached through them (and takes no part in storing DHT records, which needs dialing).
    ``join_timeout``: for so long, initial peers that do not answer are tried again, with backoff (a bootstrap node
    still starting, a link coming up), said once; then SwarmAccessError. ``check_identity``: ask hivemind whether a
    live peer has this identity (a caller that looked for itself passes False: the look costs a p2pd start)."""
    deadline, pause, said = time.monotonic() + join_timeout, 1.0, False
    while True:
        try:
            return _join_dht(
                initial_peers, identity, swarm_key, client_mode, host, port, announce_maddrs, relays, check_identity
            )
        except SwarmAccessError:
            if time.monotonic() + pause > deadline:
                raise
            if not said:
                logger.warning(
                    "none of the initial peers answered yet; trying again for up to %.0fs (%s)",
                    deadline - time.monotonic(),
                    " ".join(initial_peers),
                )
                said = True
            time.sleep(pause)
            pause = min(2 * pause, JOIN_BACKOFF_MAX)


def _join_dht(
    initial_peers: list[str],
    identity: Identity,
    swarm_key: SwarmKey | None,
    client_mode: bool,
    host: str,
    port: int,
    announce_maddrs: list[str] | None,
    relays: list[str] | None,
    check_identity: bool,
) -> DHT:
    compact_on_store()  # before the DHT process forks: its storage must not grow with every rewritten record
    kwargs: dict = {"check_if_identity_free": check_identity}
    if not client_mode:
        kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    if relays:
        kwargs.update(use_auto_relay=True, trusted_relays=relays, force_reachability=RELAYED)
    try:
        return OwnedDHT(
            initial_peers=initial_peers,
            client_mode=client_mode or bool(relays),
            identity_path=str(identity.path),
            record_validators=record_validators(identity, swarm_key),
            start=True,
            **kwargs,
        )
    except (P2PDaemonError, RuntimeError) as e:  # p2pd: "failed to connect to bootstrap peers"
        if "already taken" in str(e):  # hivemind found a live peer with this peer id through the initial peers
            raise IdentityInUseError(
                f"identity {identity.peer_id} ({identity.path}) is already in use by another process in the swarm"
            ) from None
        if "bootstrap peers" not in str(e):
            raise
        raise SwarmAccessError(
            f"none of the initial peers answered ({' '.join(initial_peers)}): check that `swarm dht` (or a peer) "
            "runs there and that its port is reachable from this machine"
        ) from None


async def check_access(transport: Transport, initial_peers: list[str], timeout: float = 10.0) -> None:
    """Ask the bootstrap peers ``hello``: a private swarm and a missing or different key give a clear error."""
    mine = None if transport.swarm_key is None else transport.swarm_key.key_id
    for maddr in initial_peers:
        try:
            peer = peer_of(maddr)
            reply = await transport.aask(peer, HelloRequest(), timeout)
        except (*PEER_ERRORS, *MULTIADDR_ERRORS) as e:
            logger.debug("no hello from %s: %s", maddr, e)
            continue
        if reply.private and mine is None:
            raise SwarmAccessError(f"{maddr} belongs to a private swarm: pass its swarm key (--swarm-key FILE)")
        if reply.private and reply.key_id != mine:
            raise SwarmAccessError(
                f"wrong swarm key: {maddr} belongs to the private swarm with key id {reply.key_id}, yours is {mine}"
            )
        if not reply.private and mine is not None:
            raise SwarmAccessError(f"{maddr} belongs to a public swarm; drop --swarm-key to join it")
        return
    logger.warning("none of the initial peers answered hello; continuing")
