"""Measure what Llama-70B-shaped blocks cost a peer against swarm/memory.py, the one memory model that sizes a peer's
span (peers/config.py ``blocks_that_fit``): bytes of a loaded block, the device peak of a LoRA training step, and
the seconds a block takes forward, backward and at the commit.

It writes a 2-layer random model of the shape that matters most (hidden 8192, 64 heads, 8 KV heads, intermediate
28672) as a Hugging Face folder (config.json + sharded safetensors), serves both blocks with the project's own
``SpanBackend`` (nf4 through bitsandbytes, or plain bf16; compute in bf16), counts the bytes of a loaded block tensor
by tensor (the packed 4-bit data and its quantization state included), and trains one micro-batch of 1 x ``--seq``
tokens a step as a peer does: a forward that keeps each block's input (the activation cache), a backward that
recomputes one block at a time, an AdamW commit. Beside each measurement stands the model's figure:
``block_weight_bytes`` per block, and the device total of ``breakdown`` for the span loaded (the bench's LoRA, the
mode's quantization and compute dtype, ``--seq`` tokens, one micro-batch in flight and one a step, replication 1, no
bound on the activation cache, no generation sessions). Last, the blocks a peer with the daemon's defaults takes on
a ``--gpu-gib`` card at ``--seq`` tokens: ``default_num_blocks``.

With ``--device cuda`` the blocks live on the GPU and the caching allocator's figures are measured: bytes per block
at load, adapter state, and the peak of the measured steps (``max_memory_allocated`` over what was allocated before
loading). On a CPU, torch keeps no such figures and the process's RSS mixes in the model's build, glibc's retained
heap and memory-mapped weights, so the peak reads "n/a" (scripts/bench_memory.py measures peaks on a CPU, in
processes of their own). ``--tiny`` swaps the 70B shape for a small one of the same structure, so that the script
runs in seconds on a CPU (scripts/bench_gpu.sh does, in its ``--cpu`` mode and in its test); ``--json`` writes a
summary row per mode for that driver.

Usage::

    python scripts/bench_70b_block.py [--modes nf4 bf16] [--seq 2048 (--tiny: 128)] [--work-dir /tmp/swarm-70b-block]
        [--keep] [--steps 1] [--warmup 1] [--threads N] [--gpu-gib 24] [--total-blocks 80]
        [--device cpu|cuda|cuda:N] [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import peft
import psutil
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from peers.adapters import AdapterStore  # noqa: E402
from peers.backend import SpanBackend  # noqa: E402
from peers.commits import Commits  # noqa: E402
from swarm.blocks import lora_config_to_wire  # noqa: E402
from swarm.memory import (  # noqa: E402
    ACTIVATION_CACHE_MB,
    ALL_SEVEN,
    DEFAULT_IN_FLIGHT,
    DEFAULT_MICRO_BATCHES,
    LORA_BYTES,
    MAX_INFERENCE_MB,
    Lora,
    MemoryInputs,
    ModelShape,
    block_weight_bytes,
    breakdown,
    card_free_bytes,
    default_num_blocks,
    lora_params,
)
from swarm.net.protocol import OptimizerHParams  # noqa: E402
from swarm.spec import ModelSpec, load_spec  # noqa: E402

logger = logging.getLogger("bench_70b_block")

SHAPE = dict(
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    rms_norm_eps=1e-5,
    vocab_size=32000,
    num_hidden_layers=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# The same structure (GQA 8:1, SwiGLU, untied head) small enough for a CPU run of seconds; dimensions stay multiples
# of bitsandbytes' 64-value nf4 blocks.
TINY_SHAPE = {
    **SHAPE,
    **dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=1, intermediate_size=896, vocab_size=1024),
}
SEQ = 2048  # tokens of a micro-batch: the seed's case
TINY_SEQ = 128  # with --tiny: a bf16 backward of 2048 tokens takes seconds a block on a CPU
MODES = {"nf4": (torch.bfloat16, "nf4"), "bf16": (torch.bfloat16, "none")}  # compute dtype, --quant
LORA = Lora(rank=16, targets=ALL_SEVEN)
LORA_ALPHA = 32
HPARAMS = OptimizerHParams(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
GIB = 1 << 30
MB = 1e6


@dataclass
class ModeResult:
    """Everything measured for one quantization mode, and the memory model's figures beside it."""

    mode: str
    blocks: int = 0  # loaded and trained
    load_s: float = 0.0
    weights: dict[str, int] = field(default_factory=dict)  # category -> bytes, one block
    rss_anon_per_block: int = 0  # private memory grown by loading, per block
    rss_touched_per_block: int = 0  # private + mapped file memory after one forward has read every weight
    lora_params: int = 0  # bytes, one block
    lora_moments: int = 0
    lora_grads_per_mb: int = 0  # one block, one micro-batch
    lora_dtype: str = ""
    block_inputs_per_block: int = 0  # kept by a training forward (the activation cache), one micro-batch
    forward_s: float = 0.0  # the span's, one micro-batch
    backward_s: float = 0.0
    commit_s: float = 0.0
    # CUDA only (the caching allocator's figures, bytes): per block at load, per block of adapter state (LoRA +
    # AdamW moments, and the gradients kept for an undo) after training, the peak of the measured steps over what
    # was allocated before loading (everything: weights, adapter state, block inputs, one block's graph, gradients,
    # dequantized weights), and the device's free memory before loading
    cuda_weights_per_block: int = 0
    cuda_state_per_block: int = 0
    cuda_peak: int = 0
    cuda_free_before: int = 0
    # swarm/memory.py: one block's weights, the span's device parts at the bench's load, and the blocks a peer with
    # the daemon's defaults takes on a --gpu-gib card at --seq tokens
    model_weights_per_block: float = 0.0
    model_parts: dict[str, float] = field(default_factory=dict)
    card_blocks: int = 0
    error: str | None = None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def model_peak(self) -> float:
        return sum(self.model_parts.values())

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.commit_s

    def per_block(self, seconds: float) -> float:
        return seconds / self.blocks


