"""DHT records: which peer serves which blocks, in what state, how fast, with which adapters at which step."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import TypeVar

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer

from swarm.net.addresses import only_relayed
from swarm.net.errors import DECODE_ERRORS
from swarm.net.numerics import EXACT, Numerics
from swarm.net.security import Identity, SwarmKey, SwarmKeyValidator, peer_id_of_owner

logger = logging.getLogger(__name__)
T = TypeVar("T")

RECORD_TTL = 30.0
RECOVERIES_KEPT = 5  # recent recoveries a trainer publishes with its committed step
MAX_MADDRS = 16
MAX_DIGESTS = 1024  # blocks one record may name digests of
MAX_ENTRIES = 64  # records one peer's announcement may hold (serving, joining, leaving blocks)
DIGEST_HEX = re.compile(r"[0-9a-f]{64}")
MAX_LINKS = 16  # next-hop peers one record may name a measured link to
MAX_PEER_ID_CHARS = 64
DHT_CALL_TIMEOUT = 30.0  # a DHT read or write slower than this is given up (a record it writes would have expired)


def settled(future: MPFuture[T], what: str, timeout: float = DHT_CALL_TIMEOUT) -> T:
    """The result of a call into the DHT's process, waited for at most ``timeout``: a DHT shut down meanwhile (a peer
    leaving, a test ending) never answers, and a thread left waiting on it forever keeps its process from exiting."""
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        hint = "is this process's DHT still running?"
        raise TimeoutError(f"the DHT did not {what} within {timeout:.0f}s ({hint})") from None


@dataclass(frozen=True)
class Link:
    """A peer's measured link to a peer that may be its next hop: round trip (s) and bandwidth (bytes/s) there."""

    rtt: float
    bandwidth: float


MAX_DISK_SPANS = 64  # runs of blocks on disk one record may name


@dataclass(frozen=True)
class MoveCost:
    """What a peer announces of what a move costs it: seconds to load a block whose weights are on its disk
    (``load``), seconds to download and load one that is not (``fetch``), and the runs of blocks on its disk
    (``on_disk``, as [start, stop) pairs). The balancer weighs a throughput move by the time it takes."""

    load: float
    fetch: float
    on_disk: tuple[tuple[int, int], ...] = ()

    def seconds(self, span: range, window: range) -> float:
        """How long moving from ``span`` to ``window`` takes: every block of ``window`` not in ``span`` loaded, from
        disk where it is there, else downloaded first."""
        new = [b for b in window if b not in span]
        present = sum(1 for b in new if any(start <= b < stop for start, stop in self.on_disk))
        return present * self.load + (len(new) - present) * self.fetch

    def to_wire(self) -> list:
        return [self.load, self.fetch, [list(run) for run in self.on_disk]]

    @classmethod
    def from_wire(cls, value: object) -> MoveCost:
        """Raises TypeError or ValueError on anything but [load, fetch, [[start, stop], ...]] with finite
        non-negative seconds and at most MAX_DISK_SPANS runs."""
        if not isinstance(value, list | tuple) or len(value) != 3:
            raise TypeError(f"a move cost is [load, fetch, runs], got {value!r}")
        load, fetch, runs = value
        if not isinstance(runs, list | tuple) or len(runs) > MAX_DISK_SPANS:
            raise TypeError(f"at most {MAX_DISK_SPANS} runs of blocks on disk")
        on_disk = []
        for run in runs:
            if not isinstance(run, list | tuple) or len(run) != 2 or not all(type(x) is int for x in run):
                raise TypeError(f"{run!r} is not [start, stop]")
            if not 0 <= run[0] < run[1]:
                raise ValueError(f"{run!r} is no run of blocks")
            on_disk.append((run[0], run[1]))
        return cls(_seconds(load), _seconds(fetch), tuple(on_disk))


