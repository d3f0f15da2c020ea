"""Measure what one Llama-70B-shaped block costs a peer: bytes on the device, one LoRA training step, LoRA + AdamW
state, and how many blocks (and peers) that means on a 24 GiB GPU.

``swarm peer`` sizes its span from an estimate (``blocks_that_fit`` in peers/daemon.py: parameters times
``QUANT_BYTES`` or the dtype's bytes, times a 1.25 margin). This script checks that estimate against the real
thing for the shape that matters most (hidden 8192, 64 heads, 8 KV heads, intermediate 28672): it writes a 2-layer
random model of that shape as a Hugging Face folder (config.json + sharded safetensors), serves both blocks with
the project's own ``SpanBackend`` (nf4 through bitsandbytes, or plain bf16), counts the bytes of a loaded block
tensor by tensor (the packed 4-bit data and its quantization state included), times forward / backward / AdamW
commit of one micro-batch, and derives blocks per peer and peers for 80 blocks at replication 2.

With ``--device cuda`` the blocks live on the GPU and the allocator's own figures (bytes per loaded block, the peak
of a training step) are set against the per-block budget ``--num-blocks`` assumes. ``--tiny`` swaps the 70B shape
for a small one of the same structure, so that the script runs in seconds on a CPU (scripts/bench_gpu.sh does, in
its ``--cpu`` mode and in its test); ``--json`` writes a summary row per mode for that driver.

Usage::

    python scripts/bench_70b_block.py [--modes nf4 bf16] [--seq 128] [--work-dir /tmp/swarm-70b-block] [--keep]
        [--steps 1] [--warmup 1] [--threads N] [--gpu-gib 24] [--reserve-gib 1.5] [--in-flight 4]
        [--device cpu|cuda|cuda:N] [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
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
from peers.daemon import QUANT_BYTES  # noqa: E402
from swarm.blocks import lora_config_to_wire  # noqa: E402
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
MODES = {"nf4": (torch.bfloat16, "nf4"), "bf16": (torch.bfloat16, "none")}
DAEMON_DTYPE = {"nf4": "bfloat16", "bf16": "bfloat16"}  # the --dtype a peer would be given for each mode
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 16, 32
HPARAMS = OptimizerHParams(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
MARGIN = 1.25  # blocks_that_fit's margin for LoRA and activations
GIB = 1 << 30
MB = 1e6


@dataclass
class ModeResult:
    """Everything measured for one quantization mode."""

    mode: str
    load_s: float = 0.0
    weights: dict[str, int] = field(default_factory=dict)  # category -> bytes, one block
    rss_anon_per_block: int = 0  # private memory grown by loading, per block
    rss_touched_per_block: int = 0  # private + mapped file memory after one forward has read every weight
    estimate: float = 0.0  # params * per_param bytes, one block, no margin
    lora_params: int = 0
    lora_moments: int = 0
    lora_grads_per_mb: int = 0
    lora_dtype: str = ""
    activations_per_block: int = 0  # saved for backward, one micro-batch
    forward_s: float = 0.0
    backward_s: float = 0.0
    commit_s: float = 0.0
    # CUDA only (the caching allocator's figures, bytes): per block at load, per block of adapter state (LoRA +
    # AdamW moments) after training, per block at the peak of a training step (all of it: weights, state, the
    # micro-batch's activations and gradients, transient dequantized weights), and the device's free memory before
    # loading (what ``blocks_that_fit`` would have seen)
    cuda_weights_per_block: int = 0
    cuda_state_per_block: int = 0
    cuda_peak_per_block: int = 0
    cuda_free_before: int = 0
    error: str | None = None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.commit_s


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


# --- the estimate ---------------------------------------------------------------------------------------------


def block_params(spec: ModelSpec) -> int:
    """The parameter count ``blocks_that_fit`` uses: the 7 projections (norms left out)."""
    c = spec.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    return 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size


def estimate_bytes(spec: ModelSpec, mode: str) -> float:
    """Per-block base-weight bytes implied by ``blocks_that_fit`` for this mode, without its 1.25 margin."""
    quant = MODES[mode][1]
    per_param = QUANT_BYTES.get(quant, torch.finfo(getattr(torch, DAEMON_DTYPE[mode])).bits / 8)
    return block_params(spec) * per_param


def lora_formula(spec: ModelSpec) -> int:
    """LoRA parameters of one block: r * (in + out) per targeted projection."""
    c = spec.config
    h, inter = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    shapes.update({"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)})
    return sum(LORA_R * (i + o) for name, (i, o) in shapes.items() if name in TARGET_MODULES)


# --- one mode -------------------------------------------------------------------------------------------------


def train_step(
    backend: SpanBackend, blocks: range, step: int, seq: int, result: ModeResult, measure: bool
) -> tuple[float, float, float]:
    """One micro-batch of 1 x ``seq`` tokens: forward (graph kept), backward from the cached forward, commit.
    Returns (forward s, backward s, commit s); with ``measure``, records activation and gradient bytes."""
    generator = torch.Generator().manual_seed(step)
    hidden = torch.randn(1, seq, backend.spec.hidden_size, generator=generator)
    grad_out = torch.randn(1, seq, backend.spec.hidden_size, generator=generator) * 1e-3
    mb = f"bench:{step}:0"
    synchronize(backend.device)
    started = time.perf_counter()
    backend.forward("bench", blocks, step, hidden, None, mb)
    synchronize(backend.device)
    forward_s = time.perf_counter() - started
    # the backend counts what autograd keeps of the forward it caches for the backward (peers/state.py SavedBytes:
    # each storage once, the blocks' weights left out); this forward is the only entry in its cache
    cached = backend.adapters.cache.bytes
    started = time.perf_counter()
    backend.backward("bench", blocks, step, mb, None, None, grad_out, input_grad=True)
    synchronize(backend.device)
    backward_s = time.perf_counter() - started
    if measure:
        result.activations_per_block = cached // len(blocks)
        grads = backend.adapters.adapter("bench").blocks[blocks.start].grads[mb]
        result.lora_grads_per_mb = sum(g.nbytes for g in grads)
    started = time.perf_counter()
    backend.adapters.apply("bench", step, {b: [(mb,)] for b in blocks}, HPARAMS)  # one holder, one micro-batch
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
    """Load both blocks as a peer does, count their bytes, train, count the adapter state."""
    dtype, quant = MODES[mode]
    result = ModeResult(mode, estimate=estimate_bytes(spec, mode))
    blocks = range(0, spec.num_blocks)
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

    config = peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES)
    backend.adapters.open_adapter("bench", lora_config_to_wire(config), seed=0, session="bench")
    timings = []
    for step in range(args.warmup + args.steps):
        if cuda and step == args.warmup:  # the peak of measured steps: AdamW moments exist by then
            torch.cuda.reset_peak_memory_stats(device)
        times = train_step(backend, blocks, step, args.seq, result, measure=step == 0)
        kind = "warm-up" if step < args.warmup else "measured"
        logger.info("%s: %s step %d: forward %.2f s, backward %.2f s, commit %.2f s", mode, kind, step, *times)
        if step >= args.warmup:
            timings.append(times)
    result.forward_s, result.backward_s, result.commit_s = min(timings, key=sum)  # the fastest measured step
    if cuda:
        result.cuda_peak_per_block = (torch.cuda.max_memory_allocated(device) - allocated_before) // len(blocks)
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


# --- what it means on a GPU -----------------------------------------------------------------------------------


def per_block_on_gpu(result: ModeResult, in_flight: int) -> int:
    """Device bytes one served block needs: weights, LoRA + AdamW moments, and per micro-batch in flight its saved
    activations and its LoRA gradients (kept per micro-batch until the commit)."""
    per_mb = result.activations_per_block + result.lora_grads_per_mb
    return result.weight_bytes + result.lora_params + result.lora_moments + in_flight * per_mb


def blocks_per_peer(result: ModeResult, args: argparse.Namespace) -> int:
    usable = args.gpu_gib * GIB * 0.9 - args.reserve_gib * GIB
    return max(0, int(usable // per_block_on_gpu(result, args.in_flight)))


def peers_needed(blocks: int, args: argparse.Namespace) -> int | None:
    return math.ceil(args.replication * args.total_blocks / blocks) if blocks else None


# --- report ---------------------------------------------------------------------------------------------------


def report(spec: ModelSpec, results: list[ModeResult], args: argparse.Namespace, command: str) -> str:
    """The markdown tables: bytes, estimate, step time, adapter state, and the 24 GiB GPU arithmetic."""
    params = block_params(spec)
    lora_n = lora_formula(spec)
    lines = [
        f"Command: `{command}`",
        "",
        f"Block: {params:,} projection parameters (+ {2 * spec.hidden_size:,} norm weights); LoRA r={LORA_R} on "
        f"{len(TARGET_MODULES)} projections = {lora_n:,} parameters per block; micro-batch 1 x {args.seq} tokens.",
        "",
        "| mode | weights/block measured | of which (MB) | RSS growth/block: anon at load; anon+file after use "
        "| estimate (no margin) | measured / estimate | estimate x1.25 | load 2 blocks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.mode} | failed: {r.error} | | | | | | |")
            continue
        parts = ", ".join(f"{k} {v / MB:,.1f}" for k, v in r.weights.items())
        lines.append(
            f"| {r.mode} | {r.weight_bytes / MB:,.1f} MB ({r.weight_bytes / params:.4f} B/param) | {parts} "
            f"| {r.rss_anon_per_block / MB:,.1f} MB; {r.rss_touched_per_block / MB:,.1f} MB "
            f"| {r.estimate / MB:,.1f} MB ({r.estimate / params:.4f} B/param) "
            f"| {r.weight_bytes / r.estimate:.3f} | {MARGIN * r.estimate / MB:,.1f} MB | {r.load_s:.1f} s |"
        )
    lines += [
        "",
        "| mode | forward s | backward s | commit s | step total s | LoRA params/block | AdamW moments/block "
        "| LoRA grads/micro-batch | saved activations/block/micro-batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            continue
        lines.append(
            f"| {r.mode} | {r.forward_s:.2f} | {r.backward_s:.2f} | {r.commit_s:.2f} | {r.total_s:.2f} "
            f"| {r.lora_params / MB:.1f} MB ({r.lora_dtype}; formula {lora_n:,} x {r.lora_params // lora_n} B) "
            f"| {r.lora_moments / MB:.1f} MB (formula 2 x {lora_n * (r.lora_params // lora_n) / MB:.1f} MB) "
            f"| {r.lora_grads_per_mb / MB:.1f} MB | {r.activations_per_block / MB:.1f} MB |"
        )
    usable = args.gpu_gib * 0.9 - args.reserve_gib
    lines += [
        "",
        f"{args.gpu_gib:g} GiB GPU: usable {args.gpu_gib:g} x 0.9 - {args.reserve_gib:g} GiB reserve (CUDA context, "
        f"one dequantized/transient weight, allocator slack) = {usable:.2f} GiB; per block = weights + LoRA + AdamW "
        f"moments + {args.in_flight} micro-batches in flight x (saved activations + LoRA grads).",
        "",
        f"| mode | per block on GPU | blocks per peer | peers for {args.total_blocks} blocks x{args.replication} |",
        "|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            continue
        fit = blocks_per_peer(r, args)
        lines.append(
            f"| {r.mode} | {per_block_on_gpu(r, args.in_flight) / GIB:.3f} GiB | {fit} | {peers_needed(fit, args)} |"
        )
    measured = [r for r in results if not r.error and r.cuda_peak_per_block]
    if measured:
        lines += [
            "",
            f"On {args.device} (the CUDA caching allocator; peak: one micro-batch of 1 x {args.seq} in flight, "
            f"everything counted): `--num-blocks` budgets {MARGIN} x the estimate per block and fits "
            "0.8 x free memory / that.",
            "",
            "| mode | allocated/block at load | adapter state/block | peak/block in a step | estimate x1.25 "
            "| peak / (estimate x1.25) | free before load | blocks `--num-blocks` would take "
            "| blocks the peak allows |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in measured:
            budget = MARGIN * r.estimate
            lines.append(
                f"| {r.mode} | {r.cuda_weights_per_block / MB:,.1f} MB | {r.cuda_state_per_block / MB:,.1f} MB "
                f"| {r.cuda_peak_per_block / MB:,.1f} MB | {budget / MB:,.1f} MB "
                f"| {r.cuda_peak_per_block / budget:.3f} "
                f"| {r.cuda_free_before / GIB:,.1f} GiB | {estimated_fit(r)} | {peak_fit(r)} |"
            )
    return "\n".join(lines)


def estimated_fit(result: ModeResult) -> int:
    """Blocks ``blocks_that_fit`` (peers/daemon.py) picks on the free memory seen before loading, without its cap at
    the model's block count: 0.8 x free / (1.25 x estimate)."""
    return int(0.8 * result.cuda_free_before / (MARGIN * result.estimate))


