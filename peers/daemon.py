"""The peer daemon: join the DHT, choose and load a span of blocks, serve it, keep announcing it, keep standby
copies and checkpoints of adapter state, move to where the swarm needs it, leave cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Protocol

import psutil
import torch
from hivemind.p2p import P2P, PeerID

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.balancer import badness, choose_span, coverage_with, safe_to_drop
from peers.behaviour import Behaviour
from peers.checkpoints import CheckpointStore, CheckpointWriter
from peers.claim import IN_USE_HINT, ProcessClaim, lock_path_of_checkpoints, lock_path_of_identity
from peers.compute import Compute
from peers.leaving import LeavingBlocks
from peers.links import LinkProber
from peers.movecost import MoveTimer
from peers.movelog import MoveLog
from peers.orphans import OrphanCheck
from peers.peer_client import PeerClient
from peers.placement import (
    Move,
    Placement,
    decide_move,
    movers,
    others_serving,
    planned_throughput,
)
from peers.pullers import RecentPullers
from peers.reduction.audit import AUDIT_RATE
from peers.replication import Replicator, StandbyPolicy
from peers.service import InfoDoors, PeerHooks, PeerService
from swarm.blocks import spans_text
from swarm.hub import resolve_model
from swarm.memory import DEFAULT_TOKENS, MemoryInputs, ModelShape, default_num_blocks, default_tokens_in_flight
from swarm.net.deltas import DeltaReferences
from swarm.net.errors import PEER_ERRORS, IdentityInUseError, SwarmAccessError
from swarm.net.network import check_access, join_dht, load_swarm_key
from swarm.net.numerics import Numerics
from swarm.net.protocol import AdapterInfo, CommittedRequest, MemoryUse, PeerInfo
from swarm.net.reachability import choose_relays, verify_relayed
from swarm.net.records import (
    RECORD_TTL,
    MoveCost,
    ServerRecord,
    ServerState,
    announce,
    announce_model,
    read_servers,
)
from swarm.net.security import Identity
from swarm.net.servicer import FaultHook
from swarm.net.suspects import suspect
from swarm.net.transport import Transport
from swarm.net.view import SwarmView, observe
from swarm.spec import ModelSpec, load_spec
from swarm.usage import tree_usage
from swarm.weights import block_digests

logger = logging.getLogger(__name__)

MIN_ROUND_GAP = 1.0  # seconds between the end of a balance round and one held early on a client's notice
ANNOUNCE_RETRY = 2.0  # seconds before announcing again after a DHT call timed out (records live RECORD_TTL, 30 s)
LEAVE_TIMEOUT = 20.0  # seconds past the leave grace after which a leaving peer exits whatever is stuck
DRAIN_TIMEOUT = 60.0  # seconds a move waits for the micro-batches in flight on the blocks it hands over
DRAIN_SEEN = 6.0  # ... at least: two of a client's view refreshes (swarm/client/routing.py), so it sees them leaving
DRAIN_QUIET = 10.0  # ... or, where no step commits, until no trainer sent work here for this long (its view refreshes
# every 3 s meanwhile; a trainer idle past a move's end would wait on it, as tests/e2e/test_durable.py's does)
DRAIN_POLL = 0.2


@dataclass
class PeerConfig:
    """Everything ``swarm peer`` is told on its command line."""

    model: str  # a model folder, or a hub id ORG/NAME[@REVISION] (swarm/hub.py)
    initial_peers: list[str]
    blocks: range | None = None
    num_blocks: int | None = None
    max_blocks: int | None = None
    throughput: float | None = None  # tokens/s through the span, announced as told instead of measured
    replication: int = 2
    rebalance: bool = True
    balance_interval: float = 5.0
    standby_blocks: int | None = None
    standby_every: int = 1
    audit_rate: float | None = None  # the share of fetched partial sums audited; None: reduction/audit.py's AUDIT_RATE
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    device: str = "cpu"
    quant: str | None = None
    dtype: str | None = None  # the blocks' compute dtype; None: ``default_dtype`` of the device
    host: str = "0.0.0.0"
    port: int = 0
    announce_maddrs: tuple[str, ...] = ()  # the only addresses to announce (a port forward, a public IP)
    relay: str = "auto"  # auto: through a relay only if not reachable from outside; always; never
    identity: str | None = None
    swarm_key: str | None = None
    record_ttl: float = RECORD_TTL
    leave_grace: float = 2.0
    join_timeout: float = 60.0  # seconds initial peers that do not answer are tried again (a bootstrap still starting)
    activation_cache_mb: int = 1024
    kept_inputs_mb: int = 4096
    max_payload_mb: int = 1024
    delta_references_mb: int = 1024
    max_tokens: int = 1 << 16  # one request's (batch x length): one block's graph and the backward's workspace
    max_tokens_in_flight: int | None = None  # all micro-batches' between forward and backward here; None: by memory
    max_inference_mb: int = 1024
    inference_timeout: float = 300.0
    revision: str | None = None  # of a hub id: a branch, tag or commit (default: main, or the id's @REVISION)
    token: str | None = field(default=None, repr=False)  # for a gated or private hub repository (else HF_TOKEN)

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = default_dtype(self.device)

    @property
    def quant_mode(self) -> str:
        """nf4 on CUDA, none on CPU, unless told otherwise."""
        if self.quant is not None:
            return self.quant
        return "nf4" if self.device.startswith("cuda") else "none"


def default_dtype(device: str) -> str:
    """bfloat16 on a CUDA device that computes it (half the activation memory of fp32 and about twice the speed,
    as plan_swarm.py assumes); float32 elsewhere (a CPU computes bf16 slowly). TF32 is left off: an fp32 peer
    announces exact numerics (swarm/net/numerics.py), and TF32 matmuls would put it 1e-3 off what it announces."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"


