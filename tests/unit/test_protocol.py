"""The protocol's registry: every method has a request and a reply schema that survive the wire, refuse what does
not fit, and match the handlers, the docs' method table and the code (no method name spelled outside protocol.py)."""

from __future__ import annotations

import ast
import math
import re
import typing
from dataclasses import MISSING, field, fields, is_dataclass, make_dataclass
from pathlib import Path

import pytest
import torch
from hivemind.p2p import PeerID

from peers.compute import Compute
from peers.service import PeerService
from swarm.net import protocol
from swarm.net.chain import ChainFailure, ChainHop, Delivery, HopAck, read_acks, write_acks
from swarm.net.deltas import DeltaBits, DeltaReferences, ReferenceKey
from swarm.net.errors import ErrorKind, MissingGradientsError, RemoteError, RequestError, SourceUnavailableError
from swarm.net.gradnorm import GradNorm
from swarm.net.message import Message
from swarm.net.protocol import METHODS, Method, ReplyError, read_reply, read_request
from swarm.net.servicer import Doorkeeper
from swarm.net.wire import decode, encode

ROOT = Path(__file__).resolve().parents[2]
PEER, OTHER = PeerID(b"p" * 8), PeerID(b"q" * 8)
HPARAMS = protocol.OptimizerHParams(1e-3, (0.9, 0.999), 1e-8, 0.01)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
HIDDEN, GRAD, MASK = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.int64)
ADAPTER = protocol.AdapterInfo(protocol.adapter_meta(LORA, 7), {0: 3, 1: 3}, {2: 2})
ROUTE = [ChainHop(OTHER.to_base58(), 2, 4, 3.5, ("/ip4/1.2.3.4/tcp/5",)), ChainHop(PEER.to_base58(), 4, 6, 2.0)]
ACKS = [
    HopAck(PEER.to_base58(), 0, 2, 0.25, (GradNorm(1, "c0ffee", 4.0, 1.5),), ((0, "ab" * 32), (1, "cd" * 32))),
    HopAck(OTHER.to_base58(), 2, 4, 0.5),
    HopAck(OTHER.to_base58(), 4, 6, 0.75, compute=0.125),
]
BROKEN = ChainFailure(PEER.to_base58(), "timeout", "no answer in 3.5 s")

