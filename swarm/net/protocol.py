"""The wire protocol between clients and peers, in one place: method names, the request and reply schema of every
method (the registry ``METHODS``), the keys of refusals and relay envelopes, and shared constants. Both sides build
and read messages only through these classes, so a method or a field is named once.

A request that does not fit its schema is refused with a ``RequestError`` that says why; a reply that does not fit
raises ``ReplyError``, which callers count as the answering peer's failure.

The method table (who calls what) is in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
from hivemind.p2p import PeerID

from swarm.net.chain import (
    MAX_HOLD,
    TOKEN_CHARS,
    ChainFailure,
    ChainHop,
    Delivery,
    HopAck,
    read_acks,
    read_delivery,
    read_failure,
    read_route,
    write_acks,
    write_delivery,
    write_failure,
    write_route,
)
from swarm.net.compression import COMPRESSIONS
from swarm.net.deltas import DIGEST_BYTES, Delta
from swarm.net.errors import (
    BadGradientsError,
    ErrorKind,
    MissingGradientsError,
    PayloadTooLargeError,
    RemoteError,
    ReplyError,
    RequestError,
    SourceUnavailableError,
)
from swarm.net.gradhash import read_grad_hash
from swarm.net.message import Message


class Method:
    """Every method a peer answers."""

    HELLO = "hello"  # unauthenticated: public or private swarm, and the key id
    INFO = "info"  # what a peer serves and holds (the view's ping)
    PING = "ping"  # answered at once: a link's round trip (empty) or bandwidth (with a payload)
    OPEN = "open"  # open or claim an adapter; its steps per block
    FORWARD = "forward"
    BACKWARD = "backward"
    COMMIT = "commit"  # fetch the micro-batch gradients it lacks from other replicas, sum them, one AdamW update
    NORMS = "norms"  # fetch the micro-batch gradients it lacks, report each block's summed gradient norm (clipping)
    REVERT = "revert"  # take back a commit that reached this replica while others could not complete it yet
    GRADS = "grads"  # peer to peer: micro-batch gradients this peer holds
    EXPORT = "export"  # peer to peer: adapter + AdamW state of blocks (served or standby)
    SYNC = "sync"  # pull state from a current copy
    STATE = "state"  # LoRA tensors, for the client's adapter export
    DIGEST = "digest"  # hash of each block's state, to compare replicas
    TIEBREAK = "tiebreak"  # apply a commit's ledger to this peer's standby copies, report the digests, keep nothing
    FAST_FORWARD = "fast_forward"  # declare an older state current (steps lost, reported)
    COMMITTED = "committed"  # notice to standby holders: a step was applied
    UNSERVED = "unserved"  # notice from a client: blocks have no live server; look at the swarm now
    REPLICATE = "replicate"  # hold a copy of blocks' state at a step (durable ack)
    REACHABLE = "reachable"  # dial the asking peer back at the addresses it names (is it reachable from outside?)
    INFER = "infer"  # generation: new tokens through blocks, keys and values kept per session
    END_SESSION = "end_session"  # free a generation session's keys and values
    COLLECT = "collect"  # client to a chain's last hop: the chain's output, straight back (``Delivery``)


# Keys every message may carry, whatever its method: the method itself; a refusal's text and kind; the HMAC of a
# private swarm; and a relay envelope: ask the peer that receives it to pass it on to RELAY_TO, a peer behind NAT
# that keeps a connection to it (and give it RELAY_TIMEOUT seconds).
METHOD = "method"
ERROR = "error"
KIND = "kind"
AUTH = "auth"
RELAY_TO = "relay_to"
RELAY_TIMEOUT = "relay_timeout"
HAS_MASK = "has_mask"  # span requests: whether a mask follows the other tensors
DELTA = "delta"  # hidden states sent as a change since the sample's last pass: the delta's header (swarm.net.deltas)
HAS_HIDDEN = "has_hidden"  # a backward: whether the hidden states come first (else the peer uses its forward's)
MISSING = "missing"  # a missing_gradients refusal: block -> the micro-batches nobody could provide
SOURCE = "source"  # a source_unavailable refusal: the peer a sync could not pull from
BAD_HOLDERS = "bad_holders"  # a bad_gradients refusal: the peers whose gradients did not match their hashes
# A small request whose reply is large (a collect): the bytes it expects back, so that it travels as lanes
# (swarm/net/lanes.py) and its reply comes back spread over them, not on one stream's window.
REPLY_BYTES = "reply_bytes"

# Refusals that mean "this peer cannot serve this now", not "the request is wrong": the client goes elsewhere.
PEER_STATE_ERRORS = frozenset(
    {
        ErrorKind.STALE_STEP,
        ErrorKind.UNKNOWN_ADAPTER,
        ErrorKind.INTERNAL,
        ErrorKind.TOO_LARGE,
        ErrorKind.SESSION_LOST,
        ErrorKind.INFERENCE_MEMORY,
        ErrorKind.NOT_SERVED,
        ErrorKind.TOKENS_IN_FLIGHT,
        ErrorKind.UNDELIVERED,
    }
)
FETCH_TIMEOUT = 3.0  # how long a replica waits for another's gradients before the client replays them
# how long a client waits for a replica's commit beyond its usual time: the fetch of partial sums and the replays'
# fetch; in chunks (peers/reduction/scatter.py) a round more, the direct fetch of a block whose reducer failed
COMMIT_FLOOR = 2 * FETCH_TIMEOUT
CHUNKED_COMMIT_FLOOR = 3 * FETCH_TIMEOUT


def commit_floor(reducers: dict[int, list[str]]) -> float:
    """How long beyond its usual time a commit (or a norm) may take whose blocks ``reducers`` names reducers of."""
    return CHUNKED_COMMIT_FLOOR if reducers else COMMIT_FLOOR


SYNC_TIMEOUT = 60.0  # how long a state transfer between peers may take
MAX_MADDRS = 16  # addresses a reachability question may name
MAX_HOLDERS = 256  # peers a commit's ledger may name with their addresses
MAX_PING_BYTES = 1 << 20  # a ping's payload: enough to time a link, too little to load the node that answers


# --- reading fields: each reader takes (meta, key) and raises RequestError on a value of the wrong shape -------------

Reader = Callable[[dict, str], Any]

ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_adapter_name(name: object) -> str:
    """Adapter names become peft module keys and checkpoint folder names: letters, digits, '-' and '_' only."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise RequestError(f"adapter name {name!r}: use 1 to 64 letters, digits, '-' or '_'")
    return name