def measure_throughput(backend: SpanBackend, tokens: int = 128) -> float:
    """Tokens per second through the whole span, without LoRA: what clients use to spread load."""
    hidden = torch.randn(1, tokens, backend.spec.hidden_size, device=backend.device, dtype=backend.dtype)
    blocks = range(backend.blocks[0], backend.blocks[-1] + 1)
    with torch.no_grad():
        backend.run(hidden, None, blocks)
        started = time.perf_counter()
        backend.run(hidden, None, blocks)
    return tokens / max(time.perf_counter() - started, 1e-6)


def device_free_bytes(config: PeerConfig) -> int:
    """What the peer's device has free now: the card's free memory on CUDA, the host's available memory else."""
    if config.device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(config.device))[0]
    return psutil.virtual_memory().available


def memory_case(spec: ModelSpec, config: PeerConfig, blocks: int = 1) -> MemoryInputs:
    """This peer as swarm/memory.py counts it, at a default load (micro-batches of 2048 tokens, at most
    ``--max-tokens``, in flight; LoRA r=16 on all seven projections) over ``blocks`` blocks."""
    from swarm.blocks import DTYPES

    return MemoryInputs(
        shape=ModelShape.from_config(spec.config.to_dict()),
        blocks=blocks,
        quant=config.quant_mode,
        dtype_bytes=torch.finfo(DTYPES[config.dtype]).bits // 8,
        tokens=min(DEFAULT_TOKENS, config.max_tokens),
        standby_blocks=config.standby_blocks,
        replication=config.replication,
        cache_bytes=config.activation_cache_mb << 20,
        inference_bytes=config.max_inference_mb << 20,
        on_host=not config.device.startswith("cuda"),
    )


def blocks_that_fit(spec: ModelSpec, config: PeerConfig, free: int | None = None) -> int:
    """The default span length when neither --blocks nor --num-blocks is given: the longest span whose memory, as
    swarm/memory.py counts it at a default load, fits in the device's free memory (``free``: as measured now)."""
    return default_num_blocks(memory_case(spec, config), device_free_bytes(config) if free is None else free)


def max_tokens_in_flight(spec: ModelSpec, config: PeerConfig, blocks: int, free: int) -> int:
    """The bound on tokens in flight: ``--max-tokens-in-flight``, else swarm/memory.py's for a span of ``blocks``
    on ``free`` bytes (the device's free memory before the peer loaded) with ``--activation-cache-mb`` and
    ``--kept-inputs-mb`` (``default_tokens_in_flight``). Never below one micro-batch of the default load: the peer
    admits one micro-batch at a time whatever its bound (peers/state.py ``TokensInFlight``)."""
    if config.max_tokens_in_flight is not None:
        return config.max_tokens_in_flight
    case = replace(memory_case(spec, config), blocks=blocks)
    return max(default_tokens_in_flight(case, free, config.kept_inputs_mb << 20), case.tokens)


@dataclass
class PeerParts:
    """What a peer runs once its blocks are loaded, made together so that nothing is half-built."""

    backend: SpanBackend  # the span's compute
    adapters: AdapterStore  # the adapters' state, which the compute runs on
    compute: Compute
    peers: PeerClient
    service: PeerService
    replicator: Replicator
    links: LinkProber
    pullers: RecentPullers  # who pulled copies of these blocks lately: told of each commit with the view's watchers


@dataclass(frozen=True)
class Published:
    """What a peer tells of itself, as of the end of its compute thread's last job (``PeerDaemon._publish``)."""

    adapters: dict[str, AdapterInfo]
    stores: dict[str, int]


class PlanHook(Protocol):
    """Sees a peer's loads and moves: how tests give it a slow disk or a scripted move
    (tests/integration/test_crowded_start.py) without patching the daemon."""

    def loading(self, blocks: range) -> None:
        """Runs in the loading thread just before ``blocks`` load (a join's, or a move's new blocks)."""

    def decided(self, target: range | None) -> range | None:
        """The move the balancer decided (None: stay); returns the one the peer makes."""