EXAMPLES: dict[str, tuple[protocol.Request, protocol.Reply]] = {
    Method.HELLO: (protocol.HelloRequest(), protocol.HelloReply(True, "key-id")),
    Method.INFO: (
        protocol.InfoRequest(),
        protocol.PeerInfo("tiny", 0, 2, "online", 12.5, {"run": ADAPTER}, [2, 3], "none/float32"),
    ),
    Method.PING: (
        protocol.PingRequest(payload=torch.randint(0, 256, (300,), dtype=torch.uint8)),
        protocol.PingReply(300),
    ),
    Method.OPEN: (
        protocol.OpenRequest(adapter="run", lora=LORA, seed=7, session="s1"),
        protocol.OpenReply({0: 3}, {2: 2}),
    ),
    Method.FORWARD: (
        protocol.ForwardRequest(
            adapter="run",
            start=0,
            end=2,
            step=3,
            hidden=HIDDEN,
            mask=MASK,
            micro_batch="mb-0",
            route=ROUTE,
            deliver=Delivery("tok-1", 12.5),
        ),
        protocol.HiddenReply(HIDDEN, acks=ACKS, failure=BROKEN),
    ),
    Method.COLLECT: (
        protocol.CollectRequest(token="tok-1", wait=12.5, reply_bytes=HIDDEN.numel() * 4),
        protocol.CollectReply(HIDDEN),
    ),
    Method.BACKWARD: (
        protocol.BackwardRequest(
            adapter="run",
            start=0,
            end=2,
            step=3,
            micro_batch="mb-0",
            grad=GRAD,
            hidden=HIDDEN,
            mask=MASK,
            input_grad=False,
            compression="none",
            route=ROUTE,
        ),
        protocol.GradReply(GRAD, acks=ACKS[::-1], failure=BROKEN),
    ),
    Method.COMMIT: (
        protocol.CommitRequest(
            adapter="run",
            step=3,
            ledger={0: {"mb-0": protocol.Held(PEER.to_base58(), "ab" * 32), "mb-1": protocol.Held(OTHER.to_base58())}},
            hparams=HPARAMS,
            fetch_timeout=2.5,
            grad_scale=0.25,
            holder_maddrs={OTHER.to_base58(): ["/ip4/127.0.0.1/tcp/4001"]},
        ),
        protocol.CommitReply({0: 4}, {0: "ab12"}),
    ),
    Method.NORMS: (
        protocol.NormsRequest(
            adapter="run", step=3, ledger={0: {"mb-0": protocol.Held(PEER.to_base58(), "ef" * 32)}}, norm_type=1.0
        ),
        protocol.NormsReply({0: 2.5, 1: math.inf}),
    ),
    Method.REVERT: (protocol.RevertRequest(adapter="run", step=3), protocol.StepsReply({0: 3})),
    Method.GRADS: (
        protocol.GradsRequest(adapter="run", step=3, wanted={0: ["mb-0", "mb-1"]}),
        protocol.GradsReply({0: {"mb-0": [GRAD, HIDDEN], "mb-1": [GRAD]}}),
    ),
    Method.EXPORT: (
        protocol.ExportRequest(adapter="run", start=0, end=2, held={0: 2}, watcher=OTHER),
        protocol.ExportReply(
            index=[[1, 3, "q", "a", [2], "float32"]],
            update_index=[],
            hparams={0: HPARAMS},
            bases={0: "ab" * 32},
            afters={0: "cd" * 32},
            states=torch.randn(2),
            updates=torch.zeros(0),
        ),
    ),
    Method.SYNC: (protocol.SyncRequest(adapter="run", source=OTHER, start=0, end=2), protocol.StepsReply({0: 3, 1: 3})),
    Method.STATE: (
        protocol.StateRequest(adapter="run"),
        protocol.StateReply({0: {"q.lora_A": GRAD}, 1: {"q.lora_B": HIDDEN}}),
    ),
    Method.DIGEST: (protocol.DigestRequest(adapter="run"), protocol.DigestReply({0: "ab12", 1: "cd34"})),
    Method.TIEBREAK: (
        protocol.TieBreakRequest(
            adapter="run",
            step=3,
            ledger={0: {"mb-0": protocol.Held(PEER.to_base58(), "cd" * 32)}},
            hparams=HPARAMS,
            grad_scale=0.5,
        ),
        protocol.DigestReply({0: "ab12"}),
    ),
    Method.FAST_FORWARD: (
        protocol.FastForwardRequest(adapter="run", step=5, start=1, end=2),
        protocol.FastForwardReply({1: 5}, {1: 2}),
    ),
    Method.COMMITTED: (
        protocol.CommittedRequest(adapter="run", lora=LORA, seed=7, steps={0: 4}, source=OTHER),
        protocol.Ack(),
    ),
    Method.UNSERVED: (protocol.UnservedRequest(model="tiny-llama", blocks=[0, 1, 2]), protocol.Ack()),
    Method.REPLICATE: (
        protocol.ReplicateRequest(
            adapter="run", lora=LORA, seed=7, step=4, sources=[(range(0, 2), PEER), (range(2, 3), OTHER)]
        ),
        protocol.StepsReply({0: 4, 1: 4, 2: 4}),
    ),
    Method.REACHABLE: (
        protocol.ReachableRequest(peer=PEER, maddrs=["/ip4/1.2.3.4/tcp/5"]),
        protocol.ReachableReply(False, "timed out"),
    ),
    Method.INFER: (
        protocol.InferRequest(
            session="s1",
            start=0,
            end=2,
            position=4,
            max_length=16,
            hidden=HIDDEN,
            mask=MASK,
            adapter="run",
            step=3,
            compression="none",
            route=ROUTE,
            autocast="bfloat16",
        ),
        protocol.HiddenReply(HIDDEN),
    ),
    Method.END_SESSION: (protocol.EndSessionRequest(session="s1"), protocol.EndSessionReply(True)),
}


