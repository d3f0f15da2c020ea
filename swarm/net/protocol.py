"""The wire protocol between clients and peers, in one place: method names, refusal kinds, shared constants, and
the schemas of the main requests and replies. Both sides build and read messages through these classes, so a
field is named once; ``from_meta`` validates what arrives and refuses it with a ``RequestError`` that says why.

The method table (who calls what) is in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from swarm.net.compression import read_compression
from swarm.net.errors import ErrorKind, RequestError


class Method:
    """Every method a peer answers."""

    HELLO = "hello"  # unauthenticated: public or private swarm, and the key id
    INFO = "info"  # what a peer serves and holds (the view's ping)
    OPEN = "open"  # open or claim an adapter; its steps per block
    FORWARD = "forward"
    BACKWARD = "backward"
    COMMIT = "commit"  # fetch the micro-batch gradients it lacks from other replicas, sum them, one AdamW update
    REVERT = "revert"  # take back a commit that reached this replica while others could not complete it yet
    GRADS = "grads"  # peer to peer: micro-batch gradients this peer holds
    EXPORT = "export"  # peer to peer: adapter + AdamW state of blocks (served or standby)
    SYNC = "sync"  # pull state from a current copy
    STATE = "state"  # LoRA tensors, for the client's adapter export
    DIGEST = "digest"  # hash of each block's state, to compare replicas
    FAST_FORWARD = "fast_forward"  # declare an older state current (steps lost, reported)
    COMMITTED = "committed"  # notice to standby holders: a step was applied
    REPLICATE = "replicate"  # hold a copy of blocks' state at a step (durable ack)
    REACHABLE = "reachable"  # dial the asking peer back at the addresses it names (is it reachable from outside?)
    INFER = "infer"  # generation: new tokens through blocks, keys and values kept per session
    END_SESSION = "end_session"  # free a generation session's keys and values


# Fields any request may carry: ask the peer that receives it to pass it on to RELAY_TO, a peer behind NAT that
# keeps a connection to it (and give it RELAY_TIMEOUT seconds).
RELAY_TO = "relay_to"
RELAY_TIMEOUT = "relay_timeout"

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
    }
)
# Methods whose replies can be large even when the request is small: they use the stream door.
STREAMED_REPLIES = frozenset({Method.STATE, Method.GRADS, Method.EXPORT})
FETCH_TIMEOUT = 3.0  # how long a replica waits for another's gradients before the client replays them
SYNC_TIMEOUT = 60.0  # how long a state transfer between peers may take


# --- reading fields ---------------------------------------------------------------------------------------------


ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_adapter_name(name: object) -> str:
    """Adapter names become peft module keys and checkpoint folder names: letters, digits, '-' and '_' only."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise RequestError(f"adapter name {name!r}: use 1 to 64 letters, digits, '-' or '_'")
    return name


