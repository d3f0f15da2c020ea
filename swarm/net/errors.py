"""Every error a user of swarm can meet, under one base class: ``except swarm.SwarmError`` catches them all, and
each message says what to do next. (Failures the client routes around never reach the user.)"""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError
from msgpack import UnpackException


class SwarmError(Exception):
    """Something the swarm could not do; the message says what to do next."""


# --- bad input: the caller must change something --------------------------------------------------------------


class WireError(ValueError):
    """Bytes that are not a valid swarm message."""


class ReplyError(ValueError):
    """A reply that does not fit its method's schema: the answering peer's fault, like a garbled message."""


class ModelFolderError(SwarmError, ValueError):
    """The model folder is missing, unsupported or incomplete."""


class ModelHubError(ModelFolderError):
    """A model named by its hub id (``ORG/NAME[@REVISION]``) that cannot be fetched: an unknown repository or
    revision, a gated one without access, no network (and not in the cache)."""


class AdapterConfigError(SwarmError, ValueError):
    """A LoRA config that the swarm cannot train exactly."""


class SwarmKeyError(SwarmError, ValueError):
    """A swarm key file that cannot be used."""


class UsageError(SwarmError, ValueError):
    """A command-line argument that cannot work (checked before anything slow starts)."""


# --- the swarm as it is -------------------------------------------------------------------------------------


class SwarmAccessError(SwarmError, RuntimeError):
    """This process cannot take part in the swarm as configured: unreachable initial peers, a private swarm
    without its key, or the wrong key."""


class IdentityInUseError(SwarmAccessError):
    """Another process already serves with this peer's identity (or its checkpoint dir): two processes with one
    peer id are not one peer, and requests for it would reach either."""


class SwarmUnavailableError(SwarmError, RuntimeError):
    """Blocks stayed without any live server for longer than the client's patience."""

    @classmethod
    def unserved(cls, blocks: list[int], seconds: float, what: str = "live server") -> SwarmUnavailableError:
        """The one message of every wait for servers that ran out of patience: which blocks, how long, what to do."""
        return cls(
            f"blocks {blocks} have had no {what} for {seconds:.0f}s; start a peer serving them (swarm peer --model "
            f"... --blocks {blocks[0]}:{blocks[-1] + 1}) or raise the client's patience (from_pretrained(..., "
            "patience=...))"
        )


class AdapterStateLostError(SwarmError, RuntimeError):
    """No live peer holds some blocks of an adapter at its committed step (and ``resume="latest"`` was not given)."""


class AdapterBusyError(SwarmError, RuntimeError):
    """Another trainer holds the adapter's lease."""


class LeaseLostError(SwarmError, RuntimeError):
    """Another trainer session claimed the adapter; this client must stop training it."""


class CommitError(SwarmError, RuntimeError):
    """A step could not be committed on every block."""


class ReplicasDisagreeError(CommitError):
    """Two replicas of a block applied the same step to different states and no third copy could break the tie: the
    step was taken back on both and not acknowledged. ``peers``: the two; ``block``: the first block in dispute."""

    def __init__(self, block: int, step: int, peers: tuple[str, ...]):
        self.block, self.step, self.peers = block, step, peers
        super().__init__(
            f"replicas {' and '.join(peers)} of block {block} disagree on step {step} (their state digests differ) "
            "and no third copy can break the tie; the step was taken back on both and not acknowledged. Add a peer "
            "serving that block (or one keeping a standby copy: the client's min_copies) and call the optimizer "
            "step again, or stop the peer you do not trust and call it again; train with spot_check > 0 to catch "
            "dishonest peers earlier"
        )