def through_the_wire(message: Message) -> Message:
    """What the other side reads: msgpack turns block keys into strings, tuples into lists."""
    return decode(encode(message))


def same(a: object, b: object) -> bool:
    """Equal, tensors compared by value (dataclass equality skips tensor fields)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    return a == b


def test_every_method_has_an_example():
    assert set(EXAMPLES) == set(METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_requests_and_replies_survive_the_wire(method):
    request, reply = EXAMPLES[method]
    spec = METHODS[method]
    assert type(request) is spec.request and type(reply) is spec.reply and request.method == method
    received = read_request(through_the_wire(request.to_message()))
    assert same(received, request), (received, request)
    answered = read_reply(request, through_the_wire(reply.to_message()))
    assert same(answered, reply), (answered, reply)


def test_every_request_is_built_by_keyword_only():
    """A request built by position binds its values to whatever fields come first: inserting or reordering a field
    would shift them silently (an end for a step, a mask for a micro-batch). Keyword-only fields make such a
    construction a TypeError, so a field's place in the class carries no meaning."""
    classes = {c for c in vars(protocol).values() if isinstance(c, type) and issubclass(c, protocol.Request)}
    classes = {c for c in classes if is_dataclass(c)}  # not the bases Request and HiddenRequest
    assert {spec.request for spec in METHODS.values()} <= classes
    by_position = {cls for cls in classes if not all(f.kw_only for f in fields(cls) if f.init)}
    assert by_position == set()
    for request, _ in EXAMPLES.values():
        values = [getattr(request, f.name) for f in fields(request) if f.init]
        if values:
            with pytest.raises(TypeError, match="positional"):
                type(request)(*values)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_request_declared_with_its_fields_in_another_order_sends_the_same_message(method):
    """The wire names every field (its meta key is its name): the same request, its fields declared in reverse,
    sends the same metadata and, with the original's tensors (and the keys that lay them out), reads back as the
    original."""
    request, _ = EXAMPLES[method]
    cls = type(request)
    wire_fields = _wire_fields(cls)
    reordered = make_dataclass(
        f"Reordered{cls.__name__}",
        [(f.name, f.type, field(metadata=f.metadata)) for f in reversed(wire_fields)],
        bases=(protocol.Request,),
        namespace={"method": cls.method},
        frozen=True,
        kw_only=True,
    )
    rebuilt = reordered(**{f.name: getattr(request, f.name) for f in wire_fields})
    assert [f.name for f in fields(rebuilt)] == [f.name for f in reversed(wire_fields)]
    assert rebuilt.to_meta() == request.to_meta()
    message = request.to_message()
    layout = {key: value for key, value in message.meta.items() if key not in rebuilt.to_meta()}
    received = read_request(through_the_wire(Message({**rebuilt.to_meta(), **layout}, message.tensors)))
    assert same(received, request), (received, request)


def _wire_fields(cls: type) -> list:
    return [f for f in fields(cls) if "read" in f.metadata]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_field_of_the_wrong_type_is_refused(method):
    """Bytes fit no field of any schema: each field in turn is refused by name."""
    request, reply = EXAMPLES[method]
    for f in _wire_fields(type(request)):
        message = request.to_message()
        with pytest.raises(RequestError, match=f.name):
            read_request(Message({**message.meta, f.name: b"\x00"}, message.tensors))
    for f in _wire_fields(type(reply)):
        message = reply.to_message()
        with pytest.raises(ReplyError, match=f"malformed {method} reply"):
            read_reply(request, Message({**message.meta, f.name: b"\x00"}, message.tensors))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_missing_field_is_refused(method):
    request, reply = EXAMPLES[method]
    for f in _wire_fields(type(request)):
        message = request.to_message()
        optional_field = f.default is None or f.default_factory is not MISSING  # null, or empty (a route)
        defaulted = ("fetch_timeout", "compression", "input_grad", "relayed", "grad_scale", "norm_type", "reply_bytes")
        if optional_field or f.name in defaulted:
            continue  # may be left out: null, empty, or a default the schema documents
        meta = {k: v for k, v in message.meta.items() if k != f.name}
        with pytest.raises(RequestError, match=f.name):
            read_request(Message(meta, message.tensors))
    for f in _wire_fields(type(reply)):
        message = reply.to_message()
        if f.default is None or f.default_factory is not MISSING:
            continue
        meta = {k: v for k, v in message.meta.items() if k != f.name}
        with pytest.raises(ReplyError):
            read_reply(request, Message(meta, message.tensors))