def read_str(meta: dict, key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{key!r} must be a non-empty string")
    return value


def read_int(meta: dict, key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"{key!r} must be a non-negative integer")
    return value


def read_dict(meta: dict, key: str) -> dict:
    value = meta.get(key)
    if not isinstance(value, dict):
        raise RequestError(f"{key!r} must be a map")
    return value


def read_peer(meta: dict, key: str) -> PeerID:
    try:
        return PeerID.from_base58(read_str(meta, key))
    except ValueError:
        raise RequestError(f"{key!r} must be a base58 peer id") from None


def read_steps(meta: dict, key: str) -> dict[int, int]:
    """A map block -> step, as replies carry them (msgpack keys are strings)."""
    try:
        return {int(block): int(step) for block, step in dict(meta.get(key) or {}).items()}
    except (TypeError, ValueError):
        raise RequestError(f"{key!r} must map block -> step") from None


def by_block(values: dict[int, object]) -> dict[str, object]:
    return {str(block): value for block, value in values.items()}


# --- requests and replies ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanRequest:
    """Forward or backward through blocks [start, end) of an adapter at a step. Tensors: [hidden, (grad), mask?].
    A forward with a micro-batch id keeps its graph for the backward; one without is an evaluation.

    A backward to the peer that ran the forward leaves the hidden states out (``has_hidden`` false: it has them);
    one whose input gradient nobody needs (the first span: embeddings are frozen) asks for none (``input_grad``)."""

    method: str
    adapter: str
    start: int
    end: int
    step: int
    has_mask: bool
    micro_batch: str | None = None
    has_hidden: bool = True
    input_grad: bool = True
    compression: str = "none"  # how the peer encodes the tensors it answers with (swarm.net.compression)

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def to_meta(self) -> dict:
        return {
            "method": self.method,
            "adapter": self.adapter,
            "start": self.start,
            "end": self.end,
            "step": self.step,
            "has_mask": self.has_mask,
            "micro_batch": self.micro_batch,
            "has_hidden": self.has_hidden,
            "input_grad": self.input_grad,
            "compression": self.compression,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> SpanRequest:
        method = meta.get("method")
        micro_batch = meta.get("micro_batch")
        if method == Method.BACKWARD or micro_batch is not None:
            micro_batch = read_str(meta, "micro_batch")
        return cls(
            method=method,
            adapter=read_str(meta, "adapter"),
            start=read_int(meta, "start"),
            end=read_int(meta, "end"),
            step=read_int(meta, "step"),
            has_mask=bool(meta.get("has_mask")),
            micro_batch=micro_batch,
            has_hidden=method != Method.BACKWARD or bool(meta.get("has_hidden", True)),
            input_grad=bool(meta.get("input_grad", True)),
            compression=read_compression(meta),
        )


SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class InferRequest:
    """Generation: the hidden states of new tokens through blocks [start, end) in ``session``, which holds the keys
    and values of ``position`` tokens already. The first request (position 0) opens the session with room for
    ``max_length`` tokens. ``adapter`` None runs the base model (LoRA off); else the adapter at ``step`` or later.
    Tensors: [hidden, mask?]; the mask (``has_mask``: padded prompts) covers every token of the session so far."""

    session: str
    start: int
    end: int
    position: int
    max_length: int
    adapter: str | None = None
    step: int = 0
    compression: str = "none"
    has_mask: bool = False

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def to_meta(self) -> dict:
        return {
            "method": Method.INFER,
            "has_mask": self.has_mask,
            "session": self.session,
            "start": self.start,
            "end": self.end,
            "position": self.position,
            "max_length": self.max_length,
            "adapter": self.adapter,
            "step": self.step,
            "compression": self.compression,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> InferRequest:
        adapter = meta.get("adapter")
        return cls(
            session=read_session(meta),
            start=read_int(meta, "start"),
            end=read_int(meta, "end"),
            position=read_int(meta, "position"),
            max_length=read_int(meta, "max_length"),
            adapter=None if adapter is None else check_adapter_name(adapter),
            step=read_int(meta, "step"),
            compression=read_compression(meta),
            has_mask=bool(meta.get("has_mask")),
        )


def read_session(meta: dict) -> str:
    session = meta.get("session")
    if not isinstance(session, str) or not SESSION_ID.fullmatch(session):
        raise RequestError("'session' must be 1 to 64 letters, digits, '-' or '_'")
    return session


@dataclass(frozen=True)
class OpenRequest:
    """Open an adapter (created with the deterministic init if new, else checked to match); a session claims it."""

    adapter: str
    lora: dict
    seed: int
    session: str | None = None

    def to_meta(self) -> dict:
        return {
            "method": Method.OPEN,
            "adapter": self.adapter,
            "lora": self.lora,
            "seed": self.seed,
            "session": self.session,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> OpenRequest:
        session = meta.get("session")
        if session is not None and not isinstance(session, str):
            raise RequestError("'session' must be a string")
        return cls(check_adapter_name(meta.get("adapter")), read_dict(meta, "lora"), read_int(meta, "seed"), session)


@dataclass(frozen=True)
class OpenReply:
    """The adapter's committed step per served block, and per standby copy this peer holds."""

    steps: dict[int, int]
    standby: dict[int, int] = field(default_factory=dict)

    def to_meta(self) -> dict:
        return {"steps": by_block(self.steps), "standby": by_block(self.standby)}

    @classmethod
    def from_meta(cls, meta: dict) -> OpenReply:
        return cls(read_steps(meta, "steps"), read_steps(meta, "standby"))


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


@dataclass(frozen=True)
class CommitRequest:
    """Commit a step on the blocks of ``ledger`` (block -> {micro-batch id: the peer holding its gradients}) with
    the optimizer's hyper-parameters in effect."""

    adapter: str
    step: int
    ledger: dict[int, dict[str, str]]
    hparams: OptimizerHParams
    fetch_timeout: float = FETCH_TIMEOUT

    def micro_batches(self) -> dict[int, list[str]]:
        """Per block, the micro-batches to sum, in the canonical (sorted) order."""
        return {block: sorted(by_mb) for block, by_mb in self.ledger.items()}

    def to_meta(self) -> dict:
        return {
            "method": Method.COMMIT,
            "adapter": self.adapter,
            "step": self.step,
            "ledger": by_block(self.ledger),
            "hparams": self.hparams.to_meta(),
            "fetch_timeout": self.fetch_timeout,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> CommitRequest:
        raw = meta.get("ledger")
        try:
            ledger = {int(block): {str(mb): str(peer) for mb, peer in by_mb.items()} for block, by_mb in raw.items()}
        except (AttributeError, TypeError, ValueError):
            raise RequestError("'ledger' must map block -> {micro-batch id: peer id}") from None
        if not ledger:
            raise RequestError("'ledger' must name at least one block")
        timeout = meta.get("fetch_timeout", FETCH_TIMEOUT)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 600:
            raise RequestError("'fetch_timeout' must be a number of seconds in (0, 600]")
        hparams = OptimizerHParams.from_meta(read_dict(meta, "hparams"))
        return cls(read_str(meta, "adapter"), read_int(meta, "step"), ledger, hparams, float(timeout))


@dataclass
class AdapterInfo:
    """What a live peer holds of one adapter: its config, served steps and standby copies per block."""

    meta: dict
    steps: dict[int, int]
    standby: dict[int, int]

    def step_of(self, block: int) -> int | None:
        return self.steps.get(block, self.standby.get(block))


@dataclass
class PeerInfo:
    """A peer's answer to ``info``: what it serves, the adapters it holds, the blocks it keeps on standby."""

    model: str
    start: int
    end: int
    state: str
    throughput: float
    adapters: dict[str, AdapterInfo]
    standby_blocks: list[int]
    weights: str = ""  # how the base weights are held: quantization / compute dtype, e.g. "nf4/bfloat16"

    def to_meta(self) -> dict:
        adapters = {
            name: {**a.meta, "steps": by_block(a.steps), "standby": by_block(a.standby)}
            for name, a in self.adapters.items()
        }
        return {
            "model": self.model,
            "start": self.start,
            "end": self.end,
            "state": self.state,
            "throughput": self.throughput,
            "adapters": adapters,
            "standby_blocks": list(self.standby_blocks),
            "weights": self.weights,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> PeerInfo:
        adapters = {}
        for name, entry in dict(meta.get("adapters", {})).items():
            adapters[str(name)] = AdapterInfo(
                meta={"lora": entry["lora"], "seed": int(entry["seed"])},
                steps=read_steps(entry, "steps"),
                standby=read_steps(entry, "standby"),
            )
        return cls(
            model=str(meta.get("model", "")),
            start=int(meta.get("start", 0)),
            end=int(meta.get("end", 0)),
            state=str(meta.get("state", "")),
            throughput=float(meta.get("throughput", 0.0)),
            adapters=adapters,
            standby_blocks=[int(b) for b in meta.get("standby_blocks", [])],
            weights=str(meta.get("weights", "")),
        )