class RemoteError(SwarmError, RuntimeError):
    """A peer refused a request; ``kind`` says which rule, the message says what to change."""

    def __init__(self, kind: str, message: str, meta: dict | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.meta = meta or {}


# --- refusals: what a peer answers to a request it will not serve (the peer keeps serving) ----------------------


class ErrorKind:
    """The ``kind`` of a refusal."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"
    STALE_STEP = "stale_step"
    UNKNOWN_ADAPTER = "unknown_adapter"
    MISSING_GRADIENTS = "missing_gradients"
    FENCED = "fenced"
    UNREACHABLE = "unreachable"  # a relay has no connection to the peer a request was for
    MISSING_FORWARD = "missing_forward"  # a backward without its input, and this peer no longer holds the forward
    MISSING_REFERENCE = "missing_reference"  # a change of activations from a reference this peer does not hold
    SESSION_LOST = "session_lost"  # a generation session this peer no longer holds (ended, idle, restarted)
    INFERENCE_MEMORY = "inference_memory"  # no room for another generation session (--max-inference-mb)
    SOURCE_UNAVAILABLE = "source_unavailable"  # the peer a sync was to pull from did not answer: pick another
    NOT_SERVED = "not_served"  # blocks this peer does not serve (any more: it moved, or restarted on other blocks)
    KEPT_INPUTS_FULL = "kept_inputs_full"  # the step's span inputs fill this peer's --kept-inputs-mb
    TOKENS_IN_FLIGHT = "tokens_in_flight"  # micro-batches between forward and backward here fill its bound
    BAD_GRADIENTS = "bad_gradients"  # gradients fetched at commit do not hash as their holder said: it is dishonest
    WEIGHTS_MISMATCH = "weights_mismatch"  # the adapter is pinned to base weights other than this peer's
    UNDELIVERED = "undelivered"  # a collect whose chain output this peer does not hold (not yet, expired, taken)


class RequestError(SwarmError, ValueError):
    """A request this peer refuses; the message says why. Travels back to the caller as ``kind`` + message."""

    kind = ErrorKind.BAD_REQUEST


class PayloadTooLargeError(RequestError):
    """A request carries more than its method allows (the doors' own limit, ``--max-payload-mb``, is far larger)."""

    kind = ErrorKind.TOO_LARGE


class StaleStepError(RequestError):
    """The peer holds these blocks at another step than the request's."""

    kind = ErrorKind.STALE_STEP


class UnknownAdapterError(RequestError):
    """The peer does not hold this adapter (it must be opened first)."""

    kind = ErrorKind.UNKNOWN_ADAPTER


class MissingForwardError(RequestError):
    """A backward sent without its input (the peer was to use its cached forward), which it no longer holds."""

    kind = ErrorKind.MISSING_FORWARD


class MissingReferenceError(RequestError):
    """Activations sent as a change from a reference this end does not hold (swarm.net.deltas): the sender forgets
    its reference and sends the value itself."""

    kind = ErrorKind.MISSING_REFERENCE


class MissingGradientsError(RequestError):
    """A commit names micro-batch gradients that this peer does not hold and could not fetch."""

    kind = ErrorKind.MISSING_GRADIENTS

    def __init__(self, message: str, missing: dict[int, list[str]]):
        super().__init__(message)
        self.missing = missing


class BadGradientsError(RequestError):
    """Micro-batch gradients fetched from their holders (``holders``, peer ids) do not hash as the ledger says those
    holders reported with their backwards: they handed on other gradients than they hold. Nothing was applied."""

    kind = ErrorKind.BAD_GRADIENTS

    def __init__(self, message: str, holders: list[str]):
        super().__init__(message)
        self.holders = holders


class SessionLostError(RequestError):
    """A generation request for a session this peer no longer holds; the client replays the prefix."""

    kind = ErrorKind.SESSION_LOST


class InferenceMemoryError(RequestError):
    """No room for another generation session within the peer's ``--max-inference-mb``."""

    kind = ErrorKind.INFERENCE_MEMORY


class NotServedError(RequestError):
    """Blocks this peer does not serve now; the client's view of it is stale, so it routes elsewhere."""

    kind = ErrorKind.NOT_SERVED


class KeptInputsFullError(RequestError):
    """The span inputs kept for the step in progress fill the peer's bound: the trainer commits more often or the
    peer gets more room."""

    kind = ErrorKind.KEPT_INPUTS_FULL


class TokensInFlightError(RequestError):
    """A training forward that would take this peer past its bound on tokens in flight (``--max-tokens-in-flight``:
    micro-batches forwarded here whose backward has not run). The peer is busy, not broken: the client routes the
    micro-batch to another replica or sends it again once some of its own came back."""

    kind = ErrorKind.TOKENS_IN_FLIGHT


class UndeliveredError(RequestError):
    """A ``collect`` for a chain output this peer does not hold: it was not computed here within the collect's wait,
    was kept past its hold, was taken already, or too many wait. The client treats the chain's last hop as lost."""

    kind = ErrorKind.UNDELIVERED


class SourceUnavailableError(RequestError):
    """A sync's source could not be reached or did not give the state: the asking peer is fine, the source is not."""

    kind = ErrorKind.SOURCE_UNAVAILABLE

    def __init__(self, message: str, source: str):
        super().__init__(message)
        self.source = source


class WeightsMismatchError(RequestError):
    """The adapter was trained on other base weights than this peer's (a look-alike model: same folder name, another
    fine-tune or revision): this peer serves it nothing."""

    kind = ErrorKind.WEIGHTS_MISMATCH


class FencedError(RequestError):
    """The adapter was claimed by a newer trainer session; this one must stop."""

    kind = ErrorKind.FENCED


# --- what may go wrong, by whose fault: the narrow excepts everyone uses -------------------------------------

# Failures of a peer or of the way to it (a dead or frozen peer, a broken stream, a garbled reply). Anything else
# raised while calling is a bug on this side, and surfaces instead of getting healthy peers banned.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # ConnectionError (PeerGoneError), TimeoutError
    asyncio.TimeoutError,
    asyncio.IncompleteReadError,
    EOFError,
    P2PDaemonError,
    P2PHandlerError,
    WireError,
    ReplyError,
)
# What a call to another peer raises for that peer's reasons: the way to it failed, or it refused.
PEER_ERRORS: tuple[type[BaseException], ...] = (*TRANSPORT_ERRORS, RemoteError)
# What parsing bytes from outside (msgpack, protobuf, serialized tensors) raises on garbage.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    RuntimeError,  # torch, on tensor bytes that do not fit their header
    DecodeError,
    UnpackException,
)
# A multiaddr that does not parse, or lacks the part asked for.
MULTIADDR_ERRORS: tuple[type[BaseException], ...] = (MultiaddrError, ValueError)
