"""A swarm on paper: where its spans go, what each link carries in a training step, and how long the step takes
against the same GPUs in one box (``scripts/plan_swarm.py`` prints it). Nothing here measures anything.

Every number comes from the code where the code has one: a peer's memory and its default span (swarm/memory.py),
the balancer's placement (peers/balancer.py), the wire format's bytes per value (swarm/net/compression.py), message
payloads (swarm/net/message.py), lanes (swarm/net/lanes.py), the client's micro-batches in flight
(swarm/client/routing.py) and the simulation's step model (swarm/testing/steps.py). The GPUs' speeds are not
measured: a stated table of peak dense bf16 tensor TFLOPS (NVIDIA's whitepapers) times an assumed utilisation. The
balancer's rules and the step model live above this module in the package layout (tests/unit/test_layout.py), so
callers hand them in as ``Rules``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from swarm.memory import Lora, ModelShape, lora_params, lora_tensors
from swarm.net.compression import WireFormat
from swarm.net.lanes import chunk_bytes
from swarm.net.message import payload_bytes
from swarm.net.reduction import MIN_REDUCERS

CONFIGS = Path(__file__).parent / "configs"  # config.json shapes of public models, no weights

# --- compute: a stated table, not a measurement ----------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """A GPU as the plan sees it: memory, and peak dense bf16 tensor TFLOPS with fp32 accumulate (what torch's bf16
    matmuls use), from the vendor's own table."""

    name: str
    memory_gib: float
    bf16_tflops: float
    source: str


GPUS = {
    "rtx3090": Gpu(
        "RTX 3090", 24, 71.0, "NVIDIA Ampere GA102 whitepaper, appendix A: peak BF16 tensor TFLOPS, FP32 accumulate"
    ),
    "rtx4090": Gpu(
        "RTX 4090", 24, 165.2, "NVIDIA Ada whitepaper, appendix A: peak BF16 tensor TFLOPS, FP32 accumulate"
    ),
    "a100-80gb": Gpu("A100 80GB", 80, 312.0, "NVIDIA A100 datasheet: BF16 tensor core, dense"),
}
# Assumed share of that peak an NF4 LoRA forward/backward reaches (bitsandbytes dequantizes every weight before its
# bf16 matmul, attention and norms run below peak). Not measured: no GPU was lent to the session that wrote this.
UTILISATION = 0.4
BACKWARD_COST = 2.0  # a backward costs two forwards: recompute + input gradients (step_seconds' default)


# --- compute and gradients of a block ----------------------------------------------------------------------


def block_grad_bytes(shape: ModelShape, lora: Lora) -> int:
    """One block's LoRA gradient on the wire (a partial sum, a micro-batch's gradient, a ``BlockUpdate``'s sum)."""
    return payload_bytes(lora_tensors(shape, lora))


def forward_flops_per_token(shape: ModelShape, lora: Lora, seq: int) -> float:
    """FLOPs of one block's forward per token: 2 x (weights + LoRA) for the matmuls, plus causal attention's scores
    and weighted sum (2 x seq x heads x head_dim: each token attends to seq/2 keys on average)."""
    return 2.0 * (shape.linear_params() + lora_params(shape, lora)) + 2.0 * seq * shape.heads * shape.head_dim


def block_forward_seconds(shape: ModelShape, lora: Lora, tokens: int, seq: int, gpu: Gpu, utilisation: float) -> float:
    """Seconds of one block's forward over ``tokens`` tokens on ``gpu`` at ``utilisation`` of its peak."""
    return forward_flops_per_token(shape, lora, seq) * tokens / (gpu.bf16_tflops * 1e12 * utilisation)