def peak_fit(result: ModeResult) -> int:
    """Blocks that 0.8 x the same free memory holds at the measured peak per block (one micro-batch in flight)."""
    return int(0.8 * result.cuda_free_before / result.cuda_peak_per_block)


def summary_rows(results: list[ModeResult], args: argparse.Namespace) -> list[dict]:
    """One row per mode for scripts/bench_gpu.py's table: the step's times and the bytes against the estimate."""
    rows = []
    for r in results:
        if r.error:
            rows.append(dict(mode=r.mode, ok=False, error=r.error, figures={}))
            continue
        figures = {
            "forward s": r.forward_s,
            "backward s": r.backward_s,
            "commit s": r.commit_s,
            "weights/block MB": r.weight_bytes / MB,
            "estimate x1.25 MB": MARGIN * r.estimate / MB,
        }
        if r.cuda_peak_per_block:
            figures |= {
                "peak/block MB": r.cuda_peak_per_block / MB,
                "peak/estimate x1.25": r.cuda_peak_per_block / (MARGIN * r.estimate),
                "--num-blocks fit": estimated_fit(r),
                "peak fit": peak_fit(r),
            }
        else:  # no allocator on CPU: the counted bytes of a block on a GPU, and what a --gpu-gib GPU holds
            figures |= {
                "per block on GPU MB": per_block_on_gpu(r, args.in_flight) / MB,
                f"blocks on {args.gpu_gib:g} GiB": blocks_per_peer(r, args),
            }
        rows.append(dict(mode=r.mode, ok=True, figures=figures, detail=asdict(r)))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["nf4", "bf16"])
    parser.add_argument("--seq", type=int, default=128, help="tokens of the one micro-batch (batch 1)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/swarm-70b-block"))
    parser.add_argument("--keep", action="store_true", help="keep the model folder (~4.5 GB; reused next run)")
    parser.add_argument("--steps", type=int, default=1, help="measured training steps per mode (best one reported)")
    parser.add_argument("--warmup", type=int, default=1, help="training steps before the measured ones")
    parser.add_argument("--gpu-gib", type=float, default=24.0)
    parser.add_argument("--reserve-gib", type=float, default=1.5)
    parser.add_argument("--in-flight", type=int, default=4, help="micro-batches whose graphs a block keeps at once")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--total-blocks", type=int, default=80)
    parser.add_argument("--replication", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the blocks live")
    parser.add_argument("--tiny", action="store_true", help="a small shape of the same structure (seconds on a CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write a summary row per mode here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
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
            args.json.write_text(json.dumps(summary_rows(results, args), indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
