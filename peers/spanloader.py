"""Loading a span: its shards fetched first (a model from the hub), its blocks and its adapters' store built, the
adapter state its checkpoint holds put beside them, its speed measured; and a move's new blocks, loaded beside the span
a peer serves. What a load learns (the blocks' digests, what a move costs, the span's speed) goes to the peer's
``Standing`` (peers/standing.py), where the announcer reads it. Slow: every load runs in a thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from peers.adapters import AdapterStore
from peers.backend import SpanBackend
from peers.behaviour import Behaviour
from peers.checkpoints import CheckpointStore
from peers.config import PeerConfig, max_tokens_in_flight
from peers.movecost import MoveTimer
from peers.standing import Standing
from swarm.hub import ModelSource
from swarm.spec import ModelSpec
from swarm.weights import block_digests

logger = logging.getLogger(__name__)


def measure_throughput(backend: SpanBackend, tokens: int = 128) -> float:
    """Tokens per second through the whole span, without LoRA: what clients use to spread load."""
    hidden = torch.randn(1, tokens, backend.spec.hidden_size, device=backend.device, dtype=backend.dtype)
    blocks = range(backend.blocks[0], backend.blocks[-1] + 1)
    with torch.no_grad():
        backend.run(hidden, None, blocks)
        started = time.perf_counter()
        backend.run(hidden, None, blocks)
    return tokens / max(time.perf_counter() - started, 1e-6)


class SpanLoader:
    """Loads this peer's blocks from ``source``. ``free_bytes``: the device's free memory before the peer loaded
    anything (what its bound on tokens in flight is sized by); ``store``: its checkpoints, if it keeps any;
    ``before_load``: told of each load just before it starts (a test's slow disk, ``PlanHook.loading``)."""

    def __init__(
        self,
        source: ModelSource,
        spec: ModelSpec,
        config: PeerConfig,
        standing: Standing,
        free_bytes: int,
        store: CheckpointStore | None = None,
        behaviour: Behaviour | None = None,
        before_load: Callable[[range], None] | None = None,
    ):
        self.source, self.spec, self.config, self.standing = source, spec, config, standing
        self.free_bytes, self.store, self.behaviour, self.before_load = free_bytes, store, behaviour, before_load
        self.timer = MoveTimer(source, spec)  # what a move costs this peer, as it measures its loads and downloads

    def load(self, blocks: range) -> SpanBackend:
        """Build the backend and its adapters' store, with the adapter state of the checkpoint (slow: runs in a thread
        while the event loop keeps the P2P connection alive)."""
        config = self.config
        if self.before_load is not None:
            self.before_load(blocks)
        digests = self.fetch(blocks)
        if digests is not None:
            self.standing.digests = digests
        started = time.monotonic()
        backend = self._build(blocks)
        self.timer.loaded(len(blocks), time.monotonic() - started)  # the blocks alone, not the adapters' checkpoint
        self._restore(backend.adapters)
        self.standing.cost = self.timer.cost()
        self.standing.throughput = self.throughput(backend)
        logger.info(
            "blocks %d:%d loaded, %.0f tokens/s (torch %s on %s, %s/%s%s)",
            blocks.start,
            blocks.stop,
            self.standing.throughput,
            torch.__version__,
            config.device,
            config.quant_mode,
            config.dtype,
            f", {torch.backends.cpu.get_cpu_capability()} CPU kernels" if config.device == "cpu" else "",
        )
        return backend

    def _build(self, blocks: range) -> SpanBackend:
        """The span's backend on a fresh adapters' store, sized by this peer's settings."""
        from swarm.blocks import DTYPES

        config = self.config
        adapters = AdapterStore(
            self.spec,
            weight_digests=self.standing.digests,
            activation_cache_bytes=config.activation_cache_mb << 20,
            kept_inputs_bytes=config.kept_inputs_mb << 20,
            max_tokens_in_flight=max_tokens_in_flight(self.spec, config, len(blocks), self.free_bytes),
            behaviour=self.behaviour,
        )
        return SpanBackend(
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

    def _restore(self, adapters: AdapterStore) -> None:
        """The adapters' state the checkpoint holds, kept as standby copies (taken up as the span's state later)."""
        if self.store is None:
            return
        for name, (meta, states) in self.store.load().items():
            adapters.keep_standby(name, meta, states, keep=None)
            steps = {block: state.step for block, state in sorted(states.items())}
            logger.info("loaded checkpoint of adapter %r: steps %s", name, steps)

    def fetch(self, blocks: range) -> dict[int, str] | None:
        """Download the shards holding ``blocks`` when the model comes from the hub (slow: in a thread); then the
        digests of every block now present (what this peer announces and checks adapters' pins against), or None when
        nothing changed: no shard came and ``blocks``' digests are known (a local folder; another peer of this machine
        may have brought the shards into the shared cache since the digests were taken)."""
        started = time.monotonic()
        fetched = self.source.fetch_blocks(self.spec.weight_files, blocks)
        self.timer.downloaded(fetched, time.monotonic() - started)
        if not fetched and all(block in self.standing.digests for block in blocks):
            return None
        return block_digests(self.spec, known=self.standing.digests)

    def use_digests(self, digests: dict[int, str]) -> None:
        """The block digests after new shards came (on the compute thread, where the adapters' store reads them)."""
        self.standing.digests = digests
        if self.standing.parts is not None:
            self.standing.parts.adapters.weight_digests = digests

    def on_disk(self) -> list[int]:
        """The blocks whose shards are on disk (a model from the hub: the ones a load would not download)."""
        return self.source.blocks_on_disk(self.spec.weight_files, self.spec.num_blocks)

    def throughput(self, backend: SpanBackend) -> float:
        """What this peer announces of its speed: as its user told it (``--throughput``), else measured."""
        return self.config.throughput if self.config.throughput is not None else measure_throughput(backend)

    def load_layers(self, blocks: range) -> dict[int, torch.nn.Module]:
        """A move's new blocks, loaded beside the span served (slow: in a thread)."""
        if self.before_load is not None:
            self.before_load(blocks)
        started = time.monotonic()
        layers = self.standing.parts.backend.load_layers(blocks)
        self.timer.loaded(len(layers), time.monotonic() - started)
        self.standing.cost = self.timer.cost()  # the new blocks' shards are on disk now
        return layers