# --- placement: the balancer's own rules, handed in ------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """The swarm's decisions this module may not import (they live above it in the layout): peers/balancer.py
    ``choose_span``, ``next_move`` (with its ``Snapshot``) and ``choose_standby``."""

    choose_span: Callable
    next_move: Callable
    choose_standby: Callable
    snapshot: Callable


def peer_names(count: int) -> list[str]:
    return [f"gpu{i + 1}" for i in range(count)]


class LeftmostTies:
    """Breaks ``choose_span``'s ties toward the window that starts first: peers started one after another each take
    the first of the windows that help most, as an operator handing out ``--blocks`` would."""

    def choice(self, options: Sequence[range]) -> range:
        return options[0]


def place(
    rules: Rules, peers: Sequence[str], num_blocks: int, span_len: int, replication: int, seed: int | None = None
) -> dict[str, range]:
    """Spans as the swarm settles them: peers join one after another, each taking ``choose_span``'s window over
    the coverage of those before it (a joining peer counts where it goes), then balance rounds of ``next_move`` in id
    order until a whole round moves nobody. Ties go to the leftmost window, or (``seed``) are drawn at random, as a
    real start's are."""
    rng = LeftmostTies() if seed is None else random.Random(seed)
    spans: dict[str, range] = {}
    for peer in peers:
        coverage: dict[int, int] = {}
        throughput: dict[int, float] = {}  # equal GPUs: a span's throughput is 1 / its length, in any unit
        for span in spans.values():
            for b in span:
                coverage[b] = coverage.get(b, 0) + 1
                throughput[b] = throughput.get(b, 0.0) + 1 / len(span)
        spans[peer] = rules.choose_span(coverage, num_blocks, span_len, replication, throughput, rng)
    for _ in range(10 * len(peers)):
        moved = False
        for peer in sorted(spans):
            speeds = {p: 1 / len(s) for p, s in spans.items()}
            target = rules.next_move(rules.snapshot(spans, num_blocks, replication, speeds=speeds), peer, span_len)
            if target is not None and target != spans[peer]:
                spans[peer], moved = target, True
        if not moved:
            break
    return spans


Hop = tuple[str, range]  # a peer and the blocks it computes in a chain


def chains_of(spans: Mapping[str, range], num_blocks: int) -> list[list[Hop]]:
    """Disjoint chains over [0, num_blocks): each hop the unused span that starts at or before the chain's next
    block and reaches furthest (ties: the smaller id). What the micro-batches of a step are routed over; a span in
    no chain computes nothing here (it still holds state, takes part in the commit and copies)."""
    unused, chains = dict(spans), []
    while True:
        chain, at = [], 0
        while at < num_blocks:
            fits = sorted((-span.stop, peer) for peer, span in unused.items() if span.start <= at < span.stop)
            if not fits:
                return chains
            stop, peer = -fits[0][0], fits[0][1]
            chain.append((peer, range(at, stop)))
            del unused[peer]
            at = stop
        chains.append(chain)


def servers_of(spans: Mapping[str, range], num_blocks: int) -> list[list[str]]:
    return [sorted(p for p, s in spans.items() if b in s) for b in range(num_blocks)]


# --- links and bytes -------------------------------------------------------------------------------------------

YAMUX_WINDOW = 256 * 1024  # a libp2p stream's flow-control window (swarm/net/lanes.py): a round trip per fill
ACK_HOP_BYTES, ACK_BLOCK_BYTES = 256, 160  # estimates: a hop's ack; per block its gradient hash and norm parts
LEDGER_ENTRY_BYTES = 128  # estimate: a commit's (block, micro-batch) -> [holder, gradient hash]
CLIENT = "client"


@dataclass(frozen=True)
class Link:
    """A home connection: Mbit/s down and up. Every pair of parties is ``rtt_s`` apart (one figure for all)."""

    down_mbit: float
    up_mbit: float

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"100/20"``: 100 Mbit/s down, 20 up, as connections are sold."""
        down, _, up = text.partition("/")
        return cls(float(down), float(up or down))

    def __str__(self) -> str:
        return f"{self.down_mbit:g}/{self.up_mbit:g}"


def activation_bytes(
    shape: ModelShape, batch: int, seq: int, wire: WireFormat, dtype: torch.dtype, backward: bool = False
) -> int:
    """Hidden states (or, ``backward``, their gradient) of one micro-batch as the wire carries them
    (``WireFormat.value_bytes``); unpadded micro-batches send no mask."""
    return math.ceil(batch * seq * shape.hidden * wire.value_bytes(dtype, backward))


def lanes_of(payload: int) -> tuple[int, int]:
    """(lanes, bytes per lane) a message of ``payload`` bytes travels in (swarm/net/lanes.py)."""
    chunk = chunk_bytes(payload)
    return max(1, math.ceil(payload / chunk)), chunk


Resource = Hashable


class Stage(NamedTuple):
    """A step of one micro-batch's way: the resources it holds, for how long, the latency after, the bytes moved."""

    resources: tuple[Resource, ...]
    seconds: float
    delay: float = 0.0
    nbytes: float = 0.0


