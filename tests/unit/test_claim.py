"""One identity, one process: the lock a peer takes beside its identity file and in its checkpoint dir."""

from __future__ import annotations

import os

import pytest

from peers.claim import ProcessClaim, lock_path_of_checkpoints, lock_path_of_identity
from swarm.net.errors import IdentityInUseError
from swarm.net.security import Identity


def claim_of(identity: Identity, checkpoints) -> ProcessClaim:
    return ProcessClaim(identity.peer_id, [lock_path_of_identity(identity.path), lock_path_of_checkpoints(checkpoints)])


def test_a_second_claim_on_one_identity_is_refused_with_the_holders_pid_and_addresses(tmp_path):
    identity = Identity.load_or_create(tmp_path / "peer.key")
    first = claim_of(identity, tmp_path / "checkpoints")
    first.acquire()
    first.note_addresses(["/ip4/127.0.0.1/tcp/4242/p2p/x"])
    try:
        with pytest.raises(IdentityInUseError) as caught:
            claim_of(identity, tmp_path / "other-checkpoints").acquire()
        message = str(caught.value)
        assert str(identity.peer_id) in message and f"process {os.getpid()}" in message
        assert "/ip4/127.0.0.1/tcp/4242/p2p/x" in message and "--identity" in message
    finally:
        first.release()
    again = claim_of(identity, tmp_path / "checkpoints")
    again.acquire()  # released: a restarted peer takes its identity back
    again.release()


def test_a_shared_checkpoint_dir_is_refused_too_and_the_refused_claim_holds_nothing(tmp_path):
    one, other = Identity.load_or_create(tmp_path / "one.key"), Identity.load_or_create(tmp_path / "other.key")
    first = claim_of(one, tmp_path / "checkpoints")
    first.acquire()
    try:
        with pytest.raises(IdentityInUseError, match="still starting"):
            claim_of(other, tmp_path / "checkpoints").acquire()
        retry = claim_of(other, tmp_path / "own-checkpoints")
        retry.acquire()  # its identity lock was let go when it was refused
        retry.release()
    finally:
        first.release()