def adapter_name_from(text: str) -> str:
    """A valid adapter name made of ``text`` (a run label, a wire format's name): other characters become '-'."""
    return check_adapter_name(re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")[:64] or "adapter")


def read_adapter(meta: dict, key: str) -> str:
    return check_adapter_name(meta.get(key))


def read_session(meta: dict, key: str) -> str:
    session = meta.get(key)
    if not isinstance(session, str) or not SESSION_ID.fullmatch(session):
        raise RequestError(f"{key!r} must be 1 to 64 letters, digits, '-' or '_'")
    return session


def read_str(meta: dict, key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{key!r} must be a non-empty string")
    return value


def read_text(meta: dict, key: str) -> str:
    """A string that may be empty."""
    value = meta.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{key!r} must be a string")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_int(meta: dict, key: str) -> int:
    value = meta.get(key)
    if not _is_int(value) or value < 0:
        raise RequestError(f"{key!r} must be a non-negative integer")
    return value


def read_float(meta: dict, key: str) -> float:
    value = meta.get(key)
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise RequestError(f"{key!r} must be a finite number")
    return float(value)


def read_bool(meta: dict, key: str) -> bool:
    value = meta.get(key)
    if not isinstance(value, bool):
        raise RequestError(f"{key!r} must be true or false")
    return value


def flag(default: bool) -> Reader:
    """A boolean that may be left out (then ``default``)."""
    return lambda meta, key: default if meta.get(key) is None else read_bool(meta, key)


def optional(read: Reader) -> Reader:
    """``read``, or None when the key is absent or null."""
    return lambda meta, key: None if meta.get(key) is None else read(meta, key)


def read_sample(meta: dict, key: str) -> str:
    """A sample's identity for delta-coded hidden states (the client's hash of its tokens)."""
    value = meta.get(key)
    if not isinstance(value, str) or not 1 <= len(value) <= 64:
        raise RequestError(f"{key!r} must be a string of 1 to 64 characters")
    return value


def read_digest(meta: dict, key: str) -> bytes:
    value = meta.get(key)
    if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
        raise RequestError(f"{key!r} must be a {DIGEST_BYTES}-byte digest")
    return value


def read_dict(meta: dict, key: str) -> dict:
    value = meta.get(key)
    if not isinstance(value, dict):
        raise RequestError(f"{key!r} must be a map")
    return value


def read_list(meta: dict, key: str) -> list:
    value = meta.get(key)
    if not isinstance(value, list):
        raise RequestError(f"{key!r} must be a list")
    return value


def read_peer(meta: dict, key: str) -> PeerID:
    try:
        return PeerID.from_base58(read_str(meta, key))
    except ValueError:
        raise RequestError(f"{key!r} must be a base58 peer id") from None


def _block(key: object) -> int:
    """A block number as a map key: msgpack maps carry them as strings."""
    if _is_int(key) and key >= 0:
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise ValueError(f"{key!r} is not a block number")


def by_blocks(read_value: Callable[[object], Any], what: str) -> Reader:
    """A map block -> value, each value read by ``read_value`` (which raises ValueError or TypeError)."""

    def read(meta: dict, key: str) -> dict[int, Any]:
        values = read_dict(meta, key)
        try:
            return {_block(block): read_value(value) for block, value in values.items()}
        except (TypeError, ValueError) as e:
            raise RequestError(f"{key!r} must map block -> {what}: {e}") from None

    return read


def _step(value: object) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{value!r} is not a step")
    return value


def _strings(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{value!r} is not a list of strings")
    return value


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


read_steps = by_blocks(_step, "step")


def by_block(values: dict[int, object]) -> dict[str, object]:
    return {str(block): value for block, value in values.items()}


AUTOCAST_DTYPES = ("bfloat16", "float16")


def read_autocast(meta: dict, key: str) -> str:
    """The dtype a client's autocast computes in (a Trainer's ``bf16``/``fp16``); peers compute the span under it."""
    value = meta.get(key)
    if value not in AUTOCAST_DTYPES:
        raise RequestError(f"{key!r} must be one of {list(AUTOCAST_DTYPES)} or absent, got {value!r}")
    return value


def read_compression(meta: dict, key: str) -> str:
    """The reply compression a request asks for (the reply's dtype follows the request's tensors)."""
    compression = meta.get(key, "none")
    if compression not in COMPRESSIONS:
        raise RequestError(f"{key!r} must be one of {sorted(COMPRESSIONS)}, got {compression!r}")
    return compression


def _same(value: object) -> object:
    return value


def wire(read: Reader, write: Callable[[Any], object] = _same, **kwargs: Any) -> Any:
    """A dataclass field that travels as the meta key of its name: ``read`` checks it, ``write`` encodes it."""
    return field(metadata={"read": read, "write": write}, **kwargs)


def tensor(**kwargs: Any) -> Any:
    """A dataclass field that travels as one of the message's tensors (see the class's ``to_message``)."""
    return field(compare=False, **kwargs)


# --- the schema machinery -----------------------------------------------------------------------------------------


class Schema:
    """A request or reply. Its ``wire`` fields are the meta keys of their names; its ``tensor`` fields are the
    message's tensors, laid out by the class's ``to_message`` / ``from_message`` (a class without any sends none)."""

    def to_meta(self) -> dict:
        return {f.name: f.metadata["write"](getattr(self, f.name)) for f in fields(self) if "read" in f.metadata}

    @classmethod
    def read_meta(cls, meta: dict) -> dict[str, Any]:
        """The ``wire`` fields, read and checked."""
        if not isinstance(meta, dict):
            raise RequestError("metadata must be a map")
        return {f.name: f.metadata["read"](meta, f.name) for f in fields(cls) if "read" in f.metadata}

    @classmethod
    def from_meta(cls, meta: dict) -> Any:
        return cls(**cls.read_meta(meta))

    def to_message(self) -> Message:
        return Message(self.to_meta(), [])

    @classmethod
    def from_message(cls, message: Message) -> Any:
        return cls.from_meta(message.meta)


class Request(Schema):
    """A request names its method in the metadata."""

    method: ClassVar[str]

    def to_meta(self) -> dict:
        return {METHOD: self.method, **super().to_meta()}


class Reply(Schema):
    """What a peer answers to a request it served."""


def _expect(message: Message, counts: tuple[int, ...]) -> list[torch.Tensor]:
    if len(message.tensors) not in counts:
        raise RequestError(f"expected {' or '.join(map(str, counts))} tensors, got {len(message.tensors)}")
    return message.tensors


def _hidden_tensors(hidden: torch.Tensor | Delta) -> tuple[list[torch.Tensor], dict]:
    """The tensor that carries hidden states, and the meta that says how: a delta travels as its payload."""
    if isinstance(hidden, Delta):
        return [hidden.payload_tensor()], {DELTA: hidden.to_wire()}
    return [hidden], {}


def _read_hidden(message: Message, carried: torch.Tensor) -> torch.Tensor | Delta:
    """Hidden states as sent: a tensor, or a delta where the meta has its header."""
    if message.meta.get(DELTA) is None:
        return carried
    try:
        return Delta.from_wire(message.meta[DELTA], carried)
    except ValueError as e:
        raise RequestError(f"{DELTA!r}: {e}") from None


def _span_tensors(message: Message, leading: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Tensors of a span request: ``leading`` ones (hidden states, gradients), then the mask when ``has_mask``."""
    has_mask = flag(False)(message.meta, HAS_MASK)
    tensors = _expect(message, (leading + int(has_mask),))
    mask = tensors[-1] if has_mask else None
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise RequestError(f"attention_mask must be integer or bool, got {mask.dtype}")
    return tensors[:leading], mask


# --- hello, info, ping, reachable: any node -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HelloRequest(Request):
    """Who are you? Unauthenticated, so a newcomer tells 'private swarm' or 'wrong key' from other failures."""

    method: ClassVar[str] = Method.HELLO


@dataclass(frozen=True)
class HelloReply(Reply):
    private: bool = wire(read_bool)
    key_id: str | None = wire(optional(read_str), default=None)  # of the swarm key, when private


@dataclass(frozen=True, kw_only=True)
class InfoRequest(Request):
    method: ClassVar[str] = Method.INFO


def adapter_meta(lora: dict, seed: int) -> dict:
    """An adapter's identity as peers hold it, announce it in ``info`` and checkpoint it: LoRA config and init seed."""
    return {"lora": lora, "seed": seed}


def lora_and_seed(meta: dict) -> tuple[dict, int]:
    """The inverse of :func:`adapter_meta` (on a map it made, or ``info`` read and checked)."""
    return meta["lora"], meta["seed"]


@dataclass
class AdapterInfo:
    """What a live peer holds of one adapter: its config, served steps and standby copies per block."""

    meta: dict
    steps: dict[int, int]
    standby: dict[int, int]

    def step_of(self, block: int) -> int | None:
        return self.steps.get(block, self.standby.get(block))


def _adapters(value: object) -> AdapterInfo:
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not a map")
    return AdapterInfo(
        meta=adapter_meta(read_dict(value, "lora"), read_int(value, "seed")),
        steps=read_steps(value, "steps"),
        standby=read_steps(value, "standby"),
    )


def read_adapters(meta: dict, key: str) -> dict[str, AdapterInfo]:
    entries = read_dict(meta, key)
    try:
        return {check_adapter_name(name): _adapters(entry) for name, entry in entries.items()}
    except ValueError as e:  # RequestError is one
        raise RequestError(f"{key!r} must map adapter -> its lora, seed, steps and standby: {e}") from None


def write_adapters(adapters: dict[str, AdapterInfo]) -> dict:
    return {n: {**a.meta, "steps": by_block(a.steps), "standby": by_block(a.standby)} for n, a in adapters.items()}


def read_blocks(meta: dict, key: str) -> list[int]:
    try:
        return [_block(b) for b in read_list(meta, key)]
    except ValueError:
        raise RequestError(f"{key!r} must be a list of block numbers") from None


@dataclass(frozen=True)
class MemoryUse:
    """A peer's memory as it reports it: its process tree's resident bytes (daemon, DHT process, p2pd), what its
    machine has left of its total, and each bounded store's bytes in use against its bound (kept span inputs until a
    step commits, forward graphs cached for backward, generation sessions' keys and values), and the tokens in
    flight against theirs."""

    rss: int
    host_available: int
    host_total: int
    kept_inputs: int
    kept_inputs_max: int
    activation_cache: int
    activation_cache_max: int
    inference: int
    inference_max: int
    tokens_in_flight: int = 0  # of training micro-batches forwarded here, backward pending
    tokens_in_flight_max: int = 0  # its bound (--max-tokens-in-flight)


def read_memory(meta: dict, key: str) -> MemoryUse:
    value = read_dict(meta, key)
    names = [f.name for f in fields(MemoryUse)]
    try:
        return MemoryUse(**{name: read_int(value, name) for name in names})
    except RequestError as e:
        raise RequestError(f"{key!r} must map {', '.join(names)} to byte counts: {e}") from None


@dataclass(frozen=True)
class MoveEntry:
    """One move a peer made: when (unix time), from which span to which, and why (the rule and its numbers)."""

    at: float
    start: int
    end: int
    target_start: int
    target_end: int
    reason: str


MAX_MOVES = 64  # moves one info may list (a peer keeps its last hour's, at most this many)


def read_moves(meta: dict, key: str) -> list[MoveEntry]:
    """A peer's recent moves; none where the key is absent (a peer from before moves were told)."""
    if meta.get(key) is None:
        return []
    value = read_list(meta, key)
    if len(value) > MAX_MOVES or not all(isinstance(v, dict) for v in value):
        raise RequestError(f"{key!r} must be a list of at most {MAX_MOVES} moves")
    try:
        return [
            MoveEntry(
                read_float(v, "at"),
                read_int(v, "start"),
                read_int(v, "end"),
                read_int(v, "target_start"),
                read_int(v, "target_end"),
                read_text(v, "reason"),
            )
            for v in value
        ]
    except RequestError as e:
        raise RequestError(f"{key!r}: {e}") from None


@dataclass
class PeerInfo(Reply):
    """A peer's answer to ``info``: what it serves, the adapters it holds, the blocks it keeps on standby."""

    model: str = wire(read_text)
    start: int = wire(read_int)
    end: int = wire(read_int)
    state: str = wire(read_text)
    throughput: float = wire(read_float)
    adapters: dict[str, AdapterInfo] = wire(read_adapters, write_adapters)
    standby_blocks: list[int] = wire(read_blocks, list)
    weights: str = wire(read_text, default="")  # how the base weights are held, e.g. "nf4/bfloat16"
    memory: MemoryUse | None = wire(optional(read_memory), lambda m: None if m is None else asdict(m), default=None)
    moves: list[MoveEntry] = wire(read_moves, lambda ms: [asdict(m) for m in ms], default_factory=list)  # last hour

    def moves_within(self, seconds: float, now: float) -> list[MoveEntry]:
        return [m for m in self.moves if m.at >= now - seconds]


def read_maddrs(meta: dict, key: str) -> list[str]:
    maddrs = meta.get(key)
    if not isinstance(maddrs, list) or not 0 < len(maddrs) <= MAX_MADDRS or not all(isinstance(m, str) for m in maddrs):
        raise RequestError(f"{key!r} must be a list of 1 to {MAX_MADDRS} multiaddrs")
    return maddrs


@dataclass(frozen=True, kw_only=True)
class ReachableRequest(Request):
    """Can you dial ``peer`` back at ``maddrs``? Or, for a peer behind NAT (``relayed``): will you pass requests
    on to it?"""

    method: ClassVar[str] = Method.REACHABLE
    peer: PeerID = wire(read_peer, PeerID.to_base58)
    maddrs: list[str] | None = wire(optional(read_list), default=None)
    relayed: bool = wire(flag(False), default=False)

    @classmethod
    def from_meta(cls, meta: dict) -> ReachableRequest:
        request = cls(**cls.read_meta(meta))
        return request if request.relayed else cls(peer=request.peer, maddrs=read_maddrs(meta, "maddrs"))


@dataclass(frozen=True)
class ReachableReply(Reply):
    reachable: bool = wire(read_bool)
    why: str | None = wire(optional(read_text), default=None)
    refused: bool = wire(read_bool, default=False)  # a relay that relays for nobody: asking again changes nothing


@dataclass(frozen=True, kw_only=True)
class PingRequest(Request):
    """Answered at once on the event loop, never behind compute: timed empty it is a link's round trip, timed with
    ``payload`` (bytes, at most ``MAX_PING_BYTES``) it tells how fast activations reach this node. Tensors:
    [payload?]."""

    method: ClassVar[str] = Method.PING
    payload: torch.Tensor | None = tensor(default=None)

    def to_message(self) -> Message:
        return Message(self.to_meta(), [] if self.payload is None else [self.payload])

    @classmethod
    def from_message(cls, message: Message) -> PingRequest:
        tensors = _expect(message, (0, 1))
        if not tensors:
            return cls()
        payload = tensors[0]
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            shape = tuple(payload.shape)
            raise RequestError(f"a ping's payload must be a 1-D uint8 tensor, got {payload.dtype} {shape}")
        if payload.numel() > MAX_PING_BYTES:
            raise PayloadTooLargeError(
                f"a ping's payload may carry at most {MAX_PING_BYTES} bytes, got {payload.numel()}"
            )
        return cls(payload=payload)


@dataclass(frozen=True)
class PingReply(Reply):
    received: int = wire(read_int)  # bytes of payload that arrived


# --- training: open, forward, backward, commit, revert -----------------------------------------------------------


def read_weights(meta: dict, key: str) -> dict[int, str]:
    """Pinned block digests (swarm/weights.py), or none."""
    return {} if meta.get(key) is None else by_blocks(_string, "digest")(meta, key)


@dataclass(frozen=True, kw_only=True)
class OpenRequest(Request):
    """Open an adapter (created with the deterministic init if new, else checked to match); a session claims it."""

    method: ClassVar[str] = Method.OPEN
    adapter: str = wire(read_adapter)
    lora: dict = wire(read_dict)
    seed: int = wire(read_int)
    session: str | None = wire(optional(read_str), default=None)
    weights: dict[int, str] = wire(read_weights, by_block, default_factory=dict)  # block -> its pinned base digest


@dataclass(frozen=True)
class OpenReply(Reply):
    """The adapter's committed step per served block, and per standby copy this peer holds."""

    steps: dict[int, int] = wire(read_steps, by_block)
    standby: dict[int, int] = wire(read_steps, by_block, default_factory=dict)


class HiddenRequest(Request):
    """A request whose tensors are hidden states (or a delta of them: swarm.net.deltas) and, when ``has_mask``, their
    mask: forward and infer. Subclasses have the fields ``hidden``, ``mask`` and ``compression`` (which also encodes
    the tensors sent)."""

    hidden: torch.Tensor | Delta
    mask: torch.Tensor | None
    compression: str

    def to_message(self) -> Message:
        tensors, delta = _hidden_tensors(self.hidden)
        tensors += [] if self.mask is None else [self.mask]
        meta = {**self.to_meta(), HAS_MASK: self.mask is not None, **delta}
        return Message(meta, tensors, COMPRESSIONS[self.compression])

    @classmethod
    def from_message(cls, message: Message) -> Any:
        fields_ = cls.read_meta(message.meta)
        (hidden,), mask = _span_tensors(message, 1)
        return cls(**fields_, hidden=_read_hidden(message, hidden), mask=mask)


@dataclass(frozen=True, kw_only=True)
class ForwardRequest(HiddenRequest):
    """Through blocks [start, end) of an adapter at a step. Tensors: [hidden, mask?]. One with a micro-batch id keeps
    its graph and its input for the backward; one without is an evaluation. With a ``route``, the peer passes its
    output on to the route's first hop (swarm/net/chain.py). With a ``sample`` (the client's hash of its tokens) and a
    delta compression, hidden states may travel as a delta (swarm.net.deltas), the output passed on too, and the
    chain's end answers with one from the reference whose digest is ``have`` (the client's for the stack's output).
    With ``deliver``, the chain's end hands its output to the client's ``collect`` of that token and answers along
    the chain with its ack only."""

    method: ClassVar[str] = Method.FORWARD
    adapter: str = wire(read_adapter)
    start: int = wire(read_int)
    end: int = wire(read_int)
    step: int = wire(read_int)
    hidden: torch.Tensor = tensor()
    mask: torch.Tensor | None = tensor(default=None)
    micro_batch: str | None = wire(optional(read_str), default=None)
    compression: str = wire(read_compression, default="none")  # how the peer encodes the tensors it answers with
    route: list[ChainHop] = wire(read_route, write_route, default_factory=list)  # the hops after this one
    autocast: str | None = wire(optional(read_autocast), default=None)  # the client's autocast dtype, if on
    sample: str | None = wire(optional(read_sample), default=None)
    have: bytes | None = wire(optional(read_digest), default=None)
    deliver: Delivery | None = wire(read_delivery, write_delivery, default=None)  # the chain's end: to a collect

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True, kw_only=True)
class BackwardRequest(Request):
    """Self-contained, so any replica can serve it. Tensors: [hidden?, grad, mask?]. One to the peer that ran the
    forward leaves the hidden states out (it kept them); one whose input gradient nobody needs (the first span: the
    embeddings are frozen) asks for none (``input_grad``). With a ``route``, the peer passes the gradient of its
    input on to the span before it (``input_grad`` is then the last hop's)."""

    method: ClassVar[str] = Method.BACKWARD
    adapter: str = wire(read_adapter)
    start: int = wire(read_int)
    end: int = wire(read_int)
    step: int = wire(read_int)
    micro_batch: str = wire(read_str)
    grad: torch.Tensor = tensor()
    hidden: torch.Tensor | None = tensor(default=None)
    mask: torch.Tensor | None = tensor(default=None)
    input_grad: bool = wire(flag(True), default=True)
    compression: str = wire(read_compression, default="none")
    route: list[ChainHop] = wire(read_route, write_route, default_factory=list)  # the spans before, nearest first
    autocast: str | None = wire(optional(read_autocast), default=None)  # the forward's autocast, for a recompute

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def to_message(self) -> Message:
        tensors = [t for t in (self.hidden, self.grad, self.mask) if t is not None]
        meta = {**self.to_meta(), HAS_MASK: self.mask is not None, HAS_HIDDEN: self.hidden is not None}
        return Message(meta, tensors, COMPRESSIONS[self.compression])

    @classmethod
    def from_message(cls, message: Message) -> BackwardRequest:
        fields_ = cls.read_meta(message.meta)
        has_hidden = flag(True)(message.meta, HAS_HIDDEN)
        tensors, mask = _span_tensors(message, 2 if has_hidden else 1)
        hidden = tensors[0] if has_hidden else None
        return cls(**fields_, grad=tensors[-1], hidden=hidden, mask=mask)


@dataclass(frozen=True)
class HiddenReply(Reply):
    """The hidden states out of a span (a forward, or new tokens of a generation), or a delta of them (a delta-coded
    chain's end). Tensors: [outputs], or none where the chain's end handed them to the client's ``collect``
    (``ForwardRequest.deliver``). Of a chain: the hops that ran (``acks``, in the route's order), and where it broke
    (``failure``), the outputs then being those of the last hop that ran."""

    outputs: torch.Tensor | Delta | None = tensor(default=None)
    compression: str = field(default="none", compare=False)  # how they travel; not sent
    acks: list[HopAck] = wire(read_acks, write_acks, default_factory=list)
    failure: ChainFailure | None = wire(read_failure, write_failure, default=None)

    def to_message(self) -> Message:
        tensors, delta = ([], {}) if self.outputs is None else _hidden_tensors(self.outputs)
        return Message({**self.to_meta(), **delta}, tensors, COMPRESSIONS[self.compression])

    @classmethod
    def from_message(cls, message: Message) -> HiddenReply:
        tensors = _expect(message, (0, 1))
        outputs = _read_hidden(message, tensors[0]) if tensors else None
        return cls(outputs, **cls.read_meta(message.meta))


def read_token(meta: dict, key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not 1 <= len(value) <= TOKEN_CHARS:
        raise RequestError(f"{key!r} must be a token of 1 to {TOKEN_CHARS} characters")
    return value


def read_collect_wait(meta: dict, key: str) -> float:
    value = read_float(meta, key)
    if not 0 < value <= MAX_HOLD:
        raise RequestError(f"{key!r} must be seconds in (0, {MAX_HOLD:g}]")
    return value


def read_size(meta: dict, key: str) -> int:
    value = meta.get(key, 0)
    if not _is_int(value) or value < 0:
        raise RequestError(f"{key!r} must be a number of bytes")
    return value


def expected_reply(meta: dict) -> int:
    """The bytes a request says its reply will carry (``REPLY_BYTES``; 0 where it does not say)."""
    value = meta.get(REPLY_BYTES, 0)
    return value if _is_int(value) and value > 0 else 0


@dataclass(frozen=True, kw_only=True)
class CollectRequest(Request):
    """The client, to a chain's last hop, sent beside the chained forward that names ``token`` (in either order of
    arrival): the chain's output, as soon as it is computed, waited for at most ``wait`` seconds (then, or for a
    token whose output was dropped or taken already, ``undelivered``). ``reply_bytes``: about what the output
    weighs on the wire (the request then travels as lanes, and the output comes back over them)."""

    method: ClassVar[str] = Method.COLLECT
    token: str = wire(read_token)
    wait: float = wire(read_collect_wait)
    reply_bytes: int = wire(read_size, default=0)


@dataclass(frozen=True)
class CollectReply(Reply):
    """A chain's output, as the chain's end would have answered it (a delta from the client's reference where the
    forward was delta-coded). Tensors: [outputs]."""

    outputs: torch.Tensor | Delta = tensor()
    compression: str = field(default="none", compare=False)

    def to_message(self) -> Message:
        tensors, delta = _hidden_tensors(self.outputs)
        return Message({**self.to_meta(), **delta}, tensors, COMPRESSIONS[self.compression])

    @classmethod
    def from_message(cls, message: Message) -> CollectReply:
        return cls(_read_hidden(message, _expect(message, (1,))[0]), **cls.read_meta(message.meta))


@dataclass(frozen=True)
class GradReply(Reply):
    """A backward's gradient of the span's input, when asked for. Tensors: [grad_inputs] or none. ``acks``: the hops
    that ran and now hold their gradients, in the order the chain ran (last span first); where it broke
    (``failure``), the gradient of the input of the last hop that ran."""

    grad_inputs: torch.Tensor | None = tensor(default=None)
    compression: str = field(default="none", compare=False)
    acks: list[HopAck] = wire(read_acks, write_acks, default_factory=list)
    failure: ChainFailure | None = wire(read_failure, write_failure, default=None)

    def to_message(self) -> Message:
        tensors = [] if self.grad_inputs is None else [self.grad_inputs]
        return Message(self.to_meta(), tensors, COMPRESSIONS[self.compression])

    @classmethod
    def from_message(cls, message: Message) -> GradReply:
        tensors = _expect(message, (0, 1))
        return cls(tensors[0] if tensors else None, **cls.read_meta(message.meta))


@dataclass(frozen=True)
class OptimizerHParams:
    """AdamW settings sent with every commit, so schedulers on the client just work."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def to_meta(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    @classmethod
    def from_meta(cls, hp: dict) -> OptimizerHParams:
        try:
            return cls(
                lr=float(hp["lr"]),
                betas=(float(hp["betas"][0]), float(hp["betas"][1])),
                eps=float(hp["eps"]),
                weight_decay=float(hp["weight_decay"]),
            )
        except (KeyError, TypeError, ValueError, IndexError):
            raise RequestError("'hparams' needs lr, betas (two numbers), eps and weight_decay") from None


def read_hparams(meta: dict, key: str) -> OptimizerHParams:
    return OptimizerHParams.from_meta(read_dict(meta, key))


@dataclass(frozen=True)
class Held:
    """A ledger entry: the peer holding a micro-batch's gradients on a block and, when it reported one with its
    backward, their hash (swarm/net/gradhash.py), which a replica fetching them checks. On the wire: the peer id
    alone, or ``[peer id, hash]``."""

    holder: str
    grad_hash: str | None = None

    def to_wire(self) -> str | list[str]:
        return self.holder if self.grad_hash is None else [self.holder, self.grad_hash]


def _held(value: object) -> Held:
    if isinstance(value, str) and value:
        return Held(value)
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0]:
        return Held(value[0], read_grad_hash(value[1]))
    raise ValueError(f"{value!r} is not a peer id or [peer id, gradient hash]")


def _holders(value: object) -> dict[str, Held]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{value!r} is not a map micro-batch id -> peer id")
    return {mb: _held(held) for mb, held in value.items()}


def read_ledger(meta: dict, key: str) -> dict[int, dict[str, Held]]:
    ledger = by_blocks(_holders, "{micro-batch id: peer id or [peer id, gradient hash]}")(meta, key)
    if not ledger:
        raise RequestError(f"{key!r} must name at least one block")
    return ledger


def write_ledger(ledger: dict[int, dict[str, Held]]) -> dict[str, dict[str, str | list[str]]]:
    return {str(block): {mb: held.to_wire() for mb, held in by_mb.items()} for block, by_mb in ledger.items()}


def read_holder_maddrs(meta: dict, key: str) -> dict[str, list[str]]:
    """Where the client reaches a ledger's holders (peer id -> multiaddrs): a replica that found one gone, or knows
    an older address (it restarted on another port), dials it there."""
    value = meta.get(key, {})
    if not isinstance(value, dict) or len(value) > MAX_HOLDERS:
        raise RequestError(f"{key!r} must map at most {MAX_HOLDERS} peer ids to their multiaddrs")
    for peer, maddrs in value.items():
        if (
            not isinstance(peer, str)
            or not isinstance(maddrs, list)
            or len(maddrs) > MAX_MADDRS
            or not all(isinstance(m, str) for m in maddrs)
        ):
            raise RequestError(f"{key!r} must map peer ids to lists of at most {MAX_MADDRS} multiaddrs")
        try:
            PeerID.from_base58(peer)
        except ValueError:
            raise RequestError(f"{key!r}: {peer!r} is not a base58 peer id") from None
    return value


def read_grad_scale(meta: dict, key: str) -> float:
    scale = meta.get(key, 1.0)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not 0 <= scale <= 1:
        raise RequestError(f"{key!r} must be a number in [0, 1] (the clipping factor)")
    return float(scale)


def read_fetch_timeout(meta: dict, key: str) -> float:
    timeout = meta.get(key, FETCH_TIMEOUT)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 600:
        raise RequestError(f"{key!r} must be a number of seconds in (0, 600]")
    return float(timeout)


MAX_CHUNKS = 16  # a block's replicas that reduce it in chunks, at most


def _reducers(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_CHUNKS or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{value!r} is not a list of at most {MAX_CHUNKS} peer ids")
    if value != sorted(set(value)):
        raise ValueError(f"{value!r} is not sorted without repeats")
    for peer in value:
        PeerID.from_base58(peer)
    return value


def read_chunks(meta: dict, key: str) -> int:
    """How many chunks a block's sum is cut into (0: whole); ``chunk`` must be one of them."""
    chunks, chunk = meta.get(key), meta.get("chunk")
    if not _is_int(chunks) or not 0 <= chunks <= MAX_CHUNKS or (chunks and not (_is_int(chunk) and chunk < chunks)):
        raise RequestError(f"{key!r} must be 0 or at most {MAX_CHUNKS}, and 'chunk' one of them")
    return chunks


def read_wait(meta: dict, key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 600:
        raise RequestError(f"{key!r} must be a number of seconds in [0, 600]")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class CommitRequest(Request):
    """Commit a step on the blocks of ``ledger`` (block -> {micro-batch id: the peer holding its gradients, and
    their hash}) with the optimizer's hyper-parameters in effect."""

    method: ClassVar[str] = Method.COMMIT
    adapter: str = wire(read_adapter)
    step: int = wire(read_int)
    ledger: dict[int, dict[str, Held]] = wire(read_ledger, write_ledger)
    hparams: OptimizerHParams = wire(read_hparams, OptimizerHParams.to_meta)
    fetch_timeout: float = wire(read_fetch_timeout, default=FETCH_TIMEOUT)
    grad_scale: float = wire(read_grad_scale, default=1.0)  # the global clipping factor, the same on every replica
    audit: bool = wire(read_bool, default=False)  # refetch every other holder's partial sum, each one audited
    holder_maddrs: dict[str, list[str]] = wire(read_holder_maddrs, default_factory=dict)
    # per block, the replicas asked to commit it, sorted: with three or more, they reduce it in chunks
    reducers: dict[int, list[str]] = wire(by_blocks(_reducers, "peer ids"), by_block, default_factory=dict)

    def micro_batches(self) -> dict[int, list[str]]:
        """Per block, the micro-batches to sum, in the canonical (sorted) order."""
        return {block: sorted(by_mb) for block, by_mb in self.ledger.items()}

    def groups(self) -> dict[int, list[Group]]:
        return ledger_groups(self.ledger)


def read_norm_type(meta: dict, key: str) -> float:
    value = meta.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value) or value <= 0:
        raise RequestError(f"{key!r} must be a positive number (or inf)")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class NormsRequest(Request):
    """Each block's share of the step's gradient norm over the micro-batches of ``ledger`` (as for a commit: the
    peer fetches those it lacks): ``sum |g|^p`` of the summed gradient, or ``max |g|`` for ``norm_type`` inf. For
    the steps whose backward replies did not already say it (see swarm/net/gradnorm.py)."""

    method: ClassVar[str] = Method.NORMS
    adapter: str = wire(read_adapter)
    step: int = wire(read_int)
    ledger: dict[int, dict[str, Held]] = wire(read_ledger, write_ledger)
    norm_type: float = wire(read_norm_type, default=2.0)
    fetch_timeout: float = wire(read_fetch_timeout, default=FETCH_TIMEOUT)
    holder_maddrs: dict[str, list[str]] = wire(read_holder_maddrs, default_factory=dict)
    reducers: dict[int, list[str]] = wire(by_blocks(_reducers, "peer ids"), by_block, default_factory=dict)
    audit: bool = wire(read_bool, default=False)  # as CommitRequest's: replicas gave different shares

    def micro_batches(self) -> dict[int, list[str]]:
        return {block: sorted(by_mb) for block, by_mb in self.ledger.items()}

    def groups(self) -> dict[int, list[Group]]:
        return ledger_groups(self.ledger)


def _share(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


@dataclass(frozen=True)
class NormsReply(Reply):
    """Per block held at the step, its share of the norm (non-finite values as they are)."""

    parts: dict[int, float] = wire(by_blocks(_share, "number"), by_block)


@dataclass(frozen=True)
class StepsReply(Reply):
    """The adapter's step per block after a commit, revert, sync, or replicate (then: the standby copies held)."""

    steps: dict[int, int] = wire(read_steps, by_block)


@dataclass(frozen=True)
class CommitReply(StepsReply):
    """A commit's steps per block, and each block's state digest after it: the replicas' vote, at no extra round."""

    digests: dict[int, str] = wire(by_blocks(_string, "digest"), by_block)


@dataclass(frozen=True, kw_only=True)
class RevertRequest(Request):
    """Take ``step`` back: state, moments and gradients as before it was applied."""

    method: ClassVar[str] = Method.REVERT
    adapter: str = wire(read_adapter)
    step: int = wire(read_int)


# --- peer to peer: gradients, state, copies ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GradsRequest(Request):
    """The gradients of these micro-batches (block -> micro-batch ids) at a step, for a replica that lacks them. With
    ``summed``, each block's micro-batches summed in sorted order, under the key ``SUM``: the holder's partial sum of
    the step (a block whose micro-batches are not all held is left out), with its micro-batches' sketches under
    ``SKETCH``."""

    method: ClassVar[str] = Method.GRADS
    adapter: str = wire(read_adapter)
    step: int = wire(read_int)
    wanted: dict[int, list[str]] = wire(by_blocks(_strings, "micro-batch ids"), by_block)
    summed: bool = wire(read_bool, default=False)
    # with ``chunks`` > 0, only chunk ``chunk`` of each block's sum (swarm/net/reduction.py ``chunk_of``)
    chunk: int = wire(read_int, default=0)
    chunks: int = wire(read_chunks, default=0)
    # with a groups digest (``reduction.groups_digest``) per block: the chunk of the step's reduced gradient that
    # this peer reduces, waited for at most ``wait`` seconds while it is still being reduced
    reduced: dict[int, str] = wire(by_blocks(_string, "groups digest"), by_block, default_factory=dict)
    wait: float = wire(read_wait, default=0.0)


SUM = "+"  # the key of a partial sum in a GradsReply (never a micro-batch id: those are session:step:counter)
# beside a partial sum, the key of its micro-batches' sketches (one float64 tensor, a row per micro-batch in sorted
# order: swarm/net/sketch.py), for the audits
SKETCH = "#"
Group = tuple[str, ...]  # one holder's micro-batches of a block, sorted


def ledger_groups(ledger: dict[int, dict[str, Held]]) -> dict[int, list[Group]]:
    """Per block, each holder's micro-batches, sorted, the groups in the order of their first micro-batch: how every
    replica sums a step's gradients, the same bits everywhere (one partial sum per
    holder, computed by the holder, then the partial sums in this order; ARCHITECTURE.md "One reduction per step")."""
    groups = {}
    for block, by_mb in ledger.items():
        by_holder: dict[str, list[str]] = {}
        for mb, held in by_mb.items():
            by_holder.setdefault(held.holder, []).append(mb)
        groups[block] = sorted(tuple(sorted(mbs)) for mbs in by_holder.values())
    return groups


def _index_entry(entry: object) -> tuple[int, str, int]:
    if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[1], str):
        raise ValueError(f"{entry!r} is not [block, micro-batch, count]")
    return _block(entry[0]), entry[1], _step(entry[2])


@dataclass(frozen=True)
class GradsReply(Reply):
    """Block -> micro-batch -> its LoRA gradients. Travels as the tensors in order, indexed by [block, mb, count]."""

    grads: dict[int, dict[str, list[torch.Tensor]]] = tensor()

    def to_message(self) -> Message:
        index, tensors = [], []
        for block, by_mb in self.grads.items():
            for mb, block_grads in by_mb.items():
                index.append([block, mb, len(block_grads)])
                tensors.extend(block_grads)
        return Message({"index": index}, tensors)

    @classmethod
    def from_message(cls, message: Message) -> GradsReply:
        entries = read_list(message.meta, "index")
        try:
            index = [_index_entry(entry) for entry in entries]
        except ValueError as e:
            raise RequestError(f"'index' must list [block, micro-batch, count]: {e}") from None
        _expect(message, (sum(count for *_, count in index),))
        grads: dict[int, dict[str, list[torch.Tensor]]] = {}
        tensors = iter(message.tensors)
        for block, mb, count in index:
            grads.setdefault(block, {})[mb] = [next(tensors) for _ in range(count)]
        return cls(grads)


@dataclass(frozen=True, kw_only=True)
class ExportRequest(Request):
    """The state of blocks [start, end) (served or standby). With ``held`` (block -> the step of the asker's copy),
    the last update of served blocks held one step behind instead of their whole state. With ``watcher``, the asker
    is told of this peer's commits of those blocks for a while (``CommittedRequest``)."""

    method: ClassVar[str] = Method.EXPORT
    adapter: str = wire(read_adapter)
    start: int = wire(read_int)
    end: int = wire(read_int)
    held: dict[int, int] | None = wire(
        optional(read_steps), lambda held: None if held is None else by_block(held), default=None
    )
    # the asker keeps copies of these blocks and asks to be told of this peer's next commits (StateSync.export)
    watcher: PeerID | None = wire(
        optional(read_peer), lambda peer: None if peer is None else peer.to_base58(), default=None
    )

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


def _hparams(value: object) -> OptimizerHParams:
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is not a map")
    return OptimizerHParams.from_meta(value)


@dataclass(frozen=True)
class ExportReply(Reply):
    """Packed block states (``index`` over the flat tensor ``states``) and packed last updates (``update_index`` over
    ``updates``) with their AdamW settings, the digest of the state each was applied to (``bases``) and of the state
    it gave (``afters``) per block.
    Tensors: [states, updates]. (Packing: peers.state.)"""

    index: list = wire(read_list)
    update_index: list = wire(read_list)
    hparams: dict[int, OptimizerHParams] = wire(
        by_blocks(_hparams, "AdamW settings"), lambda hp: {str(b): h.to_meta() for b, h in hp.items()}
    )
    bases: dict[int, str] = wire(by_blocks(_string, "digest"), by_block)
    # the digest of the server's state each update took it to (``BlockUpdate.after``)
    afters: dict[int, str] = wire(by_blocks(_string, "digest"), by_block)
    states: torch.Tensor = tensor()
    updates: torch.Tensor = tensor()

    def to_message(self) -> Message:
        return Message(self.to_meta(), [self.states, self.updates])

    @classmethod
    def from_message(cls, message: Message) -> ExportReply:
        states, updates = _expect(message, (2,))
        return cls(**cls.read_meta(message.meta), states=states, updates=updates)


@dataclass(frozen=True, kw_only=True)
class SyncRequest(Request):
    """Pull the state of blocks [start, end) from ``source``, a current copy, so this peer can serve them again."""

    method: ClassVar[str] = Method.SYNC
    adapter: str = wire(read_adapter)
    source: PeerID = wire(read_peer, PeerID.to_base58)
    start: int = wire(read_int)
    end: int = wire(read_int)

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True, kw_only=True)
class StateRequest(Request):
    """Every LoRA tensor of the adapter's blocks here, for the client's adapter export."""

    method: ClassVar[str] = Method.STATE
    adapter: str = wire(read_adapter)


def _name_entry(entry: object) -> tuple[int, str]:
    if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], str):
        raise ValueError(f"{entry!r} is not [block, name]")
    return _block(entry[0]), entry[1]


@dataclass(frozen=True)
class StateReply(Reply):
    """Block -> LoRA tensor name -> tensor. Travels as the tensors in order, named by [block, name]."""

    state: dict[int, dict[str, torch.Tensor]] = tensor()

    def to_message(self) -> Message:
        names = [[block, name] for block, tensors in self.state.items() for name in tensors]
        return Message({"names": names}, [self.state[block][name] for block, name in names])

    @classmethod
    def from_message(cls, message: Message) -> StateReply:
        entries = read_list(message.meta, "names")
        try:
            names = [_name_entry(entry) for entry in entries]
        except ValueError as e:
            raise RequestError(f"'names' must list [block, name]: {e}") from None
        state: dict[int, dict[str, torch.Tensor]] = {}
        for (block, name), value in zip(names, _expect(message, (len(names),)), strict=True):
            state.setdefault(block, {})[name] = value
        return cls(state)


@dataclass(frozen=True, kw_only=True)
class DigestRequest(Request):
    """A hash of each block's state, to check that replicas are identical."""

    method: ClassVar[str] = Method.DIGEST
    adapter: str = wire(read_adapter)


@dataclass(frozen=True)
class DigestReply(Reply):
    digests: dict[int, str] = wire(by_blocks(_string, "digest"), by_block)


@dataclass(frozen=True, kw_only=True)
class TieBreakRequest(CommitRequest):
    """Two replicas of blocks disagree on a commit: apply its ledger to the standby copies held here (at ``step``;
    the gradients fetched from the ledger's holders) and report the digests (``DigestReply``). Nothing is kept."""

    method: ClassVar[str] = Method.TIEBREAK


@dataclass(frozen=True, kw_only=True)
class FastForwardRequest(Request):
    """No current copy of blocks [start, end) survived anywhere: declare the one held here current at ``step``."""

    method: ClassVar[str] = Method.FAST_FORWARD
    adapter: str = wire(read_adapter)
    step: int = wire(read_int)
    start: int = wire(read_int)
    end: int = wire(read_int)

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class FastForwardReply(Reply):
    """The adapter's steps per block now, and the steps lost per block fast-forwarded."""

    steps: dict[int, int] = wire(read_steps, by_block)
    lost: dict[int, int] = wire(read_steps, by_block)


@dataclass(frozen=True, kw_only=True)
class CommittedRequest(Request):
    """A notice to a standby holder: ``source``, a server of these blocks, applied ``steps`` (block -> step)."""

    method: ClassVar[str] = Method.COMMITTED
    adapter: str = wire(read_adapter)
    lora: dict = wire(read_dict)
    seed: int = wire(read_int)
    steps: dict[int, int] = wire(read_steps, by_block)
    source: PeerID = wire(read_peer, PeerID.to_base58)

    @property
    def adapter_meta(self) -> dict:
        return adapter_meta(self.lora, self.seed)


@dataclass(frozen=True, kw_only=True)
class UnservedRequest(Request):
    """A client found no live server of ``blocks`` of ``model``: a hint to hold a balance round now (a peer checks
    the swarm itself before it moves), so that a block whose servers all died is taken over in a second, not at the
    next round, seconds later."""

    method: ClassVar[str] = Method.UNSERVED
    model: str = wire(read_text)
    blocks: list[int] = wire(read_blocks, list)


@dataclass(frozen=True)
class Ack(Reply):
    """A reply that says only 'received'."""


def _source(entry: object) -> tuple[range, PeerID]:
    if not isinstance(entry, list) or len(entry) != 3 or not _is_int(entry[0]) or not _is_int(entry[1]):
        raise ValueError(f"{entry!r} is not [start, end, peer id]")
    start, end, peer = entry
    if not 0 <= start < end:
        raise ValueError(f"{entry!r} is not a non-empty block range")
    if not isinstance(peer, str):
        raise ValueError(f"{peer!r} is not a peer id")
    return range(start, end), PeerID.from_base58(peer)


def read_sources(meta: dict, key: str) -> list[tuple[range, PeerID]]:
    entries = read_list(meta, key)
    try:
        sources = [_source(entry) for entry in entries]
    except ValueError as e:
        raise RequestError(f"{key!r} must be a list of [start, end, peer id]: {e}") from None
    if not sources:
        raise RequestError(f"{key!r} must name at least one block range")
    return sources


def write_sources(sources: list[tuple[range, PeerID]]) -> list[list]:
    return [[blocks.start, blocks.stop, peer.to_base58()] for blocks, peer in sources]


@dataclass(frozen=True, kw_only=True)
class ReplicateRequest(Request):
    """Hold a copy of blocks' state at ``step``, pulled from the named sources (block range, replica), before the
    trainer acknowledges the step. The reply's steps are the standby copies held."""

    method: ClassVar[str] = Method.REPLICATE
    adapter: str = wire(read_adapter)
    lora: dict = wire(read_dict)
    seed: int = wire(read_int)
    step: int = wire(read_int)
    sources: list[tuple[range, PeerID]] = wire(read_sources, write_sources)

    @property
    def adapter_meta(self) -> dict:
        return adapter_meta(self.lora, self.seed)


# --- generation ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class InferRequest(HiddenRequest):
    """Generation: the hidden states of new tokens through blocks [start, end) in ``session``, which holds the keys
    and values of ``position`` tokens already. The first request (position 0) opens the session with room for
    ``max_length`` tokens. ``adapter`` None runs the base model (LoRA off); else the adapter at ``step`` or later.
    Tensors: [hidden, mask?]; the mask (padded prompts) covers every token of the session so far. With a ``route``,
    the same session goes on through the route's hops, each passing its output on."""

    method: ClassVar[str] = Method.INFER
    session: str = wire(read_session)
    start: int = wire(read_int)
    end: int = wire(read_int)
    position: int = wire(read_int)
    max_length: int = wire(read_int)
    hidden: torch.Tensor = tensor()
    mask: torch.Tensor | None = tensor(default=None)
    adapter: str | None = wire(optional(read_adapter), default=None)
    step: int = wire(read_int, default=0)
    compression: str = wire(read_compression, default="none")
    route: list[ChainHop] = wire(read_route, write_route, default_factory=list)  # the hops after this one
    autocast: str | None = wire(optional(read_autocast), default=None)  # the client's autocast dtype, if on

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True, kw_only=True)
class EndSessionRequest(Request):
    """Free a generation session's keys and values now (an idle one expires anyway)."""

    method: ClassVar[str] = Method.END_SESSION
    session: str = wire(read_session)