@dataclass
class Network:
    """Who sits behind which link, and what a transfer holds: the sender's uplink and the receiver's downlink for
    bytes / the slower of the two, then half a round trip (plus a round trip per extra window a lane's chunk needs,
    when the bytes alone do not cover it)."""

    links: Mapping[str, Link]
    rtt_s: float

    def rate(self, sender: str, receiver: str) -> float:
        """Bytes per second from one party to another."""
        return min(self.links[sender].up_mbit, self.links[receiver].down_mbit) * 1e6 / 8

    def transfer(self, sender: str, receiver: str, nbytes: float) -> Stage:
        busy = nbytes / self.rate(sender, receiver)
        _, chunk = lanes_of(int(nbytes))
        stall = max(0.0, (math.ceil(chunk / YAMUX_WINDOW) - 1) * self.rtt_s - busy)
        return Stage((("up", sender), ("down", receiver)), busy, self.rtt_s / 2 + stall, nbytes)


def compute(peer: str, seconds: float) -> Stage:
    return Stage((("gpu", peer),), seconds)


def chain_stages(
    chain: Sequence[Hop], block_s: float, act: int, net: Network, grad_act: int | None = None
) -> list[Stage]:
    """One micro-batch along a chain, as the client runs it chained (docs/ARCHITECTURE.md "One micro-batch"): in
    from the client, hop to hop, the last hop's output straight to the client (its collect) while the acks come
    back along the chain; the output gradient to the last hop, hop to hop back (the first span returns no input
    gradient), the acks back along the chain. ``act``: the hidden states' bytes; ``grad_act``: their gradient's
    (default: the same)."""
    grad_act = act if grad_act is None else grad_act
    peers = [peer for peer, _ in chain]
    fwd_s = [len(blocks) * block_s for _, blocks in chain]
    acks = [ACK_HOP_BYTES + ACK_BLOCK_BYTES * len(blocks) for _, blocks in chain]
    stages = [net.transfer(CLIENT, peers[0], act)]
    for i, peer in enumerate(peers):
        stages.append(compute(peer, fwd_s[i]))
        if i + 1 < len(peers):
            stages.append(net.transfer(peer, peers[i + 1], act))
    stages += output_stages(peers, acks, act, net)
    stages.append(net.transfer(CLIENT, peers[-1], grad_act))
    for i in range(len(peers) - 1, -1, -1):
        stages.append(compute(peers[i], BACKWARD_COST * fwd_s[i]))
        if i:
            stages.append(net.transfer(peers[i], peers[i - 1], grad_act))
    for i in range(len(peers)):  # the acks back to the client
        stages.append(net.transfer(peers[i], peers[i + 1] if i + 1 < len(peers) else CLIENT, sum(acks[: i + 1])))
    return stages


def output_stages(peers: Sequence[str], acks: Sequence[float], act: int, net: Network) -> list[Stage]:
    """A chain's output to the client: straight from its last hop (the collect), while the acks come back along
    the chain; the forward is done when the later of the two is in. The acks' transfers hold their links for their
    bytes, and their latency counts only where it outlasts the output's. A chain of one hop answers with its output
    and ack together."""
    back = [net.transfer(peers[i], peers[i - 1] if i else CLIENT, sum(acks[i:])) for i in reversed(range(len(peers)))]
    if len(peers) == 1:
        return [net.transfer(peers[0], CLIENT, act + acks[0])]
    output = net.transfer(peers[-1], CLIENT, act)
    acks_in = sum(stage.seconds + stage.delay for stage in back)
    output_in = output.seconds + output.delay + sum(stage.seconds for stage in back)
    return [output, *(stage._replace(delay=0.0) for stage in back), Stage((), 0.0, max(0.0, acks_in - output_in))]


def play_step(
    stages_of: Callable[[int, float], Sequence[Stage]], micro_batches: int, in_flight: int
) -> tuple[float, dict[Resource, float]]:
    """(seconds of the step, seconds each resource was busy): micro-batches pipelined over their stages, as the
    client runs them (swarm.client.pipeline). ``stages_of(index, at)``: the way of the micro-batch started at time
    ``at`` (routed then, seeing the work routed before); a stage may hold several resources (a transfer: a sender's
    uplink and a receiver's downlink) and add latency. At most ``in_flight`` micro-batches at once, the next started
    when one finishes; a resource serves stages in the order they reach it. swarm/testing/steps.py's
    ``step_seconds`` is this with compute stages only."""
    if micro_batches < 1 or in_flight < 1:
        raise ValueError(f"need at least one micro-batch and one in flight, got {micro_batches} and {in_flight}")
    free: dict[Resource, float] = {}
    busy: dict[Resource, float] = {}
    order = itertools.count()
    events: list[tuple[float, int, int, int]] = []
    stages: dict[int, Sequence[Stage]] = {}
    started, finished = 0, 0.0

    def start(at: float) -> None:
        nonlocal started
        stages[started] = stages_of(started, at)
        heapq.heappush(events, (at, next(order), started, 0))
        started += 1

    for _ in range(min(in_flight, micro_batches)):
        start(0.0)
    while events:
        at, _, micro_batch, index = heapq.heappop(events)
        if index == len(stages[micro_batch]):
            finished = max(finished, at)
            if started < micro_batches:
                start(at)
            continue
        resources, seconds, delay, _ = stages[micro_batch][index]
        done = max([at, *(free.get(r, 0.0) for r in resources)]) + seconds
        for r in resources:
            free[r] = done
            busy[r] = busy.get(r, 0.0) + seconds
        heapq.heappush(events, (done + delay, next(order), micro_batch, index + 1))
    return finished, busy