def runs(blocks: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted blocks as [start, stop) runs: what a record says of a peer's disk in a few numbers."""
    found: list[list[int]] = []
    for block in sorted(set(blocks)):
        if found and found[-1][1] == block:
            found[-1][1] += 1
        else:
            found.append([block, block + 1])
    return tuple((start, stop) for start, stop in found)


def _seconds(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{value!r} is not a finite number of seconds")
    return float(value)


class ServerState(str, Enum):
    JOINING = "joining"
    ONLINE = "online"
    LEAVING = "leaving"


@dataclass
class ServerRecord:
    """One peer's announcement for one block."""

    peer_id: PeerID
    state: ServerState
    start: int
    end: int
    throughput: float
    adapters: dict[str, int] = field(default_factory=dict)
    moving_to: range | None = None  # an online peer about to hand these blocks over and serve this span instead
    announced_at: float = 0.0  # DHT time of the announcement: tells a peer that announced again after it was gone
    maddrs: list[str] = field(default_factory=list)  # where to dial it: direct, or through relays
    digests: dict[int, str] = field(default_factory=dict)  # block -> digest of its base weights (swarm/weights.py)
    max_blocks: int = 0  # how many blocks it may grow to, to serve orphaned ones (0: not said; its span)
    links: dict[PeerID, Link] = field(default_factory=dict)  # next-hop peer -> its link from here (peers/links.py)
    numerics: Numerics = EXACT  # how it computes, and each block's error at load (swarm/net/numerics.py)
    cost: MoveCost | None = None  # what a move costs it (None: not said; a move counts as free)
    home: range | None = None  # the span its operator told it (--blocks): no plan of others moves it
    max_tokens_in_flight: int = (
        0  # tokens of training micro-batches it admits between forward and backward (0: not said)
    )

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def conflicts(self, weights: dict[int, str]) -> bool:
        """Whether this peer serves (or is loading) some block with other weights than ``weights`` (a block pinned
        there and not announced here counts as other weights). Leaving records serve nothing and never conflict."""
        return self.state != ServerState.LEAVING and any(
            block in weights and self.digests.get(block) != weights[block] for block in self.blocks
        )

    @property
    def relayed(self) -> bool:
        """Reached only through relays (it sits behind NAT)."""
        return only_relayed(self.maddrs)

    def to_value(self) -> dict:
        value = {
            "state": self.state.value,
            "start": self.start,
            "end": self.end,
            "throughput": self.throughput,
            "adapters": self.adapters,
            "announced_at": self.announced_at,
            "maddrs": self.maddrs,
            "digests": write_digests(self.digests),
        }
        if self.moving_to is not None:
            value["moving_to"] = [self.moving_to.start, self.moving_to.stop]
        if self.max_blocks:
            value["max_blocks"] = self.max_blocks
        if self.links:
            value["links"] = write_links(self.links)
        if self.numerics != EXACT or self.numerics.errors:
            value["numerics"] = self.numerics.to_wire()
        if self.cost is not None:
            value["cost"] = self.cost.to_wire()
        if self.home is not None:
            value["home"] = [self.home.start, self.home.stop]
        if self.max_tokens_in_flight:
            value["max_tokens_in_flight"] = self.max_tokens_in_flight
        return value

    @classmethod
    def from_value(cls, peer_id: PeerID, value: object) -> ServerRecord | None:
        """Parse a record value; anything malformed is dropped (and logged), never trusted."""
        try:
            record = cls(
                peer_id=peer_id,
                state=ServerState(value["state"]),
                start=int(value["start"]),
                end=int(value["end"]),
                throughput=float(value["throughput"]),
                adapters={str(k): int(v) for k, v in dict(value.get("adapters", {})).items()},
                moving_to=range(*(int(x) for x in value["moving_to"])) if value.get("moving_to") else None,
                announced_at=float(value.get("announced_at", 0.0)),
                maddrs=_maddrs(value.get("maddrs", [])),
                digests=read_digests(value.get("digests", {})),
                max_blocks=int(value.get("max_blocks", 0)),
                links=read_links(value.get("links", {})),
                numerics=Numerics.from_wire(value["numerics"]) if "numerics" in value else EXACT,
                cost=MoveCost.from_wire(value["cost"]) if "cost" in value else None,
                home=range(*(int(x) for x in value["home"])) if value.get("home") else None,
                max_tokens_in_flight=max(0, int(value.get("max_tokens_in_flight", 0))),
            )
        except (TypeError, KeyError, ValueError, AttributeError):
            logger.debug("ignoring a malformed record from %s", peer_id)
            return None
        return record if 0 <= record.start < record.end else None


def _maddrs(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_MADDRS or not all(isinstance(m, str) for m in value):
        raise TypeError("maddrs must be a short list of strings")
    return list(value)


def write_links(links: dict[PeerID, Link]) -> dict[str, list[float]]:
    return {peer.to_base58(): [link.rtt, link.bandwidth] for peer, link in links.items()}


def _positive(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{value!r} is not a finite positive number")
    return float(value)


def read_links(value: object) -> dict[PeerID, Link]:
    """Measured links from a record; raises TypeError or ValueError on anything but a short map of peer id ->
    [rtt seconds, bytes/s], both finite and positive."""
    if not isinstance(value, dict) or len(value) > MAX_LINKS:
        raise TypeError(f"links must map at most {MAX_LINKS} peer ids -> [rtt, bandwidth]")
    links = {}
    for peer, link in value.items():
        if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_ID_CHARS:
            raise TypeError(f"link to {peer!r}: not a peer id")
        if not isinstance(link, list | tuple) or len(link) != 2:
            raise TypeError(f"link to {peer}: {link!r} is not [rtt, bandwidth]")
        links[PeerID.from_base58(peer)] = Link(*map(_positive, link))
    return links


def write_digests(digests: dict[int, str]) -> dict[str, str]:
    """Block digests as msgpack maps carry them (string keys)."""
    return {str(block): digest for block, digest in sorted(digests.items())}


def read_digests(value: object) -> dict[int, str]:
    """Block digests from a record; raises TypeError or ValueError on anything but block -> sha256 hex."""
    if not isinstance(value, dict) or len(value) > MAX_DIGESTS:
        raise TypeError("digests must be a short map of block -> sha256 hex")
    digests = {}
    for block, digest in value.items():
        if not isinstance(block, str) or not block.isdigit() or not isinstance(digest, str):
            raise TypeError(f"digest entry {block!r}: {digest!r} is not block -> sha256 hex")
        if not DIGEST_HEX.fullmatch(digest):
            raise ValueError(f"digest {digest!r} is not sha256 hex")
        digests[int(block)] = digest
    return digests


def servers_key(model: str) -> str:
    """Where every peer serving ``model`` announces itself: one subkey (and value) per peer."""
    return f"swarm:{model}:servers"


MODELS_KEY = "swarm:models"


def model_value(model: str, num_blocks: int) -> dict:
    """A peer's note that ``model`` (with ``num_blocks`` blocks) is served in this swarm, for ``swarm status``."""
    return {"kind": "model", "name": model, "num_blocks": num_blocks}


async def _store_model(_dht: DHT, node: DHTNode, owner: bytes, value: dict, ttl: float) -> None:
    await node.store(MODELS_KEY, value, get_dht_time() + ttl, subkey=owner)


def announce_model(dht: DHT, model: str, num_blocks: int, owner: bytes, ttl: float = RECORD_TTL):
    store = partial(_store_model, owner=owner, value=model_value(model, num_blocks), ttl=ttl)
    return settled(dht.run_coroutine(store, return_future=True), "store the model's record")


async def _read_models(_dht: DHT, node: DHTNode) -> dict[str, int]:
    found = await node.get(MODELS_KEY, latest=True)
    models: dict[str, int] = {}
    if found is not None and isinstance(found.value, dict):
        for item in found.value.values():
            value = item.value
            if (
                isinstance(value, dict)
                and isinstance(value.get("name"), str)
                and isinstance(value.get("num_blocks"), int)
            ):
                models[value["name"]] = value["num_blocks"]
    return models


def read_models(dht: DHT) -> dict[str, int]:
    """Models announced in the swarm and their number of blocks."""
    return settled(dht.run_coroutine(_read_models, return_future=True), "read the models")


async def _store(_dht: DHT, node: DHTNode, model: str, owner: bytes, value: dict, ttl: float) -> None:
    await node.store(servers_key(model), value, get_dht_time() + ttl, subkey=owner)


def announce(
    dht: DHT, model: str, owner: bytes, entries: list[tuple[ServerRecord, range]], ttl: float = RECORD_TTL
) -> None:
    """Write (or refresh) this peer's whole announcement: each record with the blocks it stands for, in one value
    under the model's servers key, as a subkey only its owner can sign (the owner marker), replacing what it
    announced before; it expires after ``ttl``. One value per peer, not one per block: a reader's look at a 30-block
    model fetched every block's key from every DHT node it asked, each value repeating the span's digests and the
    signature, ~200 KB a look on two peers, more than a step's compressed activations on a trainer's link."""
    store = partial(_store, model=model, owner=owner, value=announcement(entries, get_dht_time()), ttl=ttl)
    settled(dht.run_coroutine(store, return_future=True), "store this peer's records")


def announcement(entries: list[tuple[ServerRecord, range]], announced_at: float) -> dict:
    """A peer's announcement as the DHT holds it: each record with the blocks it stands for."""
    return {"kind": "servers", "entries": [entry_value(record, blocks, announced_at) for record, blocks in entries]}


def entry_value(record: ServerRecord, blocks: range, announced_at: float) -> dict:
    """One record of a peer's announcement and the blocks it stands for there."""
    return {**record.to_value(), "announced_at": announced_at, "blocks": [blocks.start, blocks.stop]}


def read_entries(peer_id: PeerID, value: object) -> list[tuple[ServerRecord, range]]:
    """A peer's announcement: its records and the blocks each stands for; raises TypeError or ValueError on a value
    of another shape, and leaves out a malformed record (logged)."""
    if not isinstance(value, dict) or value.get("kind") != "servers":
        raise TypeError("not a servers announcement")
    entries = value.get("entries")
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise TypeError(f"entries must be a list of at most {MAX_ENTRIES} records")
    out = []
    for item in entries:
        blocks = item.get("blocks") if isinstance(item, dict) else None
        if not isinstance(blocks, list) or len(blocks) != 2 or not all(type(b) is int for b in blocks):
            raise TypeError("each record names its blocks as [start, stop]")
        record = ServerRecord.from_value(peer_id, item)
        if record is not None:
            out.append((record, range(max(blocks[0], record.start), min(blocks[1], record.end))))
    return out


async def _read(_dht: DHT, node: DHTNode, model: str, num_blocks: int) -> dict[int, list[ServerRecord]]:
    found = await node.get(servers_key(model), sufficient_expiration_time=float("inf"))
    servers: dict[int, list[ServerRecord]] = {block: [] for block in range(num_blocks)}
    if found is None or not isinstance(found.value, dict):
        return servers
    for subkey, item in found.value.items():
        try:
            entries = read_entries(peer_id_of_owner(subkey), item.value)
        except (TypeError, ValueError):  # not a signed owner marker, or not an announcement: not ours
            continue
        for record, blocks in entries:
            for block in blocks:
                if block < num_blocks:
                    servers[block].append(record)
    return servers


def read_servers(dht: DHT, model: str, num_blocks: int) -> dict[int, list[ServerRecord]]:
    """Every live announcement, per block."""
    read = partial(_read, model=model, num_blocks=num_blocks)
    return settled(dht.run_coroutine(read, return_future=True), "read the servers' records")


# --- the adapter's committed step -------------------------------------------------------------------------------

COMMITTED_TTL = 30 * 24 * 3600.0  # the committed step must outlive the trainer and every peer that held it


def committed_key(model: str, adapter: str) -> str:
    return f"swarm:{model}:adapter:{adapter}:committed"


@dataclass(frozen=True)
class CommittedRecord:
    """What the trainer wrote after its last commit: the step every block of the adapter is at, and the adapter's
    identity (LoRA config and seed) and the digests of the base weights it trains on, so that a restarted client knows
    what to wait for and nobody trains it on a look-alike model (same folder name, other weights)."""

    step: int
    lora: dict
    seed: int
    trainer: str
    recoveries: list[dict] = field(default_factory=list)  # the last few failures routed around (for the monitor)
    steps_lost: int = 0  # updates lost so far (every copy of a block died)
    dishonest: list[str] = field(default_factory=list)  # peers the trainer banned: outvoted by their replicas
    weights: dict[int, str] = field(default_factory=dict)  # block -> the base weights' digest it was trained on

    def to_value(self) -> dict:
        return {
            "kind": "committed",
            "step": self.step,
            "lora": self.lora,
            "seed": self.seed,
            "trainer": self.trainer,
            "recoveries": self.recoveries,
            "steps_lost": self.steps_lost,
            "dishonest": self.dishonest,
            "weights": write_digests(self.weights),
        }

    @classmethod
    def from_value(cls, value: object) -> CommittedRecord | None:
        try:
            step, lora, seed, trainer = value["step"], value["lora"], value["seed"], value["trainer"]
        except (TypeError, KeyError):
            return None
        valid = isinstance(step, int) and step >= 0 and isinstance(seed, int) and isinstance(lora, dict)
        if not valid or not isinstance(trainer, str):
            return None
        recoveries = value.get("recoveries", [])
        recoveries = [r for r in recoveries if isinstance(r, dict)] if isinstance(recoveries, list) else []
        lost = value.get("steps_lost", 0)
        dishonest = value.get("dishonest", [])
        dishonest = [p for p in dishonest if isinstance(p, str)] if isinstance(dishonest, list) else []
        try:
            weights = read_digests(value.get("weights", {}))
        except (TypeError, ValueError):
            return None
        lost = lost if isinstance(lost, int) else 0
        return cls(step, lora, seed, trainer, recoveries[-RECOVERIES_KEPT:], lost, dishonest, weights)


def announce_committed(dht: DHT, model: str, adapter: str, owner: bytes, record: CommittedRecord):
    """Write the committed step (signed by the trainer); returns a future: a commit does not wait for the DHT."""
    key, value = committed_key(model, adapter), record.to_value()
    return dht.store(key, value, get_dht_time() + COMMITTED_TTL, subkey=owner, return_future=True)


def read_committed(dht: DHT, model: str, adapter: str) -> CommittedRecord | None:
    """The newest committed step any trainer of this adapter wrote, or None if none is known to this swarm."""
    found = settled(dht.get(committed_key(model, adapter), latest=True, return_future=True), "read the committed step")
    if found is None or not isinstance(found.value, dict):
        return None
    records = [CommittedRecord.from_value(item.value) for item in found.value.values()]
    return max((r for r in records if r is not None), key=lambda r: r.step, default=None)


class RecordSchemaValidator(RecordValidatorBase):
    """Every swarm record is owned (a signed owner-marker subkey) and has a known shape."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            peer_id_of_owner(subkey)
        except DECODE_ERRORS:
            return False
        return isinstance(value, dict) and valid_value(value)

    @property
    def priority(self) -> int:
        return 0


def valid_value(value: dict) -> bool:
    kind = value.get("kind")
    if kind == "servers":
        try:
            entries = read_entries(PeerID(b"\x00"), value)
        except (TypeError, ValueError):
            return False
        return len(entries) == len(value["entries"])
    if kind == "model":
        return isinstance(value.get("name"), str) and isinstance(value.get("num_blocks"), int)
    if kind == "committed":
        return CommittedRecord.from_value(value) is not None
    if kind == "lease":
        return (
            isinstance(value.get("trainer"), str)
            and isinstance(value.get("session"), str)
            and isinstance(value.get("released"), bool)
        )
    return False


def record_validators(identity: Identity, swarm_key: SwarmKey | None) -> list[RecordValidatorBase]:
    validators: list[RecordValidatorBase] = [RSASignatureValidator(identity.private_key), RecordSchemaValidator()]
    if swarm_key is not None:
        validators.append(SwarmKeyValidator(swarm_key))
    return validators