@dataclass(frozen=True)
class EndSessionReply(Reply):
    ended: bool = wire(read_bool)  # whether this peer still held the session


# --- the registry -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """A method's request and reply schemas; ``streamed``: its replies can be large even when the request is small,
    so they use the stream door."""

    request: type[Request]
    reply: type[Reply]
    streamed: bool = False


METHODS: dict[str, MethodSpec] = {
    Method.HELLO: MethodSpec(HelloRequest, HelloReply),
    Method.INFO: MethodSpec(InfoRequest, PeerInfo),
    Method.PING: MethodSpec(PingRequest, PingReply),
    Method.OPEN: MethodSpec(OpenRequest, OpenReply),
    Method.FORWARD: MethodSpec(ForwardRequest, HiddenReply),
    Method.BACKWARD: MethodSpec(BackwardRequest, GradReply),
    Method.COMMIT: MethodSpec(CommitRequest, CommitReply),
    Method.NORMS: MethodSpec(NormsRequest, NormsReply),
    Method.REVERT: MethodSpec(RevertRequest, StepsReply),
    Method.GRADS: MethodSpec(GradsRequest, GradsReply, streamed=True),
    Method.EXPORT: MethodSpec(ExportRequest, ExportReply, streamed=True),
    Method.SYNC: MethodSpec(SyncRequest, StepsReply),
    Method.STATE: MethodSpec(StateRequest, StateReply, streamed=True),
    Method.DIGEST: MethodSpec(DigestRequest, DigestReply),
    Method.TIEBREAK: MethodSpec(TieBreakRequest, DigestReply),
    Method.FAST_FORWARD: MethodSpec(FastForwardRequest, FastForwardReply),
    Method.COMMITTED: MethodSpec(CommittedRequest, Ack),
    Method.UNSERVED: MethodSpec(UnservedRequest, Ack),
    Method.REPLICATE: MethodSpec(ReplicateRequest, StepsReply),
    Method.REACHABLE: MethodSpec(ReachableRequest, ReachableReply),
    Method.INFER: MethodSpec(InferRequest, HiddenReply),
    Method.END_SESSION: MethodSpec(EndSessionRequest, EndSessionReply),
    Method.COLLECT: MethodSpec(CollectRequest, CollectReply),
}
STREAMED_REPLIES = frozenset(name for name, spec in METHODS.items() if spec.streamed)


def method_of(meta: dict) -> object:
    """The method a message's metadata names (anything: it is checked by :func:`read_request`)."""
    return meta.get(METHOD)