# --- the commit: reduction, copies, standby --------------------------------------------------------------------


@dataclass
class Exchange:
    """Bytes a phase moves, per peer and direction, and the round trips it waits."""

    up: dict[str, float] = field(default_factory=dict)
    down: dict[str, float] = field(default_factory=dict)
    round_trips: float = 0.0

    def add(self, sender: str, receiver: str, nbytes: float) -> None:
        self.up[sender] = self.up.get(sender, 0.0) + nbytes
        self.down[receiver] = self.down.get(receiver, 0.0) + nbytes

    def seconds(self, net: Network) -> float:
        """Every transfer of the phase at once: the busiest link direction's bytes, plus its round trips."""
        if not self.up and not self.down:
            return 0.0
        links = net.links
        worst = max(
            [b * 8 / (links[p].up_mbit * 1e6) for p, b in self.up.items()]
            + [b * 8 / (links[p].down_mbit * 1e6) for p, b in self.down.items()]
        )
        return worst + self.round_trips * net.rtt_s


def holders_of(chains: Sequence[Sequence[Hop]], micro_batches: int, num_blocks: int) -> list[dict[str, int]]:
    """Per block, how many of the step's micro-batches each peer computed (micro-batch i on chain i mod chains)."""
    runs = [len(range(c, micro_batches, len(chains))) for c in range(len(chains))]
    holders: list[dict[str, int]] = [{} for _ in range(num_blocks)]
    for chain, count in zip(chains, runs, strict=True):
        for peer, blocks in chain:
            for b in blocks:
                holders[b][peer] = holders[b].get(peer, 0) + count
    return holders


def reduction(
    servers: Sequence[Sequence[str]],
    holders: Sequence[Mapping[str, int]],
    grad: Sequence[float],
    mode: str,
    clipped: bool = False,
) -> Exchange:
    """What the commit's gradient fetch moves: every replica of a block fetches, from every other holder of the
    block's micro-batches, its partial sum (``after``: one gradient, however many micro-batches it ran) or each of
    its micro-batches' gradients (``before``: the per-micro-batch exchange, M(R-1)/R gradients a replica).
    ``clipped``: the norm's holder fetched them already (``clip_fetch``)."""
    if mode not in ("before", "after"):
        raise ValueError(f"mode must be before or after, got {mode!r}")
    phase = Exchange(round_trips=1.0)  # the grads request and its streamed reply
    for b, replicas in enumerate(servers):
        if mode == "after" and len(replicas) >= MIN_REDUCERS:
            if not (clipped and len(holders[b]) > 1):  # clipping reduced it already (``clip_fetch``)
                _chunked(phase, replicas, holders[b], grad[b])
            continue
        for replica in replicas:
            if clipped and replica == norm_holder(holders[b]):
                continue
            for holder, count in holders[b].items():
                if holder != replica and count:
                    phase.add(holder, replica, grad[b] * (1 if mode == "after" else count))
    return phase


def _chunked(phase: Exchange, replicas: Sequence[str], counts: Mapping[str, int], grad: float) -> None:
    """peers/reduction/scatter.py: each of a block's R replicas reduces one chunk (a gradient / R) of every holder's
    partial sum, then fetches the other chunks from their reducers: two rounds."""
    share = grad / len(replicas)
    for reducer in replicas:
        for holder, count in counts.items():
            if holder != reducer and count:
                phase.add(holder, reducer, share)
        for other in replicas:
            if other != reducer:
                phase.add(reducer, other, share)
    phase.round_trips = 2.0


