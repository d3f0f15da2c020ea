"""What a peer holds in memory, by what holds it: the one model of it (issue 57). The daemon sizes its default span
with it (peers/config.py ``blocks_that_fit``), the plan on paper prints it (scripts/plan_swarm.py) and
scripts/bench_memory.py measures it. Nothing here measures anything.

Every part follows what the code keeps. On the device: the blocks' base weights; per block its adapter (LoRA and
AdamW's two moments, fp32 on any base: swarm/blocks.py ``add_lora``) and the LoRA gradients of each micro-batch it
ran, kept until the step commits and then one step more, for an undo (peers/state.py ``Undo``); each block's input
per micro-batch in flight (peers/backend.py: a training forward keeps no graph, only these, in the activation
cache); one block's graph of one micro-batch (the backward recomputes one block at a time), and what a backward and
a dequantized weight need beside it; the generation sessions' bound. In host memory (the device itself on a CPU
peer): the span input of each micro-batch until its step commits (peers/state.py ``KeptInputs``), standby copies,
and what a commit keeps (the state before it, its update, the partial sums fetched from the other holders).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

GIB = 1 << 30
ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_BYTES = 4  # adapters, their moments and gradients are fp32 on any base (swarm/blocks.py ``add_lora``)
FP32 = 4  # RMSNorm computes in fp32 whatever the compute dtype, and saves its input so
# The tensor each LoRA target takes as input: q, k and v share one, gate and up another.
LORA_INPUTS = {
    "q_proj": "normed",
    "k_proj": "normed",
    "v_proj": "normed",
    "o_proj": "attention",
    "gate_proj": "post_normed",
    "up_proj": "post_normed",
    "down_proj": "product",
}

# bitsandbytes' NF4 (Params4bit defaults): 4 bits a weight, a uint8 absmax per 64 weights (nested quantization), an
# fp32 absmax per 256 of those. docs/benchmarks/scale.md "70B-shaped blocks" measured 0.5159 B/param on a 70B block.
# Unquantized ("none"): the compute dtype's bytes.
WEIGHT_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0}

# What a backward needs beside the block's graph, per token: fp32 values of the MLP's width (the gradients of the
# down projection's input, through the base and through peft's fp32 LoRA path, and of gate and up). Fitted to
# scripts/bench_memory.py's peaks on CPU: 1.7 such values a token in fp32, 2.1 in bf16
# (docs/benchmarks/memory.md).
WORKSPACE_PER_TOKEN = 2.0
FREE_SHARE = 0.9  # of the free memory, the rest for the allocator's fragmentation and what this model leaves out
CUDA_CONTEXT_GIB = 0.4  # in use before a peer loads: ~23.6 GiB free on a 24 GiB card (docs/benchmarks/scale.md)

# The load a peer sizes its default span for: micro-batches of 2048 tokens, as many in flight through it as a client
# keeps at least (swarm/client/routing.py MIN_IN_FLIGHT, all on one pipeline), 16 a step (the seed's case).
DEFAULT_TOKENS, DEFAULT_IN_FLIGHT, DEFAULT_MICRO_BATCHES = 2048, 4, 16
# A peer's bounds on its activation cache, generation sessions and kept span inputs unless told (peers/config.py
# ``PeerConfig``: --activation-cache-mb, --max-inference-mb, --kept-inputs-mb), for plans of peers started with their
# defaults.
ACTIVATION_CACHE_MB, MAX_INFERENCE_MB, KEPT_INPUTS_MB = 1024, 1024, 4096


@dataclass(frozen=True)
class ModelShape:
    """The fields of a Llama-family config that sizes depend on; a mixture of experts' too (``experts`` > 0)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int
    experts: int = 0
    expert_intermediate: int = 0  # one expert's width
    experts_per_token: int = 0

    @classmethod
    def from_config(cls, config: Mapping, name: str = "") -> ModelShape:
        """From a config.json's fields (a transformers config: its ``to_dict()``)."""
        heads = config["num_attention_heads"]
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        return cls(
            name=name or config.get("_name_or_path", "") or config.get("model_type", "model"),
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            vocab=config["vocab_size"],
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            experts=experts,
            expert_intermediate=(config.get("moe_intermediate_size") or config["intermediate_size"]) if experts else 0,
            experts_per_token=config.get("num_experts_per_tok", 0) if experts else 0,
        )

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of a dense block (Qwen3: q wider than hidden)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_params(self) -> int:
        """A dense block's linear weights: what quantization stores."""
        return sum(a * b for a, b in self.projections().values())

    def attention_params(self) -> int:
        return sum(a * b for name, (a, b) in self.projections().items() if name in ALL_SEVEN[:4])

    def expert_params(self) -> int:
        """A sparse block's experts and router: bare parameters, which stay unquantized."""
        return self.experts * (3 * self.expert_intermediate + 1) * self.hidden

    def norm_params(self) -> int:
        return 2 * self.hidden

    def mlp_width(self) -> int:
        """The MLP activations' width per token: a dense block's, or the experts' each token runs through."""
        return self.experts_per_token * self.expert_intermediate if self.experts else self.intermediate