def read_request(message: Message) -> Request:
    """The typed request a message carries; RequestError if its method is unknown or it does not fit the schema."""
    method = method_of(message.meta)
    spec = METHODS.get(method) if isinstance(method, str) else None
    if spec is None:
        raise RequestError(f"unknown method {method!r}; known: {sorted(METHODS)}")
    return spec.request.from_message(message)


def read_reply(request: Request, message: Message) -> Reply:
    """The typed reply to ``request``; ReplyError (the answering peer's fault) if it does not fit the schema."""
    try:
        return METHODS[request.method].reply.from_message(message)
    except RequestError as e:
        raise ReplyError(f"malformed {request.method} reply: {e}") from None


# --- refusals -----------------------------------------------------------------------------------------------------


def error_message(kind: str, text: str, **details: object) -> Message:
    return Message(meta={ERROR: text, KIND: kind, **details}, tensors=[])


def refusal(error: RequestError) -> Message:
    """A refused request's answer: its kind, its message, and what the caller needs to act on it."""
    details: dict[str, object] = {}
    if isinstance(error, MissingGradientsError):
        details[MISSING] = by_block(error.missing)
    if isinstance(error, SourceUnavailableError):
        details[SOURCE] = error.source
    if isinstance(error, BadGradientsError):
        details[BAD_HOLDERS] = error.holders
    return error_message(error.kind, str(error), **details)


def raise_if_error(message: Message) -> Message:
    if ERROR in message.meta:
        raise RemoteError(str(message.meta.get(KIND, ERROR)), str(message.meta[ERROR]), message.meta)
    return message


def missing_gradients(error: RemoteError) -> dict[int, list[str]]:
    """What a ``missing_gradients`` refusal says nobody could provide: block -> micro-batch ids."""
    try:
        return by_blocks(_strings, "micro-batch ids")(error.meta, MISSING)
    except RequestError as e:
        raise ReplyError(f"malformed missing_gradients refusal: {e}") from None


def bad_holders(error: RemoteError) -> list[PeerID]:
    """The peers a ``bad_gradients`` refusal names: their gradients did not match the hashes they reported."""
    holders = error.meta.get(BAD_HOLDERS)
    try:
        if not isinstance(holders, list) or not holders or not all(isinstance(h, str) for h in holders):
            raise ValueError(f"{holders!r} is not a list of peer ids")
        return [PeerID.from_base58(h) for h in holders]
    except ValueError as e:
        raise ReplyError(f"malformed bad_gradients refusal: {e}") from None
