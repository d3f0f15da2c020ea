"""Who is who and who is in: RSA identities that sign DHT records, and the swarm key of a private swarm.

- Every process has an RSA identity (its libp2p identity file). Its public key, as the owner marker in a
  record's subkey, both signs the record (hivemind's RSASignatureValidator) and *is* the peer id (the peer
  id is the hash of that key), so nobody can write or overwrite another peer's announcement.
- A private swarm shares a swarm key: DHT values are encrypted and authenticated with it (members reject
  anything else; outsiders read only ciphertext), and every RPC carries an HMAC made with it.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.net.errors import SwarmKeyError

KEY_BYTES = 32
OWNER_PREFIX, OWNER_SUFFIX = b"[owner:", b"]"


@dataclass(frozen=True)
class SwarmKey:
    """The shared secret of a private swarm."""

    secret: bytes

    @classmethod
    def load(cls, path: str | Path) -> SwarmKey:
        try:
            secret = bytes.fromhex(Path(path).read_text().strip())
        except FileNotFoundError:
            raise SwarmKeyError(f"swarm key file {path} does not exist; create it with `swarm keygen {path}`") from None
        except ValueError:
            raise SwarmKeyError(f"{path} is not a swarm key (expected hex written by `swarm keygen`)") from None
        if len(secret) != KEY_BYTES:
            raise SwarmKeyError(f"{path} holds {len(secret)} bytes, a swarm key has {KEY_BYTES}; regenerate it")
        return cls(secret)

    def _derive(self, purpose: str) -> bytes:
        return hmac.new(self.secret, purpose.encode(), hashlib.sha256).digest()

    @property
    def key_id(self) -> str:
        """A public name for the key: tells members apart from holders of another key, reveals nothing."""
        return self._derive("key-id").hex()[:16]

    def mac(self, *parts: bytes) -> bytes:
        h = hmac.new(self._derive("rpc"), digestmod=hashlib.sha256)
        for part in parts:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def encrypt(self, plaintext: bytes, associated: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + AESGCM(self._derive("dht")).encrypt(nonce, plaintext, associated)

    def decrypt(self, ciphertext: bytes, associated: bytes) -> bytes | None:
        try:
            return AESGCM(self._derive("dht")).decrypt(ciphertext[:12], ciphertext[12:], associated)
        except (InvalidTag, ValueError):
            return None


def keygen(path: str | Path) -> Path:
    """Write a new random swarm key (hex), readable by its owner only."""
    out = Path(path)
    if out.exists():
        raise SwarmKeyError(f"{out} exists; refusing to overwrite a swarm key")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return out


@dataclass
class Identity:
    """An RSA key that is both this process's libp2p identity and its record-signing key."""

    path: Path
    private_key: RSAPrivateKey

    @classmethod
    def load_or_create(cls, path: str | Path | None) -> Identity:
        """Load an identity file, creating it if needed; without a path, a fresh one in a temporary file, removed
        when the process exits (every client made one and left it behind)."""
        if path is None:
            directory = tempfile.mkdtemp(prefix="swarm-identity-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            path = Path(directory) / "identity.key"
        path = Path(path)
        if not path.exists():
            _create_identity(path)
        der = crypto_pb2.PrivateKey.FromString(path.read_bytes()).data
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": der})  # hivemind's own (un)pickling path for a DER key
        return cls(path, key)

    @property
    def owner(self) -> bytes:
        """The owner marker for subkeys: ``[owner:ssh-rsa ...]``."""
        return OWNER_PREFIX + self.private_key.get_public_key().to_bytes() + OWNER_SUFFIX

    @property
    def peer_id(self) -> PeerID:
        return peer_id_of_owner(self.owner)


def _create_identity(path: Path) -> None:
    """Write a new key at ``path`` unless one appears there meanwhile: two processes started together with one new
    identity file must end up with one key (the file's), not each with its own while the file keeps the last."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    P2P.generate_identity(str(temporary))
    try:
        os.link(temporary, path)  # atomic, and fails if the path exists
    except FileExistsError:
        pass
    finally:
        temporary.unlink()


def peer_id_of_owner(owner: bytes) -> PeerID:
    """The libp2p peer id of the RSA key in an owner marker (sha256 multihash of the protobuf public key)."""
    if not (isinstance(owner, bytes) and owner.startswith(OWNER_PREFIX) and owner.endswith(OWNER_SUFFIX)):
        raise ValueError("not an owner marker")
    try:
        public = RSAPublicKey.from_bytes(owner[len(OWNER_PREFIX) : -len(OWNER_SUFFIX)])._public_key
    except UnsupportedAlgorithm as e:
        raise ValueError(f"not an RSA owner marker: {e}") from None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest())


class SwarmKeyValidator(RecordValidatorBase):
    """Private swarms: values are AES-GCM encrypted with the swarm key; anything else is rejected."""

    def __init__(self, key: SwarmKey):
        self.key = key

    @staticmethod
    def _associated(record: DHTRecord) -> bytes:
        return record.key + b"|" + record.subkey

    def validate(self, record: DHTRecord) -> bool:
        return self.key.decrypt(record.value, self._associated(record)) is not None

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.key.encrypt(record.value, self._associated(record))

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.key.decrypt(record.value, self._associated(record)) or b""

    @property
    def priority(self) -> int:
        return 5  # between the signature (10, outermost) and the schema (0, innermost)