def load_shape(path: str | Path) -> ModelShape:
    path = Path(path)
    return ModelShape.from_config(json.loads(path.read_text()), name=path.stem)


@dataclass(frozen=True)
class Lora:
    rank: int = 16
    targets: tuple[str, ...] = ALL_SEVEN


def lora_tensors(shape: ModelShape, lora: Lora) -> list[torch.Tensor]:
    """One block's LoRA tensors as peers hold them and send their gradients: A (r x in) and B (out x r) per target,
    fp32. On the meta device: shapes only."""
    projections = shape.projections()
    unknown = set(lora.targets) - set(projections)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; known: {sorted(projections)}")
    tensors = []
    for name in lora.targets:
        fan_in, fan_out = projections[name]
        tensors.append(torch.empty(lora.rank, fan_in, dtype=torch.float32, device="meta"))
        tensors.append(torch.empty(fan_out, lora.rank, dtype=torch.float32, device="meta"))
    return tensors


def lora_params(shape: ModelShape, lora: Lora) -> int:
    return sum(t.numel() for t in lora_tensors(shape, lora))


def block_weight_bytes(shape: ModelShape, quant: str, dtype_bytes: int) -> float:
    """One block's base weights as loaded: linear weights quantized (or in the compute dtype), norms in the compute
    dtype. A sparse block keeps its experts unquantized; a model may mix dense and sparse blocks (Qwen3-MoE's
    ``mlp_only_layers``), so every block counts as the larger of the two."""
    per_weight = WEIGHT_BYTES.get(quant, dtype_bytes)
    dense = shape.linear_params() * per_weight
    if shape.experts:
        dense = max(dense, shape.attention_params() * per_weight + shape.expert_params() * dtype_bytes)
    return dense + shape.norm_params() * dtype_bytes


def graph_bytes_per_token(shape: ModelShape, lora: Lora, dtype_bytes: int) -> float:
    """What autograd saves per token for one block (sdpa attention, LoRA through peft), as peers/state.py
    ``SavedBytes`` counts it tensor by tensor. Each RMSNorm: its input in fp32 and a scalar. Each LoRA target: its
    A's output (r, fp32) and its input, which peft casts to fp32 (a copy per target) unless the block computes in
    fp32 (then the input itself: one for q, k and v, one for gate and up, attention's output for o). Attention: q, k,
    v, its output, a log-sum-exp per head, cos and sin (per position: counted per token of a batch of one). The MLP:
    gate's, up's and silu's outputs. The frozen base linears save nothing."""
    h, i, c = shape.hidden, shape.mlp_width(), dtype_bytes
    projections = shape.projections()
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (FP32 * h + FP32)
    attention = c * (2 * q + 2 * kv + 2 * shape.head_dim) + FP32 * shape.heads
    mlp = 3 * c * i
    targets = set(lora.targets)
    if c == LORA_BYTES:  # no cast: each distinct input once (attention's output is counted with attention)
        distinct = {LORA_INPUTS[t]: projections[t][0] for t in targets}
        lora_inputs = sum(LORA_BYTES * width for source, width in distinct.items() if source != "attention")
    else:
        lora_inputs = sum(LORA_BYTES * projections[t][0] for t in targets)
    return norms + attention + mlp + lora_inputs + len(targets) * lora.rank * LORA_BYTES


@dataclass(frozen=True)
class MemoryInputs:
    """A peer's case: the model, how it computes it, the LoRA trained on it, its span, and the load on it."""

    shape: ModelShape
    quant: str = "none"  # none, int8, nf4, as peers/config.py ``--quant``
    dtype_bytes: int = 2  # the compute dtype's
    lora: Lora = Lora()
    blocks: int = 1  # the span's length
    standby_blocks: int | None = None  # None: as many as the span (the daemon's default --standby-blocks)
    tokens: int = DEFAULT_TOKENS  # per micro-batch
    in_flight: int = DEFAULT_IN_FLIGHT  # micro-batches between their forward and their backward here
    micro_batches: int = DEFAULT_MICRO_BATCHES  # a step's, over all pipelines
    replication: int = 2  # pipelines (and holders of each block)
    cache_bytes: float | None = None  # the activation cache's bound (--activation-cache-mb); None: every in flight
    inference_bytes: float = 0.0  # generation sessions' keys and values (--max-inference-mb)
    on_host: bool = False  # the device is the host (a CPU peer): host memory counts too

    @property
    def standby(self) -> int:
        return self.blocks if self.standby_blocks is None else self.standby_blocks

    @property
    def own_micro_batches(self) -> int:
        """The step's micro-batches through this peer: those of its pipeline, one of ``replication``."""
        return math.ceil(self.micro_batches / max(1, self.replication))