def test_tensors_must_match_what_the_metadata_announces():
    forward, _ = EXAMPLES[Method.FORWARD]
    message = forward.to_message()
    with pytest.raises(RequestError, match="expected 2 tensors, got 1"):
        read_request(Message(message.meta, message.tensors[:1]))
    with pytest.raises(RequestError, match="attention_mask must be integer or bool"):
        read_request(Message(message.meta, [HIDDEN, MASK.float()]))
    lossy = protocol.ForwardRequest(
        adapter="run", start=0, end=2, step=3, hidden=HIDDEN, compression="blockwise8"
    )  # the reply's encoding
    assert read_request(through_the_wire(lossy.to_message())).compression == "blockwise8"
    cached = protocol.BackwardRequest(
        adapter="run", start=0, end=2, step=3, micro_batch="mb-0", grad=GRAD
    )  # no hidden states: the peer has them
    assert read_request(cached.to_message()).hidden is None
    with pytest.raises(ReplyError, match="expected 0 or 1 tensors, got 2"):  # none: handed to a collect
        read_reply(forward, Message({}, [HIDDEN, HIDDEN]))
    with pytest.raises(ReplyError, match="expected 1 tensors, got 0"):
        read_reply(EXAMPLES[Method.COLLECT][0], Message({}, []))
    grads, reply = EXAMPLES[Method.GRADS]
    with pytest.raises(ReplyError, match="expected 3 tensors"):
        read_reply(grads, Message(reply.to_message().meta, [GRAD]))


def test_a_ping_carries_a_bounded_payload_of_bytes():
    assert read_request(through_the_wire(protocol.PingRequest().to_message())).payload is None
    largest = protocol.PingRequest(payload=torch.zeros(protocol.MAX_PING_BYTES, dtype=torch.uint8))
    assert read_request(through_the_wire(largest.to_message())).payload.numel() == protocol.MAX_PING_BYTES
    oversized = protocol.PingRequest(payload=torch.zeros(protocol.MAX_PING_BYTES + 1, dtype=torch.uint8))
    with pytest.raises(RequestError, match="at most") as refused:
        read_request(through_the_wire(oversized.to_message()))
    assert refused.value.kind == ErrorKind.TOO_LARGE
    for payload in (torch.zeros(8), torch.zeros(2, 4, dtype=torch.uint8)):
        with pytest.raises(RequestError, match="1-D uint8"):
            read_request(Message({protocol.METHOD: Method.PING}, [payload]))
    with pytest.raises(RequestError, match="expected 0 or 1 tensors"):
        read_request(Message({protocol.METHOD: Method.PING}, [torch.zeros(1, dtype=torch.uint8)] * 2))