# --- the model folder -----------------------------------------------------------------------------------------


def build_model(folder: Path, shape: dict) -> Path:
    """Write the 2-layer random model of ``shape`` in bf16 (reused when the folder is already complete)."""
    if (folder / "config.json").is_file() and (folder / "model.safetensors.index.json").is_file():
        logger.info("reusing %s", folder)
        return folder
    import transformers

    config = transformers.LlamaConfig(**shape)
    logger.info(
        "building a %d-layer model of hidden size %d in bfloat16 (random init) ...",
        shape["num_hidden_layers"],
        shape["hidden_size"],
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    logger.info("built in %.1f s; saving to %s", time.perf_counter() - started, folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="2GB" if shape is SHAPE else "1MB")  # sharded either way
    del model
    release_memory()
    return folder


# --- memory ---------------------------------------------------------------------------------------------------


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (and cached blocks back to CUDA), so that RSS and the
    allocator's figures reflect live tensors."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a timer read after it measures the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss() -> dict[str, int]:
    """Resident memory of this process, bytes: ``anon`` (private heap: what the process itself allocated) and
    ``file`` (mapped file pages: safetensors tensors are memory-mapped, so weights used straight from the file are
    counted here, as reclaimable page cache)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    if "RssAnon" not in status:  # not Linux: one figure
        return {"anon": psutil.Process().memory_info().rss, "file": 0}
    return {key: int(status[name].split()[0]) * 1024 for key, name in (("anon", "RssAnon"), ("file", "RssFile"))}


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState: absmax, code, offset, and the nested state's absmax and code."""
    found = []
    for holder in (state, getattr(state, "state2", None)):
        if holder is None:
            continue
        for attr in ("absmax", "code", "offset"):
            value = getattr(holder, attr, None)
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def layer_bytes(layer: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer of a loaded block, by kind, each storage counted once.

    A bitsandbytes ``Params4bit`` counts as its packed uint8 data (two 4-bit codes a byte) plus its QuantState:
    the per-64-value absmax (uint8 when nested), the nested state's float32 absmax per 256 absmax values, the
    16-entry code books and the float offset."""
    import bitsandbytes as bnb

    seen: set[tuple[int, int]] = set()
    kinds = {"packed 4-bit weights": 0, "quant state": 0, "dense weights": 0, "buffers": 0}

    def add(kind: str, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            kinds[kind] += key[1]

    for module in layer.modules():
        for param in module.parameters(recurse=False):
            if isinstance(param, bnb.nn.Params4bit):
                add("packed 4-bit weights", param.data)
                for tensor in quant_state_tensors(param.quant_state):
                    add("quant state", tensor)
            else:
                add("dense weights", param.data)
        for buffer in module.buffers(recurse=False):
            add("buffers", buffer)
    return {kind: size for kind, size in kinds.items() if size}


# --- the memory model -----------------------------------------------------------------------------------------


def bench_case(shape: ModelShape, mode: str, blocks: int, seq: int) -> MemoryInputs:
    """The bench's load as swarm/memory.py counts it: the span it loads, one micro-batch of ``seq`` tokens in flight
    and one a step, one pipeline, no bound on the activation cache, no generation sessions."""
    dtype, quant = MODES[mode]
    return MemoryInputs(
        shape,
        quant,
        dtype_bytes=torch.finfo(dtype).bits // 8,
        lora=LORA,
        blocks=blocks,
        tokens=seq,
        in_flight=1,
        micro_batches=1,
        replication=1,
        cache_bytes=None,
        inference_bytes=0.0,
    )


def card_case(shape: ModelShape, mode: str, seq: int, total_blocks: int) -> MemoryInputs:
    """A CUDA peer started with the daemon's defaults for this mode (peers/config.py ``memory_case``), at ``seq``
    tokens a micro-batch, on a model of ``total_blocks`` blocks of this shape."""
    return replace(
        bench_case(replace(shape, layers=total_blocks), mode, 1, seq),
        in_flight=DEFAULT_IN_FLIGHT,
        micro_batches=DEFAULT_MICRO_BATCHES,
        replication=2,
        cache_bytes=ACTIVATION_CACHE_MB << 20,
        inference_bytes=MAX_INFERENCE_MB << 20,
    )


def model_figures(spec: ModelSpec, mode: str, args: argparse.Namespace, result: ModeResult) -> None:
    """Fill in the model's side: weights per block, the device parts of the span's peak, the card's span."""
    shape = ModelShape.from_config(spec.config.to_dict())
    case = bench_case(shape, mode, result.blocks, args.seq)
    result.model_weights_per_block = block_weight_bytes(shape, case.quant, case.dtype_bytes)
    parts = breakdown(case)
    result.model_parts = {k: v for k, v in parts.parts().items() if k not in parts.HOST}
    card = card_case(shape, mode, args.seq, args.total_blocks)
    result.card_blocks = default_num_blocks(card, card_free_bytes(args.gpu_gib))


# --- one mode -------------------------------------------------------------------------------------------------


def train_step(
    backend: SpanBackend, blocks: range, step: int, seq: int, result: ModeResult, measure: bool
) -> tuple[float, float, float]:
    """One micro-batch of 1 x ``seq`` tokens as a peer trains it: forward (each block's input kept), backward (one
    block recomputed at a time), commit. Returns (forward s, backward s, commit s) of the span; with ``measure``,
    records the bytes of the block inputs kept and of the LoRA gradients."""
    generator = torch.Generator().manual_seed(step)
    hidden = torch.randn(1, seq, backend.spec.hidden_size, generator=generator)
    grad_out = torch.randn(1, seq, backend.spec.hidden_size, generator=generator) * 1e-3
    mb = f"bench:{step}:0"
    synchronize(backend.device)
    started = time.perf_counter()
    backend.forward("bench", blocks, step, hidden, None, mb)
    synchronize(backend.device)
    forward_s = time.perf_counter() - started
    # the activation cache holds this forward's block inputs (each storage once), its only entry
    cached = backend.adapters.cache.bytes
    started = time.perf_counter()
    backend.backward("bench", blocks, step, mb, None, None, grad_out, input_grad=True)
    synchronize(backend.device)
    backward_s = time.perf_counter() - started
    if measure:
        result.block_inputs_per_block = cached // len(blocks)
        grads = backend.adapters.adapter("bench").blocks[blocks.start].grads[mb]
        result.lora_grads_per_mb = sum(g.nbytes for g in grads)
    started = time.perf_counter()
    Commits(backend.adapters).apply("bench", step, {b: [(mb,)] for b in blocks}, HPARAMS)  # one holder, one micro-batch
    synchronize(backend.device)
    commit_s = time.perf_counter() - started
    return forward_s, backward_s, commit_s


def _mb(parts: dict[str, int]) -> dict[str, int]:
    return {key: round(value / MB) for key, value in parts.items()}


def touch(backend: SpanBackend, blocks: range) -> None:
    """One token through the span without grad, so that every weight has been read once (pages mapped in)."""
    with torch.no_grad():
        backend.run(
            torch.zeros(1, 1, backend.spec.hidden_size, dtype=backend.dtype, device=backend.device), None, blocks
        )
    release_memory()


def run_mode(spec: ModelSpec, mode: str, args: argparse.Namespace) -> ModeResult:
    """Load both blocks as a peer does, count their bytes, train, count the adapter state and the peak."""
    dtype, quant = MODES[mode]
    blocks = range(0, spec.num_blocks)
    result = ModeResult(mode, blocks=len(blocks))
    model_figures(spec, mode, args, result)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    release_memory()
    before = rss()
    if cuda:
        result.cuda_free_before = torch.cuda.mem_get_info(device)[0]
        allocated_before = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    backend = SpanBackend(spec, blocks, device, dtype, quant, AdapterStore(spec))
    synchronize(device)
    result.load_s = time.perf_counter() - started
    release_memory()
    loaded = rss()
    if cuda:
        allocated_loaded = torch.cuda.memory_allocated(device)
        result.cuda_weights_per_block = (allocated_loaded - allocated_before) // len(blocks)
    touch(backend, blocks)
    touched = rss()
    result.rss_anon_per_block = (loaded["anon"] - before["anon"]) // len(blocks)
    growth = sum(touched.values()) - sum(before.values())
    result.rss_touched_per_block = growth // len(blocks)
    logger.info(
        "%s: RSS before %s, loaded %s, after a first forward %s (MB)", mode, *map(_mb, (before, loaded, touched))
    )
    result.weights = layer_bytes(backend.layers[0])
    logger.info("%s: loaded %d blocks in %.1f s; block 0 holds %s", mode, len(blocks), result.load_s, result.weights)

    config = peft.LoraConfig(r=LORA.rank, lora_alpha=LORA_ALPHA, target_modules=list(LORA.targets))
    backend.adapters.open_adapter("bench", lora_config_to_wire(config), seed=0, session="bench")
    timings = []
    for step in range(args.warmup + args.steps):
        if cuda and step == args.warmup:  # the peak of measured steps: AdamW moments exist by then
            torch.cuda.reset_peak_memory_stats(device)
        times = train_step(backend, blocks, step, args.seq, result, measure=step == 0)
        kind = "warm-up" if step < args.warmup else "measured"
        logger.info("%s: %s step %d: forward %.3f s, backward %.3f s, commit %.3f s", mode, kind, step, *times)
        if step >= args.warmup:
            timings.append(times)
    result.forward_s, result.backward_s, result.commit_s = min(timings, key=sum)  # the fastest measured step
    if cuda:
        result.cuda_peak = torch.cuda.max_memory_allocated(device) - allocated_before
        result.cuda_state_per_block = (torch.cuda.memory_allocated(device) - allocated_loaded) // len(blocks)

    state = backend.adapters.adapter("bench").blocks[0]
    result.lora_params = sum(lp.param.nbytes for lp in state.params)
    result.lora_dtype = str(state.params[0].param.dtype).removeprefix("torch.")
    result.lora_moments = sum(
        value.nbytes
        for lp in state.params
        for key, value in state.optimizer.state.get(lp.param, {}).items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    del backend, state
    release_memory()
    return result


# --- report ---------------------------------------------------------------------------------------------------


def measured_peak(result: ModeResult) -> str:
    return f"{result.cuda_peak / MB:,.1f} MB" if result.cuda_peak else "n/a"


def peak_ratio(result: ModeResult) -> str:
    return f"{result.cuda_peak / result.model_peak:.3f}" if result.cuda_peak else "n/a"


def report(spec: ModelSpec, results: list[ModeResult], args: argparse.Namespace, command: str) -> str:
    """The markdown tables: weights, step times and adapter state, the span's peak, the card's span."""
    shape = ModelShape.from_config(spec.config.to_dict())
    lora_n = lora_params(shape, LORA)
    n = spec.num_blocks
    lines = [
        f"Command: `{command}`",
        "",
        f"Block: {shape.linear_params():,} linear weights + {shape.norm_params():,} norm weights (hidden "
        f"{shape.hidden}, heads {shape.heads}, KV heads {shape.kv_heads}, intermediate {shape.intermediate}); LoRA "
        f"r={LORA.rank} alpha={LORA_ALPHA} on {len(LORA.targets)} projections = {lora_n:,} parameters per block; "
        f"a step: one micro-batch of 1 x {args.seq} tokens through {n} blocks (forward keeping each block's input, "
        "backward recomputing one block at a time, AdamW commit). Model: swarm/memory.py.",
        "",
        "| mode | weights/block measured | of which (MB) | RSS growth/block: anon at load; anon+file after use "
        f"| model (`block_weight_bytes`) | measured / model | load {n} blocks |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.mode} | failed: {r.error} | | | | | |")
            continue
        params = shape.linear_params()
        parts = ", ".join(f"{k} {v / MB:,.1f}" for k, v in r.weights.items())
        lines.append(
            f"| {r.mode} | {r.weight_bytes / MB:,.1f} MB ({r.weight_bytes / params:.4f} B/linear weight) | {parts} "
            f"| {r.rss_anon_per_block / MB:,.1f} MB; {r.rss_touched_per_block / MB:,.1f} MB "
            f"| {r.model_weights_per_block / MB:,.1f} MB ({r.model_weights_per_block / params:.4f} B/linear weight) "
            f"| {r.weight_bytes / r.model_weights_per_block:.3f} | {r.load_s:.1f} s |"
        )
    lines += [
        "",
        f"Seconds per block (the fastest of {args.steps} measured step(s) after {args.warmup} warm-up, divided by "
        f"{n}); bytes per block, one micro-batch (model: {lora_n:,} x {LORA_BYTES} B of LoRA, twice that of AdamW "
        f"moments, as much of gradients; block inputs {args.seq} x {shape.hidden} x 2 B).",
        "",
        f"| mode | forward s/block | backward s/block | commit s/block | step s ({n} blocks) | LoRA params/block "
        "| AdamW moments/block | LoRA grads/block/micro-batch | block inputs kept/block/micro-batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            continue
        lines.append(
            f"| {r.mode} | {r.per_block(r.forward_s):.4f} | {r.per_block(r.backward_s):.4f} "
            f"| {r.per_block(r.commit_s):.4f} | {r.total_s:.3f} | {r.lora_params / MB:.2f} MB ({r.lora_dtype}) "
            f"| {r.lora_moments / MB:.2f} MB | {r.lora_grads_per_mb / MB:.2f} MB "
            f"| {r.block_inputs_per_block / MB:.2f} MB |"
        )
    where = (
        "CUDA `max_memory_allocated` over what was allocated before loading, the measured steps"
        if args.device.startswith("cuda")
        else "no allocator statistics on a CPU: n/a"
    )
    lines += [
        "",
        f"The span's device peak: the model's (`breakdown` of {n} blocks, {args.seq} tokens, one micro-batch in flight "
        f"and one a step, replication 1, no cache bound, no generation; its device parts) against the measured "
        f"({where}). Blocks a {args.gpu_gib:g} GiB card takes: `default_num_blocks` on "
        f"{card_free_bytes(args.gpu_gib) / GIB:.1f} GiB free for a CUDA peer with the daemon's defaults "
        f"({DEFAULT_IN_FLIGHT} micro-batches of {args.seq} tokens in flight, {DEFAULT_MICRO_BATCHES} a step, "
        f"replication 2, activation cache {ACTIVATION_CACHE_MB} MiB, generation {MAX_INFERENCE_MB} MiB), of "
        f"{args.total_blocks} blocks.",
        "",
        "| mode | model peak | of which (MB) | measured peak | measured / model | free before load "
        f"| blocks a {args.gpu_gib:g} GiB card takes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            continue
        parts = ", ".join(f"{k} {v / MB:,.1f}" for k, v in r.model_parts.items() if v)
        free = f"{r.cuda_free_before / GIB:,.1f} GiB" if r.cuda_free_before else "n/a"
        lines.append(
            f"| {r.mode} | {r.model_peak / MB:,.1f} MB | {parts} | {measured_peak(r)} | {peak_ratio(r)} | {free} "
            f"| {r.card_blocks} |"
        )
    return "\n".join(lines)


def summary_rows(results: list[ModeResult]) -> list[dict]:
    """One row per mode for scripts/bench_gpu.py's table: seconds per block, and bytes against the model."""
    rows = []
    for r in results:
        if r.error:
            rows.append(dict(mode=r.mode, ok=False, error=r.error, figures={}))
            continue
        figures = {
            "forward s/block": r.per_block(r.forward_s),
            "backward s/block": r.per_block(r.backward_s),
            "commit s/block": r.per_block(r.commit_s),
            "weights/block MB": r.weight_bytes / MB,
            "model weights/block MB": r.model_weights_per_block / MB,
            "peak MB": r.cuda_peak / MB if r.cuda_peak else "n/a",
            "model peak MB": r.model_peak / MB,
            "peak/model": r.cuda_peak / r.model_peak if r.cuda_peak else "n/a",
            "blocks on 24 GiB": r.card_blocks,
        }
        rows.append(dict(mode=r.mode, ok=True, figures=figures, detail=asdict(r)))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["nf4", "bf16"])
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"tokens of the one micro-batch (batch 1); default {SEQ}, {TINY_SEQ} with --tiny",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/swarm-70b-block"))
    parser.add_argument("--keep", action="store_true", help="keep the model folder (~4.5 GB; reused next run)")
    parser.add_argument("--steps", type=int, default=1, help="measured training steps per mode (best one reported)")
    parser.add_argument("--warmup", type=int, default=1, help="training steps before the measured ones")
    parser.add_argument("--gpu-gib", type=float, default=24.0, help="the card whose default span is reported")
    parser.add_argument("--total-blocks", type=int, default=80, help="the model's blocks, for that span")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the blocks live")
    parser.add_argument("--tiny", action="store_true", help="a small shape of the same structure (seconds on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write a summary row per mode here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.seq is None:
        args.seq = TINY_SEQ if args.tiny else SEQ
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> None:
    """Build (or reuse) the model folder, measure each mode in turn, print the tables."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = " ".join(["python", "scripts/bench_70b_block.py", *(sys.argv[1:] if argv is None else argv)])
    shape = TINY_SHAPE if args.tiny else SHAPE
    folder = build_model(args.work_dir / f"llama-{'tiny' if args.tiny else '70b'}-shape-2-layers", shape)
    try:
        spec = load_spec(folder)
        results = []
        for mode in args.modes:
            try:
                results.append(run_mode(spec, mode, args))
            except Exception as error:  # report it and go on with the other modes: never a made-up figure
                logger.exception("%s failed", mode)
                results.append(ModeResult(mode, error=f"{type(error).__name__}: {error}"))
                release_memory()
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(report(spec, results, args, command))
        gpu = f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""
        print(
            f"\nMachine: {os.cpu_count()} CPUs{gpu}, torch {torch.__version__} on {torch.get_num_threads()} threads; "
            f"load average at the end {load}."
        )
        if args.json:
            args.json.write_text(json.dumps(summary_rows(results), indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
