"""One identity, one process, in two checks. A peer holds an exclusive lock beside its identity file (and in its
checkpoint dir) for as long as it runs, so that a second process started with them, at the same moment or later, stops
at once. And a peer whose identity file is from before this run looks at the swarm before joining
(``refuse_if_serving_elsewhere``): a copy of the file on another machine may be serving already.

The look at the swarm (does a process answer at the addresses this identity's records announce?) misses two processes
starting together on one machine, and two processes with one peer id are not one peer: requests for it reach either,
and commits fail round after round. The lock is the operating system's (``flock``): it dies with its process, however
that process ends, so a crashed peer never leaves a stale lock behind. The lock file names its holder (pid, host,
addresses) for the second one's error.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from hivemind.p2p import PeerID

from swarm.net.errors import IdentityInUseError
from swarm.net.network import join_dht
from swarm.net.records import read_servers
from swarm.net.security import Identity, SwarmKey
from swarm.net.transport import Transport
from swarm.spec import ModelSpec

HOLDER_WAIT = 2.0  # seconds a refused process waits for the lock's holder to write who it is (it does so at once)
IN_USE_HINT = "stop that peer first, or give this one its own --identity and --checkpoint-dir"


def lock_path_of_identity(identity: Path) -> Path:
    return identity.with_name(identity.name + ".lock")


def lock_path_of_checkpoints(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / ".peer.lock"


class ProcessClaim:
    """Exclusive locks on ``paths`` (created if needed), held until ``release`` or the end of the process."""

    def __init__(self, peer_id: PeerID, paths: list[Path]):
        self.peer_id, self.paths = peer_id, paths
        self._files: list[int] = []

    def acquire(self) -> None:
        """Take every lock, or raise IdentityInUseError naming the process that holds one (and take none)."""
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _wait_for_holder(fd)
                os.close(fd)
                self.release()
                raise IdentityInUseError(self._in_use_message(path, holder)) from None
            self._files.append(fd)
        self.note_addresses([])

    def note_addresses(self, maddrs: list[str]) -> None:
        """Write who holds the locks, for the error of a process that tries to take them."""
        holder = {"peer_id": self.peer_id.to_base58(), "pid": os.getpid(), "host": socket.gethostname()}
        text = json.dumps({**holder, "maddrs": maddrs}).encode()
        for fd in self._files:
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)  # closing the file releases its flock
        self._files = []

    def _in_use_message(self, path: Path, holder: dict) -> str:
        where = " ".join(holder.get("maddrs") or []) or "(still starting: no address announced yet)"
        process = f"process {holder.get('pid', '?')} on {holder.get('host', '?')}"
        return f"identity {self.peer_id} is already in use by {process} at {where} (lock {path}): {IN_USE_HINT}"


def _wait_for_holder(fd: int, patience: float = HOLDER_WAIT) -> dict:
    """The holder as it wrote itself in the lock file. A process that took the lock a moment ago writes who it is
    right after: wait that moment, so that the error names it, rather than "process ?"."""
    deadline = time.monotonic() + patience
    holder = _read_holder(fd)
    while "pid" not in holder and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = _read_holder(fd)
    return holder


def _read_holder(fd: int) -> dict:
    """What the holding process wrote in the lock file (empty if it had not written yet, or wrote garbage)."""
    try:
        value = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


async def refuse_if_serving_elsewhere(
    identity: Identity, spec: ModelSpec, initial_peers: list[str], swarm_key: SwarmKey | None
) -> None:
    """Stop before joining if a live process serves under ``identity``. hivemind's own check looks the peer id up in
    libp2p's routing table, which a node that just joined may not have filled yet (it let a copy of a serving peer's
    identity join); the swarm's records name the addresses to ask."""
    live, where = await serving_elsewhere(identity, spec, initial_peers, swarm_key)
    if live:
        raise IdentityInUseError(
            f"identity {identity.peer_id} ({identity.path}) is already in use by another process in the swarm, "
            f"{where}: {IN_USE_HINT}"
        )


async def serving_elsewhere(
    identity: Identity, spec: ModelSpec, initial_peers: list[str], swarm_key: SwarmKey | None
) -> tuple[bool, str]:
    """Whether a process with ``identity`` answers at the addresses its records announce, and where it serves
    (looked at through a throwaway identity: a node with this one would be taken for it). Records a crashed
    previous run left behind name addresses where nobody answers."""
    throwaway = Identity.load_or_create(None)
    dht = await asyncio.to_thread(join_dht, initial_peers, throwaway, swarm_key, client_mode=True)
    try:
        servers = await asyncio.to_thread(read_servers, dht, spec.name, spec.num_blocks)
        me = identity.peer_id
        mine = [r for records in servers.values() for r in records if r.peer_id == me]
        if not mine:
            return False, "which announces no blocks of this model"
        transport = Transport(await dht.replicate_p2p(), swarm_key)
        transport.learn(mine)
        live = await transport.answers(me)
    finally:
        dht.shutdown()
    spans = sorted({(r.start, r.end) for r in mine})
    maddrs = sorted({m for r in mine for m in r.maddrs})
    blocks = ", ".join(f"{a}:{b}" for a, b in spans)
    return live, f"serving blocks {blocks} of {spec.name} at {' '.join(maddrs) or 'an unannounced address'}"