def test_unknown_methods_and_odd_values_are_refused():
    for method in ("x", 7, None):
        with pytest.raises(RequestError, match="unknown method"):
            read_request(Message({protocol.METHOD: method}, []))
    replicate, _ = EXAMPLES[Method.REPLICATE]
    meta = replicate.to_meta()
    for sources in ([], [[0, 2]], [[2, 2, PEER.to_base58()]], [[0, 2, "0"]], [[True, 2, PEER.to_base58()]]):
        with pytest.raises(RequestError, match="sources"):
            read_request(Message({**meta, "sources": sources}, []))
    with pytest.raises(RequestError, match="maddrs"):  # a direct question must name where to dial
        read_request(protocol.ReachableRequest(peer=PEER).to_message())
    assert read_request(protocol.ReachableRequest(peer=PEER, relayed=True).to_message()).relayed
    with pytest.raises(RequestError, match="adapter name"):
        read_request(protocol.StateRequest(adapter="../etc").to_message())
    with pytest.raises(RequestError, match="ledger"):
        read_request(protocol.CommitRequest(adapter="run", step=3, ledger={}, hparams=HPARAMS).to_message())
    commit, _ = EXAMPLES[Method.COMMIT]
    for holder_maddrs in ({"not-a-peer": []}, {PEER.to_base58(): "/ip4/127.0.0.1"}, [PEER.to_base58()]):
        with pytest.raises(RequestError, match="holder_maddrs"):
            read_request(Message({**commit.to_meta(), "holder_maddrs": holder_maddrs}, []))


def test_refusals_carry_what_the_caller_acts_on():
    missing = protocol.refusal(MissingGradientsError("lost", {3: ["mb-1"]}))
    error = pytest.raises(RemoteError, protocol.raise_if_error, through_the_wire(missing)).value
    assert error.kind == ErrorKind.MISSING_GRADIENTS and protocol.missing_gradients(error) == {3: ["mb-1"]}
    source = protocol.refusal(SourceUnavailableError("gone", PEER.to_base58()))
    assert source.meta[protocol.SOURCE] == PEER.to_base58()
    with pytest.raises(ReplyError):
        protocol.missing_gradients(RemoteError(ErrorKind.MISSING_GRADIENTS, "lost", {protocol.MISSING: "x"}))


def _handlers() -> dict:
    door, compute = Doorkeeper(), Compute()
    service = PeerService(
        backend=None, adapters=None, compute=compute, info=lambda: None, peers=None, hooks=None, pullers=None
    )
    try:
        return {"doorkeeper": door.handlers, "peer": service.handlers}
    finally:
        compute.shutdown()


def test_the_registry_covers_every_method_and_every_handler_takes_and_returns_its_schemas():
    names = {value for key, value in vars(Method).items() if key.isupper()}
    assert names == set(METHODS)
    handlers = _handlers()
    assert set(handlers["peer"]) == set(METHODS)  # a peer answers every method
    for handler_set in handlers.values():
        for method, handler in handler_set.items():
            hints = typing.get_type_hints(handler)
            assert hints["request"] is METHODS[method].request, method
            assert hints["return"] is METHODS[method].reply, method


def documented_methods() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Protocol", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("|")]
    return [m.group(1) for cell in rows if (m := re.fullmatch(r"`(\w+)`", cell))]


def test_the_docs_method_table_lists_exactly_the_registry():
    documented = documented_methods()
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == set(METHODS)


# Literals that happen to equal a method name and mean something else: a DHT record's field and kind, a resume mode.
NOT_METHODS = {
    "swarm/net/records.py": {Method.STATE, Method.COMMITTED},
    "swarm/client/config.py": {Method.COMMITTED},  # resume="committed", a mode of from_pretrained
    "swarm/client/model.py": {Method.COMMITTED},  # resume="committed", a mode of from_pretrained
    "swarm/client/session.py": {Method.COMMITTED},  # the same mode, and the committed record
}


def test_no_method_name_is_spelled_outside_the_protocol_module():
    names = {value for key, value in vars(Method).items() if key.isupper()}
    found = []
    for path in sorted([*(ROOT / "swarm").rglob("*.py"), *(ROOT / "peers").rglob("*.py")]):
        if path == ROOT / "swarm" / "net" / "protocol.py":
            continue
        spelled = names - NOT_METHODS.get(str(path.relative_to(ROOT)), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in spelled:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "use swarm.net.protocol.Method (or a request class) instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "hop",
    [
        ["peer", 2, 2, 1.0, []],  # an empty block range
        ["peer", -1, 2, 1.0, []],
        ["peer", 0, 2, 0, []],  # no time at all
        ["peer", 0, 2, float("inf"), []],
        ["peer", 0, 2, 1.0, ["/ip4/1.2.3.4/tcp/5"] * 9],  # more addresses than a hop may name
        ["", 0, 2, 1.0, []],
        ["peer", 0, 2, 1.0],  # a field short
    ],
)
def test_a_route_with_a_bad_hop_is_refused(hop):
    forward, _ = EXAMPLES[Method.FORWARD]
    message = forward.to_message()
    with pytest.raises(RequestError, match="route"):
        read_request(Message({**message.meta, "route": [hop]}, message.tensors))


