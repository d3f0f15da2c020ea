"""The peer daemon: join the DHT, load a span of blocks, serve it, keep announcing it, leave cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import torch

from peers.backend import SpanBackend
from peers.service import PeerService
from swarm.network import check_access, join_dht, load_swarm_key
from swarm.records import RECORD_TTL, ServerRecord, ServerState, announce
from swarm.security import Identity
from swarm.spec import load_spec
from swarm.transport import Transport

logger = logging.getLogger(__name__)


@dataclass
class PeerConfig:
    """Everything ``swarm peer`` is told on its command line."""

    model: str
    initial_peers: list[str]
    start: int
    end: int
    device: str = "cpu"
    quant: str | None = None
    dtype: str = "float32"
    host: str = "0.0.0.0"
    port: int = 0
    identity: str | None = None
    swarm_key: str | None = None
    record_ttl: float = RECORD_TTL
    leave_grace: float = 2.0
    activation_cache_mb: int = 1024
    max_payload_mb: int = 1024
    max_tokens: int = 1 << 16

    @property
    def quant_mode(self) -> str:
        """nf4 on CUDA, none on CPU, unless told otherwise."""
        if self.quant is not None:
            return self.quant
        return "nf4" if self.device.startswith("cuda") else "none"


def measure_throughput(backend: SpanBackend, tokens: int = 128) -> float:
    """Tokens per second through the whole span, without LoRA: what clients use to spread load."""
    hidden = torch.randn(1, tokens, backend.spec.hidden_size, device=backend.device, dtype=backend.dtype)
    with torch.no_grad():
        backend.run(hidden, None, backend.blocks)
        started = time.perf_counter()
        backend.run(hidden, None, backend.blocks)
    return tokens / max(time.perf_counter() - started, 1e-6)


class PeerDaemon:
    """One process serving blocks [start, end) of one model."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.spec = load_spec(config.model)
        self.swarm_key = load_swarm_key(config.swarm_key)
        self.identity = Identity.load_or_create(config.identity)
        self.blocks = range(config.start, config.end)
        self.state = ServerState.JOINING
        self.throughput = 0.0

    def _load(self) -> None:
        """Load the span (slow: runs in a thread while the event loop keeps the P2P connection alive)."""
        from swarm.blocks import DTYPES

        config = self.config
        self.backend = SpanBackend(
            self.spec,
            config.start,
            config.end,
            torch.device(config.device),
            DTYPES[config.dtype],
            config.quant_mode,
            activation_cache_bytes=config.activation_cache_mb << 20,
            max_tokens=config.max_tokens,
        )
        self.throughput = measure_throughput(self.backend)
        logger.info("blocks %d:%d loaded, %.0f tokens/s", config.start, config.end, self.throughput)

    def record(self) -> ServerRecord:
        adapters = (
            {name: min(adapter.steps().values()) for name, adapter in self.backend.adapters.items()}
            if hasattr(self, "backend")
            else {}
        )
        return ServerRecord(
            peer_id=self.identity.peer_id,
            state=self.state,
            start=self.config.start,
            end=self.config.end,
            throughput=self.throughput,
            adapters=adapters,
        )

    def info(self) -> dict:
        return {
            "model": self.spec.name,
            "start": self.config.start,
            "end": self.config.end,
            "state": self.state.value,
            "throughput": self.throughput,
            "adapters": {name: {str(b): s for b, s in a.steps().items()} for name, a in self.backend.adapters.items()},
        }

    def _announce(self, wait: bool):
        return announce(
            self.dht, self.spec.name, self.identity.owner, self.record(), self.blocks, self.config.record_ttl, wait
        )

    async def serve(self) -> None:
        """Join, check access, load, serve until SIGINT/SIGTERM; then announce leaving, finish in-flight work, go."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        config = self.config
        self.dht = join_dht(config.initial_peers, self.identity, self.swarm_key, host=config.host, port=config.port)
        p2p = await self.dht.replicate_p2p()
        await check_access(Transport(p2p, self.swarm_key), config.initial_peers)
        await asyncio.to_thread(self._announce, True)
        await asyncio.to_thread(self._load)
        service = PeerService(
            self.backend, self.info, Transport(p2p, self.swarm_key), self.swarm_key, self.config.max_payload_mb << 20
        )
        await service.register(p2p)
        self.state = ServerState.ONLINE
        logger.info("serving blocks %d:%d of %s as %s", self.config.start, self.config.end, self.spec.name, p2p.peer_id)
        while not stop.is_set():
            await asyncio.to_thread(self._announce, True)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.record_ttl / 3)
            except asyncio.TimeoutError:
                pass
        logger.info("leaving: announcing it, then finishing in-flight requests")
        self.state = ServerState.LEAVING
        await asyncio.to_thread(self._announce, True)
        await asyncio.sleep(self.config.leave_grace)
        await loop.run_in_executor(service.executor, lambda: None)
        await service.unregister(p2p)
        self.dht.shutdown()
        logger.info("left the swarm")


def run_peer(config: PeerConfig) -> None:
    daemon = PeerDaemon(config)
    asyncio.run(daemon.serve())