class PeerDaemon:
    """One process serving a span of one model's blocks, moving it when the swarm needs it elsewhere. What tests
    inject, each given here and None in a real peer: ``faults`` (failures around the handlers), ``behaviour`` (what
    its compute does to its results: a liar's, peers/behaviour.py), ``plan`` (sees its loads and moves)."""

    def __init__(
        self,
        config: PeerConfig,
        faults: FaultHook | None = None,
        behaviour: Behaviour | None = None,
        plan: PlanHook | None = None,
    ):
        self.config, self.faults, self.behaviour, self.plan = config, faults, behaviour, plan
        # a hub id: its revision resolved to a commit, its small files fetched; the shards come with each span
        self.source = resolve_model(config.model, config.revision, config.token)
        self.spec = load_spec(self.source.folder, name=self.source.name)
        self.swarm_key = load_swarm_key(config.swarm_key)
        # an identity file from before this run may be serving elsewhere already (a copy on another machine)
        self.known_identity = config.identity is not None and Path(config.identity).exists()
        self.identity = Identity.load_or_create(config.identity)
        locks = [lock_path_of_identity(self.identity.path)]
        if config.checkpoint_dir:
            locks.append(lock_path_of_checkpoints(Path(config.checkpoint_dir)))
        self.claim = ProcessClaim(self.identity.peer_id, locks)
        self.free_bytes = device_free_bytes(config)  # before this peer loads anything: what its memory model sizes
        told = len(config.blocks) if config.blocks else config.num_blocks
        self.span_len = told or blocks_that_fit(self.spec, config, self.free_bytes)
        self.max_blocks = max(self.span_len, config.max_blocks or self._capacity())
        self.serving = range(0)  # what it announces online; set once loaded
        self.state = ServerState.JOINING
        self.joining: range | None = None
        self.moving_to: range | None = None
        self.throughput = 0.0
        self.timer = MoveTimer(self.source, self.spec)
        self.cost: MoveCost | None = None  # what a move costs this peer (announced once it has loaded)
        self.rng = random.Random(self.identity.peer_id.to_bytes())
        self.store = CheckpointStore(config.checkpoint_dir) if config.checkpoint_dir else None
        self.writer = CheckpointWriter(self.store, config.checkpoint_every) if self.store else None
        self.view: SwarmView | None = None
        self.leaving = LeavingBlocks(config.record_ttl)  # blocks given up lately, announced as leaving
        self.orphans: OrphanCheck | None = None  # made once the transport is: what tells an orphan from a silent peer
        self.parts: PeerParts | None = None  # made by serve() once the blocks are loaded
        self.published: Published | None = None  # what the compute thread last published for readers off it
        self.maddrs: list[str] = []  # where others dial this peer: direct, or through relays
        self.digests: dict[int, str] = {}  # block -> digest of its base weights in this folder; set by serve()
        self.balance_now = asyncio.Event()  # a client found blocks without a server: hold the next round at once
        self.hurry = asyncio.Event()  # told to leave twice: skip what is left of the leave grace
        self.woken_rounds = 0  # balance rounds held early on a client's notice
        self.moves = MoveLog()  # the moves it made, and why
        self._loop: asyncio.AbstractEventLoop | None = None

    def _capacity(self) -> int:
        """The default --max-blocks: a peer told to serve fewer blocks than fit may take orphaned ones over, up to
        what fits; one sized by memory is full already."""
        told = self.config.blocks is not None or self.config.num_blocks is not None
        return blocks_that_fit(self.spec, self.config, self.free_bytes) if told else self.span_len

    # --- what this peer tells others ------------------------------------------------------------------------

    def _publish(self, backend: SpanBackend) -> None:
        """On the compute thread, after each of its jobs: what ``info`` and the records tell, as of that job's end
        (never a change half made), for readers that must not wait behind the queued forwards and backwards."""
        self.published = Published(backend.adapters.adapter_infos(), backend.store_use())

    async def _adapter_infos(self) -> dict[str, AdapterInfo]:
        """What this peer holds of each adapter, as the compute thread last published it."""
        return {} if self.published is None else self.published.adapters

    async def _records(self) -> list[tuple[ServerRecord, range]]:
        adapters = {}
        for name, adapter in (await self._adapter_infos()).items():
            steps = [step for block, step in adapter.steps.items() if block in self.serving]
            if steps:
                adapters[name] = min(steps)
        records = []
        if self.serving:
            record = ServerRecord(
                self.identity.peer_id,
                self.state,
                self.serving.start,
                self.serving.stop,
                self.throughput,
                adapters,
                self.moving_to,
                maddrs=self.maddrs,
                digests=self._digests_of(self.serving),
                max_blocks=self.max_blocks,
                home=self.config.blocks,
                links=self.parts.links.announced() if self.parts is not None else {},
                numerics=self._numerics(self.serving),
                cost=self.cost,
                max_tokens_in_flight=self.published.stores["tokens_in_flight_max"] if self.published else 0,
            )
            records.append((record, self.serving))
        if self.joining:
            record = ServerRecord(
                self.identity.peer_id,
                ServerState.JOINING,
                self.joining.start,
                self.joining.stop,
                self.throughput,
                maddrs=self.maddrs,
                digests=self._digests_of(self.joining),
                numerics=self._numerics(self.joining),
            )
            records.append((record, range(max(self.joining.start, self.serving.stop), self.joining.stop)))
            records.append((record, range(self.joining.start, min(self.joining.stop, self.serving.start))))
        return [(record, blocks) for record, blocks in records if len(blocks)]

    def _numerics(self, blocks: range) -> Numerics:
        if self.parts is None:
            config = self.config  # blocks not loaded yet: no errors measured, read as the caps
            return Numerics(config.quant_mode, config.dtype, torch.device(config.device).type)
        return self.parts.backend.numerics(blocks)

    def _digests_of(self, blocks: range) -> dict[int, str]:
        return {block: self.digests[block] for block in blocks if block in self.digests}

    async def _announce(self, leaving: list[tuple[ServerRecord, range]] = ()) -> None:
        """Announce what this peer serves and loads, and the blocks it gave up lately (``leaving``: just now, given
        precedence over what it still announces there), in one value that replaces the last."""
        entries = self.leaving.announce(leaving, await self._records(), time.monotonic())
        ttl = self.config.record_ttl
        await asyncio.to_thread(announce, self.dht, self.spec.name, self.identity.owner, entries, ttl)
        await asyncio.to_thread(
            announce_model, self.dht, self.spec.name, self.spec.num_blocks, self.identity.owner, self.config.record_ttl
        )

    async def _memory(self) -> MemoryUse | None:
        """This peer's memory against its bounds, once it serves (an in-process peer counts the process it runs in)."""
        if self.published is None:
            return None
        stores = self.published.stores
        usage = await asyncio.to_thread(tree_usage, os.getpid())
        host = psutil.virtual_memory()
        return MemoryUse(rss=usage.rss, host_available=host.available, host_total=host.total, **stores)

    async def info(self) -> PeerInfo:
        adapters = await self._adapter_infos()
        standby = self.parts.replicator.standby if self.parts is not None else []
        return PeerInfo(
            self.spec.name,
            self.serving.start,
            self.serving.stop,
            self.state.value,
            self.throughput,
            adapters,
            standby,
            f"{self.config.quant_mode}/{self.config.dtype}",
            await self._memory(),
            self.moves.recent(),
        )

    # --- choosing, loading, moving ----------------------------------------------------------------------------

    async def _observe(self, retry_timeout: float | None = None) -> SwarmView:
        """Look at the swarm (see ``observe``) and remember what was seen."""
        self.view = await observe(
            self.dht,
            self.transport,
            self.spec.name,
            self.spec.num_blocks,
            self.identity.peer_id,
            self.digests,
            retry_timeout=retry_timeout,
        )
        if self.orphans is not None:
            self.orphans.saw(self.view)
        return self.view

    async def _choose_span(self) -> range:
        """Pick the span that helps most; announce it as joining; look again, and yield to a smaller-id peer that
        chose the same span at the same moment. A peer restarting on the blocks its checkpoint holds goes at once:
        it may hold their newest state, and a second server of them is no waste. Of equal spans, one whose weights are
        on disk wins (a model from the hub: nothing to download)."""
        config, me = self.config, self.identity.peer_id
        held = await asyncio.to_thread(self.store.blocks) if self.store is not None else set()
        on_disk = set(await asyncio.to_thread(self.source.blocks_on_disk, self.spec.weight_files, self.spec.num_blocks))
        if not held:
            await asyncio.sleep(self.rng.uniform(0.0, 1.0))  # fresh peers starting together spread out
        view = await self._observe()
        span = choose_span(
            view.coverage(me),
            self.spec.num_blocks,
            self.span_len,
            config.replication,
            planned_throughput(view, self.spec.num_blocks, me),
            self.rng,
            held,
            on_disk,
        )
        if held.issuperset(span):
            self.joining = span
            await self._announce()
            logger.info("chose blocks %d:%d (its checkpoint holds them)", span.start, span.stop)
            return span
        for _ in range(3):
            self.joining = span
            await self._announce()
            await asyncio.sleep(1.0 + self.rng.uniform(0.0, 1.0))
            view = await self._observe()
            coverage = view.coverage(me, joining_before=me)
            throughput = planned_throughput(view, self.spec.num_blocks, me)
            best = choose_span(
                coverage, self.spec.num_blocks, self.span_len, config.replication, throughput, self.rng, held, on_disk
            )
            mine = badness(coverage_with(coverage, self.spec.num_blocks, span), config.replication)
            if mine <= badness(coverage_with(coverage, self.spec.num_blocks, best), config.replication):
                break
            logger.info(
                "span %s was taken by another joining peer; choosing %s instead",
                spans_text(list(span)),
                spans_text(list(best)),
            )
            await self._withdraw([b for b in span if b not in best])
            span = best
        logger.info("chose blocks %d:%d", span.start, span.stop)
        return span

    async def _withdraw(self, blocks: list[int]) -> None:
        """Replace this peer's records on ``blocks`` by leaving ones: a joining record left there would count as a
        server to come until it expired, and the balancer would move the real servers away."""
        me = self.identity.peer_id
        leaving = ServerRecord(me, ServerState.LEAVING, min(blocks, default=0), max(blocks, default=0) + 1, 0.0)
        await self._announce([(leaving, range(b, b + 1)) for b in blocks])

    def _load(self, blocks: range) -> SpanBackend:
        """Build the backend and its adapters' store (slow: runs in a thread while the event loop keeps the P2P
        connection alive)."""
        from swarm.blocks import DTYPES

        config = self.config
        if self.plan is not None:
            self.plan.loading(blocks)
        digests = self._fetch(blocks)
        if digests is not None:
            self.digests = digests
        started = time.monotonic()
        adapters = AdapterStore(
            self.spec,
            weight_digests=self.digests,
            activation_cache_bytes=config.activation_cache_mb << 20,
            kept_inputs_bytes=config.kept_inputs_mb << 20,
            max_tokens_in_flight=max_tokens_in_flight(self.spec, config, len(blocks), self.free_bytes),
            behaviour=self.behaviour,
        )
        backend = SpanBackend(
            self.spec,
            blocks,
            torch.device(config.device),
            DTYPES[config.dtype],
            config.quant_mode,
            adapters,
            max_tokens=config.max_tokens,
            inference_bytes=config.max_inference_mb << 20,
            inference_timeout=config.inference_timeout,
            behaviour=self.behaviour,
        )
        self.timer.loaded(len(blocks), time.monotonic() - started)  # the blocks alone, not the adapters' checkpoint
        if self.store is not None:
            for name, (meta, states) in self.store.load().items():
                adapters.keep_standby(name, meta, states, keep=None)
                logger.info("loaded checkpoint of adapter %r: steps %s", name, _steps_by_block(states))
        self.cost = self.timer.cost()
        self.throughput = self._throughput(backend)
        logger.info(
            "blocks %d:%d loaded, %.0f tokens/s (torch %s on %s, %s/%s%s)",
            blocks.start,
            blocks.stop,
            self.throughput,
            torch.__version__,
            config.device,
            config.quant_mode,
            config.dtype,
            f", {torch.backends.cpu.get_cpu_capability()} CPU kernels" if config.device == "cpu" else "",
        )
        return backend

    def _fetch(self, blocks: range) -> dict[int, str] | None:
        """Download the shards holding ``blocks`` when the model comes from the hub (slow: in a thread); then the
        digests of every block now present (what this peer announces and checks adapters' pins against), or None when
        nothing changed: no shard came and ``blocks``' digests are known (a local folder; another peer of this machine
        may have brought the shards into the shared cache since the digests were taken)."""
        started = time.monotonic()
        fetched = self.source.fetch_blocks(self.spec.weight_files, blocks)
        self.timer.downloaded(fetched, time.monotonic() - started)
        if not fetched and all(block in self.digests for block in blocks):
            return None
        return block_digests(self.spec, known=self.digests)

    def _use_digests(self, digests: dict[int, str]) -> None:
        """The block digests after new shards came (on the compute thread, where the adapters' store reads them)."""
        self.digests = digests
        if self.parts is not None:
            self.parts.adapters.weight_digests = digests

    def _throughput(self, backend: SpanBackend) -> float:
        """What this peer announces of its speed: as its user told it (``--throughput``), else measured."""
        return self.config.throughput if self.config.throughput is not None else measure_throughput(backend)

    def _assemble(self, backend: SpanBackend) -> PeerParts:
        """The compute thread, the replicator and the service around a loaded backend and its adapters' store, each
        made with what it needs: nothing is wired in afterwards."""
        config, adapters = self.config, backend.adapters
        compute = Compute(after=partial(self._publish, backend))
        self._publish(backend)  # no job has run on the new compute thread yet: published before anyone reads it
        policy = StandbyPolicy(config.standby_blocks, config.standby_every)
        peers = PeerClient(self.transport, self.behaviour)
        replicator = Replicator(adapters, compute, peers, self.identity.peer_id, policy, self._checkpoint)
        hooks = PeerHooks(
            after_commit=self._after_commit,
            after_revert=self._checkpoint,
            on_committed=replicator.on_committed,
            on_replicate=replicator.hold,
            on_unserved=self._on_unserved,
        )
        pullers = RecentPullers()
        service = PeerService(
            backend,
            adapters,
            compute,
            self.info,
            peers,
            hooks,
            pullers,
            self.swarm_key,
            config.max_payload_mb << 20,
            faults=self.faults,
            references=DeltaReferences(max_bytes=config.delta_references_mb << 20),
            audit_rate=AUDIT_RATE if config.audit_rate is None else config.audit_rate,
        )
        links = LinkProber(self.transport, rng=random.Random(self.rng.random()))
        return PeerParts(backend, adapters, compute, peers, service, replicator, links, pullers)

    async def _move(self, move: Move) -> None:
        """Serve ``move.target`` instead of the current span without a gap: load it and take its state while still
        serving the old span, announce the move, check that the blocks handed over stay covered, switch, and drain
        the blocks handed over (their micro-batches in flight finish here) before they are unloaded."""
        me, old, target = self.identity.peer_id, self.serving, move.target
        self.moves.starting(old, target, move.reason)
        self.joining = target
        await self._announce()
        async with self._announcing():
            digests = await asyncio.to_thread(self._fetch, target)
            if digests is not None:
                await self.parts.compute(self._use_digests, digests)
            layers = await asyncio.to_thread(self._load_layers, target)
            await self.parts.replicator.take_state(await self._observe(), target)
        await self.parts.compute(self.parts.backend.install, layers)
        handed_over = [b for b in old if b not in target]
        if handed_over:
            self.moving_to = target
            await self._announce()
            await asyncio.sleep(1.0 + self.rng.uniform(0.0, 1.0))
            view = await self._observe()
            # Peers deciding on one snapshot may all move to the same blocks (a churn test saw two leave 2:4 for 0:2
            # at once, then both move back). Of peers moving at once, the smallest id goes on; the others count it
            # where it goes and move only if that still calls for their move.
            later = frozenset(p for p in movers(view) if p.to_bytes() > me.to_bytes())
            still = await self._decide_move(view, later, one_at_a_time=False)  # begun at rest: only movers decide
            if still is None or still.target != target:
                logger.info("not moving to %d:%d: a peer moving at the same time does", target.start, target.stop)
                await self._cancel_move(old, target)
                return
            unsafe = [b for b in handed_over if not safe_to_drop(b, others_serving(view, b, me), me.to_base58())]
            if unsafe:
                logger.info("not moving: blocks %s would be left without a server; keeping them", unsafe)
                await self._cancel_move(old, target)
                return
        self.serving, self.joining, self.moving_to = target, None, None
        self.moves.add(old, target, move.reason)
        leaving = ServerRecord(me, ServerState.LEAVING, old.start, old.stop, self.throughput)
        await self._announce([(leaving, range(b, b + 1)) for b in handed_over])
        await asyncio.sleep(self.config.leave_grace)
        async with self._announcing():  # a drain may outlast the records
            await self._drain(handed_over)
        await self.parts.compute(self.parts.backend.remove, handed_over)
        self.throughput = await self.parts.compute(self._throughput, self.parts.backend)
        logger.info("now serving blocks %d:%d, %.0f tokens/s", target.start, target.stop, self.throughput)

    async def _drain(self, blocks: list[int]) -> None:
        """Keep serving ``blocks`` after announcing them leaving until no trainer counts on them here, at most
        ``DRAIN_TIMEOUT``: clients have had time to see the leaving records (``DRAIN_SEEN``), nothing of the step in
        progress is held on them (gradients committed, kept forwards used), and two steps committed since (a trainer
        asks every replica it knew of at the step's start to commit it, ones holding nothing there too, and routes a
        step by the view it read at the commit before: the second step is the first routed without these blocks),
        or no trainer sent work here for ``DRAIN_QUIET``. Micro-batches in flight finish where they started instead of
        being replayed elsewhere."""
        adapters = self.parts.adapters
        started = time.monotonic()
        progress = await self.parts.compute(adapters.progress)

        def left() -> tuple[int, bool]:
            quiet = time.monotonic() - adapters.last_trained >= DRAIN_QUIET
            return adapters.in_flight(blocks), quiet or adapters.progress() >= progress + 2

        while True:
            held, committed = await self.parts.compute(left)
            if held == 0 and committed and time.monotonic() - started >= DRAIN_SEEN:
                return
            if time.monotonic() - started >= DRAIN_TIMEOUT:
                logger.warning(
                    "blocks %s still hold %d things of the step in progress after %.0f s; handing them over anyway "
                    "(the trainer replays what it misses)",
                    spans_text(blocks),
                    held,
                    DRAIN_TIMEOUT,
                )
                return
            await asyncio.sleep(DRAIN_POLL)

    def _load_layers(self, blocks: range) -> dict[int, torch.nn.Module]:
        """A move's new blocks, loaded beside serving (slow: in a thread)."""
        if self.plan is not None:
            self.plan.loading(blocks)
        started = time.monotonic()
        layers = self.parts.backend.load_layers(blocks)
        self.timer.loaded(len(layers), time.monotonic() - started)
        self.cost = self.timer.cost()  # the new blocks' shards are on disk now
        return layers

    async def _cancel_move(self, old: range, target: range) -> None:
        """Stay on ``old``: drop what was loaded of ``target`` and the records announcing the move."""
        self.moving_to, self.joining = None, None
        await self.parts.compute(self.parts.backend.remove, [b for b in target if b not in old])
        await self._announce()
        await self._withdraw([b for b in target if b not in old])

    async def _balance_round(self) -> None:
        """Free idle generation sessions, time the links to the next hops (in the background: peers/links.py),
        refresh standby copies, then move if that strictly helps the swarm's coverage, is this peer's step of a plan
        that brings a block without a server back, or relieves the slowest block (the span throughputs the peers
        announce, this one's as last measured)."""
        await self.parts.compute(self.parts.backend.sessions.expire)
        looked = time.monotonic()
        view = await self._observe()
        self.parts.links.start(self._next_hops(view))
        changed = await self.parts.replicator.refresh_standby(view, self.serving)
        for name in changed:
            await self._checkpoint(name)
        if not self.config.rebalance:
            return
        move = await self._decide_move(view)
        if move is not None and move.covers:
            read = partial(asyncio.to_thread, read_servers, self.dht, self.spec.name, self.spec.num_blocks)
            move = await self.orphans.confirmed(move, view, looked, self._observe, self._decide_move, read)
        if move is not None:
            await self._move(move)

    async def _decide_move(
        self, view: SwarmView, yielding: frozenset[PeerID] = frozenset(), one_at_a_time: bool = True
    ) -> Move | None:
        config = self.config
        placement = Placement(self.spec.num_blocks, self.span_len, config.replication, self.max_blocks, config.blocks)
        me, serving, throughput = self.identity.peer_id, self.serving, self.throughput
        move = await asyncio.to_thread(  # a plan search may take a few hundred ms: not on the event loop
            decide_move, view, me, serving, throughput, placement, yielding, self.cost, one_at_a_time
        )
        if self.plan is None:
            return move
        target = self.plan.decided(None if move is None else move.target)
        if target is None:
            return None
        return move if move is not None and move.target == target else Move(target, "told by a test's plan")

    def _next_hops(self, view: SwarmView) -> list[PeerID]:
        """Where this peer's hops pass activations on: the live servers of the block after its span."""
        return [r.peer_id for r in view.online(self.serving.stop, exclude=self.identity.peer_id)]

    async def _checkpoint(self, name: str) -> None:
        if self.writer is not None:
            adapters = self.parts.adapters
            meta, states = await self.parts.compute(lambda: (adapters.adapter(name).meta, adapters.snapshot(name)))
            self.writer.submit(name, meta, states)

    async def _after_commit(self, name: str) -> None:
        """A step was applied here: checkpoint it (in the background) and tell the peers keeping standby copies
        of these blocks, so they pull the new state now rather than at their next round (told first: a copy one
        step behind when both servers die is a step the trainer must wait for or lose)."""
        adapters = self.parts.adapters
        config, seed, steps = await self.parts.compute(
            lambda: (adapters.adapter(name).config_wire, adapters.adapter(name).seed, adapters.adapter(name).steps())
        )
        steps = {block: step for block, step in steps.items() if block in self.serving}
        notice = CommittedRequest(adapter=name, lora=config, seed=seed, steps=steps, source=self.identity.peer_id)
        blocks = list(steps)
        watchers = self.view.watchers(blocks) if self.view is not None else []
        for peer in dict.fromkeys([*watchers, *self.parts.pullers.of(blocks)]):
            self.parts.service.in_background(self.parts.peers.notify_committed(peer, notice))
        await self._checkpoint(name)

    # --- the life of a peer -----------------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Join, check access, choose and load blocks, serve until SIGINT/SIGTERM; then announce leaving,
        finish in-flight work, go. Given ``stop``, serve until it is set instead: a peer embedded in another
        program (``swarm.testing.inprocess``) takes none of its signals and never exits its process."""
        embedded = stop is not None
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, stop)
        self.claim.acquire()
        try:
            await self._serve(stop, embedded)
        finally:
            self.claim.release()

    def _on_signal(self, stop: asyncio.Event) -> None:
        """SIGINT or SIGTERM: leave (announce it, give clients the grace to notice, finish in-flight work). Again
        while leaving (Ctrl-C twice, or a supervisor that knows no client is left): skip the rest of the grace."""
        if stop.is_set() and not self.hurry.is_set():
            logger.info("told again: leaving without waiting out the grace")
            self.hurry.set()
        stop.set()

    async def _serve(self, stop: asyncio.Event, embedded: bool) -> None:
        """Join, load and take state, serve until ``stop``, leave."""
        self._loop = asyncio.get_running_loop()
        p2p, timeline = await self._join(embedded)
        await self._start_serving(p2p, timeline)
        await self._serve_until(stop)
        await self._leave(p2p, exit_if_stuck=not embedded)

    async def _join(self, embedded: bool) -> tuple[P2P, StartTimeline]:
        """Relays chosen, the DHT joined with this peer's identity, its addresses known; the start timed from the
        process's start (``embedded``: from now)."""
        config = self.config
        timeline = StartTimeline(psutil.Process().create_time() if not embedded else time.time())
        self.digests = await asyncio.to_thread(block_digests, self.spec)
        announce = list(config.announce_maddrs)
        relays = await choose_relays(
            config.initial_peers, config.host, config.port, announce, config.relay, self.swarm_key
        )
        if self.known_identity and config.initial_peers:
            await self._refuse_if_serving_elsewhere()
        self.dht = join_dht(
            config.initial_peers,
            self.identity,
            self.swarm_key,
            host=config.host,
            port=config.port,
            announce_maddrs=announce,
            relays=relays,
            join_timeout=config.join_timeout,
            check_identity=False,  # looked for just above, where it can be: a fresh identity file is nobody's
        )
        p2p = await self.dht.replicate_p2p()
        self.transport = Transport(p2p, self.swarm_key, on_unresponsive=partial(suspect, self.dht))
        self.orphans = OrphanCheck(
            self.identity.peer_id, self.transport, config.record_ttl, told=config.blocks is not None
        )
        try:
            await check_access(self.transport, config.initial_peers)
            self.maddrs = await self._addresses(p2p, relays)
            self.claim.note_addresses(self.maddrs)
        except BaseException:
            self.dht.shutdown()
            raise
        timeline.mark("join")
        return p2p, timeline

    async def _start_serving(self, p2p: P2P, timeline: StartTimeline) -> None:
        """Choose the span (or take ``--blocks``), load it and take its state while answering ``info`` only, then open
        every door."""
        config = self.config
        joining_doors = InfoDoors(self.info, self.swarm_key, config.max_payload_mb << 20, faults=self.faults)
        await joining_doors.register(p2p)
        if config.blocks is None:
            self.joining = await self._choose_span()
        else:
            self.joining = config.blocks
            await self._announce()
        timeline.mark("choose")
        async with self._announcing():
            self.parts = self._assemble(await asyncio.to_thread(self._load, self.joining))
            await self.parts.replicator.take_state(await self._observe(), self.joining)
        me = self.identity.peer_id
        await joining_doors.unregister(p2p)
        await self.parts.service.register(p2p)
        self.serving, self.joining, self.state = self.joining, None, ServerState.ONLINE
        self.orphans.serving()
        timeline.mark("load and take state")
        logger.info(
            "serving blocks %d:%d of %s as %s (%s)",
            self.serving.start,
            self.serving.stop,
            self.spec.name,
            me,
            timeline.text(),
        )

    async def _serve_until(self, stop: asyncio.Event) -> None:
        """Announce every third of the records' lifetime and balance every round (early when woken) until ``stop``."""
        config = self.config
        next_announce, next_round, last_round = 0.0, self._next_round(), 0.0
        while not stop.is_set():
            if time.monotonic() >= next_announce:
                try:
                    await self._announce()
                    next_announce = time.monotonic() + config.record_ttl / 3
                except TimeoutError as e:  # the DHT is slow or restarting: serve on, and announce again soon
                    logger.warning("announcing failed (will retry in %.0f s): %s", ANNOUNCE_RETRY, e)
                    next_announce = time.monotonic() + ANNOUNCE_RETRY  # before the records lapse, if it can
            woken = await self._sleep(stop, min(next_announce, next_round) - time.monotonic())
            if stop.is_set():
                break
            if woken:  # at most one early round a second, however many notices come
                await asyncio.sleep(max(0.0, last_round + MIN_ROUND_GAP - time.monotonic()))
                self.woken_rounds += 1
            elif time.monotonic() < next_round:
                continue  # woken to announce
            try:
                await self._balance_round()
            except PEER_ERRORS as e:
                logger.warning("balancing round failed (will retry): %s", e)
            except Exception:  # the boundary of a background loop: the peer serves on, and retries next round
                logger.exception("balancing round failed (will retry)")
            last_round, next_round = time.monotonic(), self._next_round()

    @contextlib.asynccontextmanager
    async def _announcing(self) -> AsyncIterator[None]:
        """Announce this peer's records every ``record_ttl / 3`` while it loads blocks (joining, or moving while it
        serves its old span): a load longer than a record's lifetime (a big span from a slow disk) would otherwise
        let its records expire, and others would take its blocks for unserved and its choice for nobody's."""

        done = asyncio.Event()

        async def keep_announcing() -> None:
            while not await _wait_for(done, self.config.record_ttl / 3):
                try:
                    await self._announce()
                except TimeoutError as e:
                    logger.warning("announcing failed (will retry): %s", e)

        task = asyncio.create_task(keep_announcing())
        try:
            yield
        finally:
            done.set()
            await task  # an announcement under way lands before the caller announces what comes next, not after

    def _next_round(self) -> float:
        """When the next balance round is due: jittered, so that peers started together do not look together."""
        return time.monotonic() + self.config.balance_interval * self.rng.uniform(0.5, 1.5)

    async def _sleep(self, stop: asyncio.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``stop`` or a client's notice of unserved blocks; True if the notice came."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.balance_now.wait())]
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        woken = self.balance_now.is_set()
        self.balance_now.clear()
        return woken

    def _on_unserved(self, model: str, blocks: list[int]) -> None:
        """A client found ``blocks`` without a live server: look at the swarm now (it may be this peer's to take
        them over). Notices for another model are ignored."""
        if model != self.spec.name or self._loop is None:
            return
        logger.info("a client finds blocks %s without a live server: looking at the swarm now", spans_text(blocks))
        self._loop.call_soon_threadsafe(self.balance_now.set)

    async def _refuse_if_serving_elsewhere(self) -> None:
        """Stop before joining if a live process serves under this identity. hivemind's own check looks the peer id up
        in libp2p's routing table, which a node that just joined may not have filled yet (it let a copy of a serving
        peer's identity join); the swarm's records name the addresses to ask."""
        live, where = await self._serving_elsewhere()
        if live:
            raise IdentityInUseError(
                f"identity {self.identity.peer_id} ({self.identity.path}) is already in use by another process in the "
                f"swarm, {where}: {IN_USE_HINT}"
            )

    async def _serving_elsewhere(self) -> tuple[bool, str]:
        """Whether a process with this identity answers at the addresses its records announce, and where it serves
        (looked at through a throwaway identity: a node with this one would be taken for it). Records a crashed
        previous run left behind name addresses where nobody answers."""
        throwaway = Identity.load_or_create(None)
        dht = await asyncio.to_thread(join_dht, self.config.initial_peers, throwaway, self.swarm_key, client_mode=True)
        try:
            servers = await asyncio.to_thread(read_servers, dht, self.spec.name, self.spec.num_blocks)
            me = self.identity.peer_id
            mine = [r for records in servers.values() for r in records if r.peer_id == me]
            if not mine:
                return False, "which announces no blocks of this model"
            transport = Transport(await dht.replicate_p2p(), self.swarm_key)
            transport.learn(mine)
            live = await transport.answers(me)
        finally:
            dht.shutdown()
        spans = sorted({(r.start, r.end) for r in mine})
        maddrs = sorted({m for r in mine for m in r.maddrs})
        blocks = ", ".join(f"{a}:{b}" for a, b in spans)
        return live, f"serving blocks {blocks} of {self.spec.name} at {' '.join(maddrs) or 'an unannounced address'}"

    async def _addresses(self, p2p, relays: list[str]) -> list[str]:
        """Where others dial this peer: its own addresses, or (behind NAT) its addresses through the relays that
        proved to work."""
        if not relays:
            maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
            logger.info("announcing addresses %s", " ".join(maddrs))
            return maddrs
        maddrs = await verify_relayed(self.transport, relays, self.identity.peer_id)
        port = f"port {self.config.port}" if self.config.port else "a port (--port N)"
        if not maddrs:
            raise SwarmAccessError(
                f"this peer is not reachable from outside, and no relay let it through ({' '.join(relays)}): open "
                f"{port} to this machine and pass --public-ip or --announce-maddrs, or join through a bootstrap "
                "node that relays (`swarm dht` without --no-relay)"
            )
        logger.warning(
            "not reachable from outside; serving through relay %s (slower). Open %s or pass --announce-maddrs "
            "to serve directly.",
            " ".join(maddrs),
            port,
        )
        return maddrs

    async def _leave(self, p2p, exit_if_stuck: bool) -> None:
        """Announce leaving, finish in-flight work, go. Bounded: a signal sent to the whole process group (systemd,
        ``kill -- -PGID``) has stopped the P2P daemon and the DHT process too, and the peer must exit anyway
        (``exit_if_stuck``: the whole process, if even the bounded wait hangs)."""
        logger.info("leaving: announcing it, then finishing in-flight requests")
        if exit_if_stuck:
            watchdog = threading.Timer(self.config.leave_grace + LEAVE_TIMEOUT, _exit_now)
            watchdog.daemon = True
            watchdog.start()
        self.state = ServerState.LEAVING
        try:
            await asyncio.wait_for(self._finish(p2p), timeout=self.config.leave_grace + LEAVE_TIMEOUT / 2)
            logger.info("left the swarm")
        except PEER_ERRORS as e:
            logger.warning("could not leave cleanly (%s: %s); exiting anyway", type(e).__name__, e)
        finally:
            self.dht.shutdown()

    async def _finish(self, p2p) -> None:
        if self.dht.is_alive():
            await self._announce()
        await _wait_for(self.hurry, self.config.leave_grace)
        await self.parts.compute(lambda: None)
        await self.parts.links.close()
        if self.writer is not None:
            self.writer.close()
        await self.parts.service.unregister(p2p)


async def _wait_for(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` was set within ``seconds``."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


def _exit_now() -> None:
    """The last resort of a leave that hangs (a dead DHT process or P2P daemon under a thread): exit anyway."""
    logger.error("leaving took too long; exiting now")
    logging.shutdown()
    os._exit(1)


class StartTimeline:
    """When a peer's start reached each phase: what a restart costs, and where (printed when it serves)."""

    def __init__(self, started: float):
        self.started, self.imported = started, time.time()  # the daemon runs once its imports are done
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.time()))

    def text(self) -> str:
        parts, last = [f"{self.imported - self.started:.1f} s to start Python and import"], self.imported
        for phase, at in self.marks:
            parts.append(f"{at - last:.1f} s to {phase}")
            last = at
        return f"{last - self.started:.1f} s after the process started: " + ", ".join(parts)


def _steps_by_block(states: dict) -> dict[int, int]:
    return {block: state.step for block, state in sorted(states.items())}


def run_peer(config: PeerConfig) -> None:
    """Serve until told to stop, then exit the process at once: after a signal to the whole process group, threads
    stuck on the dead DHT process or P2P daemon would otherwise hold the interpreter's exit forever."""
    daemon = PeerDaemon(config)
    asyncio.new_event_loop().run_until_complete(daemon.serve())
    logging.shutdown()
    os._exit(0)