def norm_holder(counts: Mapping[str, int]) -> str | None:
    """The replica the client asks for a block's share of the gradient norm when the block's micro-batches are
    spread over several (swarm/client/clipping.py): the one holding most of them; None when one holds them all."""
    return max(sorted(counts), key=counts.__getitem__) if len(counts) > 1 else None


def clip_fetch(
    holders: Sequence[Mapping[str, int]],
    grad: Sequence[float],
    mode: str,
    servers: Sequence[Sequence[str]] | None = None,
) -> Exchange:
    """Global clipping: the norm's holder fetches the other holders' gradients first (``norms``, like a commit);
    the commit then finds them there. A block of ``MIN_REDUCERS`` replicas or more (``servers``) is reduced in
    chunks by all of them at this point instead."""
    phase = Exchange(round_trips=2.0)  # the client's norms request, the holder's grads request
    for b, counts in enumerate(holders):
        if mode == "after" and servers is not None and len(servers[b]) >= MIN_REDUCERS and len(counts) > 1:
            _chunked(phase, servers[b], counts, grad[b])  # every replica is asked: they reduce it together
            phase.round_trips = 3.0
            continue
        chosen = norm_holder(counts)
        for holder, count in counts.items():
            if chosen is not None and holder != chosen and count:
                phase.add(holder, chosen, grad[b] * (1 if mode == "after" else count))
    return phase


def durable_copies(
    servers: Sequence[Sequence[str]], peers: Sequence[str], grad: Sequence[float], min_copies: int
) -> Exchange:
    """swarm/client/copies.py: before a step returns, every block held by fewer than ``min_copies`` replicas gets
    standby holders (sticky: one step behind, so they pull the last update, about one gradient a block)."""
    phase, load = Exchange(round_trips=2.0), dict.fromkeys(peers, 0.0)  # replicate, then the holder's export
    for b, replicas in enumerate(servers):
        if not replicas:
            continue
        for n in range(max(0, min_copies - len(replicas))):
            candidates = [p for p in peers if p not in replicas]
            if not candidates:
                break
            holder = min(candidates, key=lambda p: (load[p], p))
            load[holder] += grad[b]
            phase.add(replicas[n % len(replicas)], holder, grad[b])
    return phase


def standby_pulls(
    rules: Rules, spans: Mapping[str, range], num_blocks: int, grad: Sequence[float], count: int | None = None
) -> Exchange:
    """The background refresh after each commit (peers/replication.py): each peer keeps ``--standby-blocks`` (default
    its span's length) copies of the blocks with fewest holders, and pulls each one's last update from a server
    (taken here as spread evenly over the block's servers)."""
    holders = [0] * num_blocks
    for span in spans.values():
        for b in span:
            holders[b] += 1
    servers = servers_of(spans, num_blocks)
    phase = Exchange(round_trips=1.0)
    for peer in sorted(spans):
        others = {b: holders[b] - (b in spans[peer]) for b in range(num_blocks)}
        chosen = rules.choose_standby(others, spans[peer], num_blocks, len(spans[peer]) if count is None else count)
        for b in chosen:
            holders[b] += 1
            for server in servers[b]:
                phase.add(server, peer, grad[b] / len(servers[b]))
    return phase


# --- a step --------------------------------------------------------------------------------------------------


@dataclass
class StepPlan:
    """A step's time and its parts, in seconds; bytes per party and direction."""

    mode: str
    pipeline: float  # forward and backward of every micro-batch, with their transfers
    clip: float
    commit: float  # the client's commit request, the gradient fetch
    copies: float  # durable acks
    link_bound: float  # the busiest link direction's seconds of transfers per step, standby pulls included
    busiest: str
    one_box: float
    up: dict[str, dict[str, float]]  # party -> what -> bytes sent per step
    down: dict[str, dict[str, float]]

    @property
    def critical(self) -> float:
        return self.pipeline + self.clip + self.commit + self.copies

    @property
    def step(self) -> float:
        return max(self.critical, self.link_bound)

    @property
    def ratio(self) -> float:
        """Throughput of the swarm against one box: one box's step over the swarm's."""
        return self.one_box / self.step


def in_flight_for(servers: int) -> int:
    """swarm/client/routing.py ``Router.in_flight``: two per live server, 4 to 32."""
    return max(4, min(32, 2 * servers))


