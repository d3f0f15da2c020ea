"""What ``swarm peer`` is told (``PeerConfig``), and what a peer sizes from its device's memory when it is not told:
its compute dtype, its span's length, its bound on tokens in flight (swarm/memory.py counts the bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import psutil
import torch

from swarm.memory import DEFAULT_TOKENS, MemoryInputs, ModelShape, default_num_blocks, default_tokens_in_flight
from swarm.net.records import RECORD_TTL
from swarm.spec import ModelSpec


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


def span_length(spec: ModelSpec, config: PeerConfig, free: int) -> int:
    """How many blocks the peer serves: as told (``--blocks``, ``--num-blocks``), else as many as fit in ``free``."""
    told = len(config.blocks) if config.blocks else config.num_blocks
    return told or blocks_that_fit(spec, config, free)


def max_blocks(spec: ModelSpec, config: PeerConfig, span_len: int, free: int) -> int:
    """How many blocks the peer may grow to (to take orphaned ones over): ``--max-blocks``, else, for a peer told to
    serve fewer blocks than fit, what fits in ``free``; one sized by memory is full already. Never below its span."""
    if config.max_blocks:
        return max(span_len, config.max_blocks)
    told = config.blocks is not None or config.num_blocks is not None
    return max(span_len, blocks_that_fit(spec, config, free) if told else span_len)