def test_a_route_longer_than_any_model_is_refused():
    forward, _ = EXAMPLES[Method.FORWARD]
    message = forward.to_message()
    hops = [[PEER.to_base58(), b, b + 1, 1.0, []] for b in range(300)]
    with pytest.raises(RequestError, match="at most"):
        read_request(Message({**message.meta, "route": hops}, message.tensors))


def test_a_chain_reply_with_a_garbled_failure_or_ack_is_the_peers_fault():
    forward, reply = EXAMPLES[Method.FORWARD]
    message = reply.to_message()
    for key, value in (("failure", ["peer", "timeout"]), ("acks", [["peer", 0, 2, -1.0]])):
        with pytest.raises(ReplyError, match="malformed forward reply"):
            read_reply(forward, Message({**message.meta, key: value}, message.tensors))


def test_an_ack_says_its_compute_time_apart_and_one_from_an_older_peer_reads_without_it():
    written = write_acks([HopAck(PEER.to_base58(), 0, 2, 0.5, compute=0.2)])
    assert read_acks({"acks": written}, "acks")[0].compute == 0.2
    older = read_acks({"acks": [written[0][:6]]}, "acks")[0]
    assert (older.seconds, older.compute) == (0.5, None)
    with pytest.raises(ValueError, match="not a duration"):
        read_acks({"acks": [[*written[0][:6], -1.0]]}, "acks")


def test_a_label_becomes_a_valid_adapter_name():
    assert protocol.adapter_name_from("home-chained-bfloat16+hadamard4/hadamard3") == (
        "home-chained-bfloat16-hadamard4-hadamard3"
    )
    assert protocol.adapter_name_from("wire-exact (fp32), adapter seed 1") == "wire-exact-fp32-adapter-seed-1"
    assert len(protocol.adapter_name_from("x" * 100)) == 64 and protocol.adapter_name_from("+++") == "adapter"


def test_hidden_states_as_a_delta_survive_the_wire_and_a_malformed_one_is_refused():
    references, key = DeltaReferences(), ReferenceKey(adapter="run", sample="ab" * 16, boundary=0, sent=True, peer="p")
    delta, _ = references.encode(key, HIDDEN, DeltaBits(4, 3))
    change, _ = references.encode(key, HIDDEN + 0.01, DeltaBits(4, 3))
    request = protocol.ForwardRequest(
        adapter="run",
        start=0,
        end=2,
        step=3,
        hidden=change,
        mask=MASK,
        micro_batch="mb-0",
        compression="hadamard4d3",
        route=ROUTE,
        sample="ab" * 16,
        have=change.base,
    )
    received = read_request(through_the_wire(request.to_message()))
    assert received.hidden == change and received.sample == "ab" * 16 and received.have == change.base
    assert received.compression == "hadamard4d3" and torch.equal(received.mask, MASK)
    reply = protocol.HiddenReply(delta, "hadamard4d3", acks=ACKS[:1])
    assert read_reply(request, through_the_wire(reply.to_message())).outputs == delta
    message = request.to_message()
    for header in ([b"x" * 3, 3, [2, 3, 8], "float32"], [None, 3, [2, 3, 100], "float32"], "delta"):
        with pytest.raises(RequestError, match="delta"):
            read_request(Message({**message.meta, "delta": header}, message.tensors))
    with pytest.raises(ReplyError, match="delta"):
        read_reply(request, Message({**reply.to_meta(), "delta": [None, 9, [2, 3, 8], "float32"]}, [HIDDEN]))