def one_box_seconds(chains: Sequence[Sequence[Hop]], block_s: float, micro_batches: int, in_flight: int) -> float:
    """The same GPUs in one machine: the same spans and chains, transfers and the reduction free (NVLink or PCIe
    against home links), compute stages only."""

    def stages(index: int, _at: float) -> list[Stage]:
        chain = [(peer, len(blocks) * block_s) for peer, blocks in chains[index % len(chains)]]
        forward = [compute(peer, seconds) for peer, seconds in chain]
        return forward + [compute(peer, BACKWARD_COST * seconds) for peer, seconds in reversed(chain)]

    return play_step(stages, micro_batches, in_flight)[0]


def plan_step(
    rules: Rules,
    spans: Mapping[str, range],
    chains: Sequence[Sequence[Hop]],
    num_blocks: int,
    block_s: float,
    act: int,
    grad: Sequence[float],
    net: Network,
    micro_batches: int,
    in_flight: int,
    mode: str,
    min_copies: int = 2,
    clip: bool = False,
    standby: int | None = None,
    grad_act: int | None = None,
) -> StepPlan:
    """Play a step: the pipeline with its transfers, then (nothing overlaps it yet: docs/ARCHITECTURE.md "One
    reduction per step") the optional clipping fetch, the commit's reduction and the durable copies, one after
    another. Standby pulls run in the background during the next step and count only through the link bound."""
    if not chains:
        raise ValueError("no chain covers the model: nothing to train")
    routed = [chain_stages(chains[i % len(chains)], block_s, act, net, grad_act) for i in range(micro_batches)]
    pipeline, _ = play_step(lambda index, _at: routed[index], micro_batches, in_flight)
    servers = servers_of(spans, num_blocks)
    holders = holders_of(chains, micro_batches, num_blocks)
    up, down = _activation_bytes(routed, [CLIENT, *sorted(spans)])

    clip_s = 0.0
    if clip:
        fetch = clip_fetch(holders, grad, mode, servers)
        clip_s = fetch.seconds(net)
        _count(up, down, fetch, "reduction")
    ledger = Exchange(round_trips=1.0)  # the commit request, to every replica at once, and its reply
    for peer, span in spans.items():
        ledger.add(CLIENT, peer, LEDGER_ENTRY_BYTES * len(span) * micro_batches)
    fetch = reduction(servers, holders, grad, mode, clipped=clip)
    commit_s = ledger.seconds(net) + fetch.seconds(net)
    _count(up, down, ledger, "ledger")
    _count(up, down, fetch, "reduction")
    copies = durable_copies(servers, sorted(spans), grad, min_copies)
    copies_s = copies.seconds(net)
    _count(up, down, copies, "copies")
    _count(up, down, standby_pulls(rules, spans, num_blocks, grad, standby), "standby")

    link_seconds = _link_seconds(up, down, net)
    busiest = max(link_seconds, key=link_seconds.__getitem__)
    return StepPlan(
        mode=mode,
        pipeline=pipeline,
        clip=clip_s,
        commit=commit_s,
        copies=copies_s,
        link_bound=link_seconds[busiest],
        busiest=busiest,
        one_box=one_box_seconds(chains, block_s, micro_batches, in_flight),
        up=up,
        down=down,
    )


def _activation_bytes(
    routed: Sequence[Sequence[Stage]], parties: Sequence[str]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Bytes each party sends (up) and receives (down) for the step's activations and their gradients."""
    up: dict[str, dict[str, float]] = {p: {} for p in parties}
    down: dict[str, dict[str, float]] = {p: {} for p in parties}
    for stage in itertools.chain.from_iterable(routed):
        for kind, party in stage.resources:
            if kind in ("up", "down"):
                sent = (up if kind == "up" else down)[party]
                sent["activations"] = sent.get("activations", 0.0) + stage.nbytes
    return up, down


def _link_seconds(up: dict[str, dict[str, float]], down: dict[str, dict[str, float]], net: Network) -> dict[str, float]:
    """Seconds each party's link takes, each way, to carry what it sends and receives in a step."""
    link_seconds = {}
    for party in up:
        link = net.links[party]
        link_seconds[f"{party} up"] = sum(up[party].values()) * 8 / (link.up_mbit * 1e6)
        link_seconds[f"{party} down"] = sum(down[party].values()) * 8 / (link.down_mbit * 1e6)
    return link_seconds


def _count(up: dict, down: dict, phase: Exchange, what: str) -> None:
    for party, nbytes in phase.up.items():
        up[party][what] = up[party].get(what, 0.0) + nbytes
    for party, nbytes in phase.down.items():
        down[party][what] = down[party].get(what, 0.0) + nbytes
