"""swarm.net.security's SwarmKey: what a private swarm seals cannot be read, nor opened under another name or key."""

from __future__ import annotations

import os

from hivemind.utils.serializer import MSGPackSerializer

from swarm.net.security import SwarmKey


def test_sealed_values_do_not_contain_the_plaintext():
    key = SwarmKey(os.urandom(32))
    plaintext = MSGPackSerializer.dumps({"kind": "server", "state": "online"})
    sealed = key.encrypt(plaintext, b"k|s")
    assert b"online" not in sealed and key.decrypt(sealed, b"k|s") == plaintext
    assert key.decrypt(sealed, b"k|other") is None and SwarmKey(os.urandom(32)).decrypt(sealed, b"k|s") is None