@dataclass(frozen=True)
class Breakdown:
    """Bytes a peer holds, by what holds them; ``total`` what counts against its device's free memory."""

    weights: float  # base weights, all blocks
    adapters: float  # LoRA + AdamW's two moments
    grads: float  # this step's micro-batch gradients and the last step's, kept for an undo
    block_inputs: float  # each block's input per micro-batch in flight (the activation cache)
    graph: float  # one block's graph of one micro-batch
    workspace: float  # what a backward needs beside it, and one dequantized weight
    inference: float  # generation sessions
    span_inputs: float  # host: each micro-batch's span input until its step commits
    standby: float  # host: standby copies (state, and the state before their last update)
    applied: float  # host: per block the state before its last apply, its update, partial sums fetched (now, last)
    on_host: bool

    HOST = ("span_inputs", "standby", "applied")

    def parts(self) -> dict[str, float]:
        """Every part by name, the device's first."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "on_host"}

    @property
    def device(self) -> float:
        return sum(v for k, v in self.parts().items() if k not in self.HOST)

    @property
    def host(self) -> float:
        return sum(getattr(self, k) for k in self.HOST)

    @property
    def total(self) -> float:
        return self.device + (self.host if self.on_host else 0.0)


def breakdown(case: MemoryInputs) -> Breakdown:
    """A peer's peak, part by part: the most each part holds, all at once (a commit's parts peak after the last
    micro-batch's backward, the activations while micro-batches are in flight: counted together, so an upper bound)."""
    shape, c, n = case.shape, case.dtype_bytes, case.blocks
    grad = lora_params(shape, case.lora) * LORA_BYTES
    own = case.own_micro_batches
    hidden = shape.hidden * case.tokens * c  # one hidden-state tensor of a micro-batch
    span = n * hidden  # one micro-batch's block inputs
    kept = case.in_flight
    if case.cache_bytes is not None and span > 0:  # the one computing, and those the cache holds
        kept = min(kept, 1 + int(case.cache_bytes // span))
    dequantized = 0 if case.quant == "none" else max(a * b for a, b in shape.projections().values()) * c
    others = max(0, case.replication - 1)
    return Breakdown(
        weights=n * block_weight_bytes(shape, case.quant, c),
        adapters=n * 3 * grad,
        grads=n * 2 * own * grad,
        block_inputs=kept * span,
        graph=graph_bytes_per_token(shape, case.lora, c) * case.tokens,
        workspace=WORKSPACE_PER_TOKEN * shape.mlp_width() * case.tokens * FP32 + dequantized,
        inference=case.inference_bytes,
        span_inputs=own * hidden,
        standby=case.standby * 2 * 3 * grad,
        applied=n * (3 + 1 + 2 * others) * grad,
        on_host=case.on_host,
    )


def default_num_blocks(case: MemoryInputs, free_bytes: float, share: float = FREE_SHARE) -> int:
    """The span a peer takes by default: the longest (at most the model's blocks, at least one) whose total fits in
    ``share`` of ``free_bytes``. The total grows with the span by a block's weights, adapter, gradients and inputs;
    its activations stay one block's graph."""
    budget = share * free_bytes
    fits = [n for n in range(1, case.shape.layers + 1) if breakdown(replace(case, blocks=n)).total <= budget]
    return max(fits, default=1)


def tokens_in_flight_bound(case: MemoryInputs, free_bytes: float, share: float = FREE_SHARE) -> int:
    """The most tokens of micro-batches in flight whose block inputs a peer with ``case``'s span keeps on its device
    within ``share`` of ``free_bytes`` (with room for one micro-batch of ``case.tokens`` computing): 0 if not one."""
    idle = breakdown(replace(case, in_flight=0, cache_bytes=None))
    per_token = case.blocks * case.shape.hidden * case.dtype_bytes
    return max(0, int((share * free_bytes - idle.total) // per_token))


def default_tokens_in_flight(
    case: MemoryInputs, free_bytes: float, kept_inputs_bytes: float, share: float = FREE_SHARE
) -> int:
    """The most tokens in flight a peer admits unless told: what memory in-flight micro-batches fill first. Block
    inputs past the activation cache are not kept on the device (a backward recomputes them from the span input in
    host memory), so where the cache and the micro-batch computing fit in the device's room for block inputs
    (``tokens_in_flight_bound``), micro-batches in flight never fill the device: their span inputs, kept in host
    memory until the step commits (``kept_inputs_bytes``, fp32 at most), do first. Else the room bounds them."""
    room = tokens_in_flight_bound(case, free_bytes, share)
    if case.cache_bytes is None:
        return room
    cached = case.tokens + int(case.cache_bytes // (case.blocks * case.shape.hidden * case.dtype_bytes))
    return room if cached > room else int(kept_inputs_bytes // (case.shape.hidden * FP32))


def card_free_bytes(memory_gib: float) -> float:
    """A card's free memory before a peer loads: its size less a CUDA context."""
    return (memory_gib - CUDA_CONTEXT_GIB) * GIB
