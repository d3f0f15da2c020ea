"""What a step keeps for its backward and its replays, on the client and on a peer, against the number of
micro-batches: chained (the peers keep their span inputs in host memory) vs client-driven hops (the client keeps
every hop's input and output gradient), side by side in one run, on an in-process swarm of real peers; and a single
peer's peak for one micro-batch against its span and tokens, measured beside swarm/memory.py's estimate (issue 57).

It counts the bytes of what is kept, not the process's RSS: the client's ledger (the segments it keeps until the
step commits) and a peer's ``KeptInputs`` (peak within the step), read just before each commit. The last lines
scale the per-micro-batch figures to the issue's 70B case (hidden 8192, 2048 tokens per micro-batch in bf16, 5
spans, 16 micro-batches).

The peak table runs one fresh process per span: a peer's backend (peers/backend.py) on blocks 0:N of a tiny Llama
(fp32 on CPU unless told, LoRA r=16 on all seven projections), one training forward and backward per micro-batch
size. Measured: the growth of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over its RSS just
before the micro-batch, glibc set so that freed tensors leave the RSS (torch keeps no allocator statistics on CPU).
The estimate: the parts of swarm/memory.py's breakdown that one micro-batch adds at its peak (the backward of the span's
last block): its block inputs, its kept span input, one block's graph and workspace.

Usage::

    python scripts/bench_memory.py [--tables kept peak] [--micro-batches 1 4 16] [--spans 4] [--hidden 256]
        [--layers 8] [--batch 2] [--seq 128] [--peak-spans 2 4 8 16] [--peak-tokens 256 512 1024 2048]
        [--peak-hidden 512] [--peak-dtype float32|bfloat16] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import peft
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from peers.adapters import AdapterStore  # noqa: E402
from peers.backend import SpanBackend  # noqa: E402
from swarm.blocks import lora_config_to_wire  # noqa: E402
from swarm.client.ledger import StepLedger  # noqa: E402
from swarm.memory import ALL_SEVEN, Lora, MemoryInputs, ModelShape, breakdown  # noqa: E402
from swarm.spec import load_spec  # noqa: E402
from swarm.testing.inprocess import InProcessSwarm  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_memory")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
PEAK_LORA = Lora(16, ALL_SEVEN)
MIB = 1 << 20
# glibc, so that the RSS follows the live tensors: every allocation past 64 KiB mapped alone (unmapped when freed), the
# heap trimmed at once, one arena (freed memory that stays resident and is reused would hide a micro-batch's bytes)
MALLOC = dict(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", MALLOC_TOP_PAD_="0", MALLOC_ARENA_MAX="1")


def ledger_bytes(ledger: StepLedger) -> int:
    """The bytes of the tensors the client keeps for the step's backwards and replays."""
    return sum(
        t.numel() * t.element_size()
        for segments in ledger.segments.values()
        for segment in segments
        for t in (segment.hidden, segment.grad_outputs)
        if t is not None
    )


def measure(local: InProcessSwarm, model_dir: Path, chain: bool, micro_batches: int, batch: int, seq: int) -> dict:
    """One step of ``micro_batches`` through the swarm: what the client and the busiest peer kept, in bytes."""
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=f"memory-{'chained' if chain else 'hops'}-{micro_batches}",
        lora_config=peft.LoraConfig(**LORA),
        chain=chain,
    )
    try:
        for peer in local.peers.values():
            peer.adapters.kept.peak = 0
        vocab = model.spec.config.vocab_size
        ids = torch.randint(0, vocab, (micro_batches, batch, seq), generator=torch.Generator().manual_seed(0))
        for micro in ids:
            (model(input_ids=micro, labels=micro).loss / micro_batches).backward()
        client = ledger_bytes(model.ledger)
        peer = max(p.adapters.kept.peak for p in local.peers.values())
        swarm.RemoteOptimizer(model, lr=1e-3).step()
    finally:
        model.shutdown()
    return dict(client=client, peer=peer)


def rss(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak() -> None:
    """Set VmHWM back to the current RSS (Linux's clear_refs, 5)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def measure_peaks(model_dir: Path, span: int, token_counts: list[int], dtype: torch.dtype) -> dict[int, int]:
    """In this process: a peer's backend on blocks 0:span, and per token count the peak RSS one training micro-batch
    adds (its forward, then its backward), after a first micro-batch at the most tokens to warm the kernels up."""
    spec = load_spec(model_dir)
    store = AdapterStore(spec)
    backend = SpanBackend(spec, range(0, span), torch.device("cpu"), dtype, "none", store)
    lora = peft.LoraConfig(r=PEAK_LORA.rank, lora_alpha=2 * PEAK_LORA.rank, target_modules=list(PEAK_LORA.targets))
    store.open_adapter("peak", lora_config_to_wire(lora), seed=0, session="s")
    blocks, peaks = range(0, span), {}
    for count, tokens in enumerate([max(token_counts), *token_counts]):
        generator = torch.Generator().manual_seed(count)
        hidden = torch.randn(1, tokens, spec.hidden_size, generator=generator, dtype=dtype)
        grad_outputs = torch.randn(1, tokens, spec.hidden_size, generator=generator, dtype=dtype)
        micro_batch = f"s:0:{count}"
        gc.collect()
        reset_peak()
        before = rss("VmRSS")
        outputs = backend.forward("peak", blocks, 0, hidden, None, micro_batch=micro_batch)
        del outputs  # sent on: a peer keeps none of it
        backend.backward("peak", blocks, 0, micro_batch, None, None, grad_outputs)
        if count:
            peaks[tokens] = rss("VmHWM") - before
        for state in store.adapter("peak").blocks.values():
            state.grads.clear()  # as a commit would: the next micro-batch starts from the same state
        store.kept.drop_adapter("peak")
    return peaks


def estimate(shape: ModelShape, span: int, tokens: int, dtype_bytes: int) -> tuple[float, float]:
    """swarm/memory.py's bytes that one micro-batch adds at its peak (the backward of the span's last block, where
    every block input is still kept and none of its LoRA gradients yet), and of those its block inputs. On a CPU peer
    host memory counts."""
    case = MemoryInputs(
        shape,
        dtype_bytes=dtype_bytes,
        lora=PEAK_LORA,
        blocks=span,
        tokens=tokens,
        in_flight=1,
        micro_batches=1,
        on_host=True,
    )
    parts = breakdown(case)
    return parts.block_inputs + parts.span_inputs + parts.graph + parts.workspace, parts.block_inputs


def peak_table(args: argparse.Namespace, workdir: Path) -> None:
    """One fresh process per span (a clean RSS), measuring every token count; the table beside the estimates."""
    hidden = args.peak_hidden
    model_dir = make_tiny_model(
        workdir / "peak-model",
        layers=max(args.peak_spans),
        hidden=hidden,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        intermediate=hidden * 7 // 2,  # Llama-3's ratio
    )
    shape = ModelShape.from_config(load_spec(model_dir).config.to_dict())
    env = dict(os.environ, **MALLOC)
    measured = {}
    for span in args.peak_spans:
        command = [sys.executable, __file__, "--measure-peak", str(span), "--workdir", str(model_dir)]
        command += ["--peak-dtype", args.peak_dtype, "--peak-tokens", *map(str, args.peak_tokens)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        measured[span] = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    print(
        f"\nOne peer's peak per micro-batch: hidden {hidden}, intermediate {shape.intermediate}, {shape.heads} heads "
        f"({shape.kv_heads} kv), {args.peak_dtype} on CPU, LoRA r={PEAK_LORA.rank} on all seven projections. measured: "
        "peak RSS growth over one forward + backward (a fresh process per span); model: swarm/memory.py; activations: "
        "either less the block inputs (one hidden state per block), flat in the span with per-block recompute\n"
    )
    print("| span | tokens | measured MiB | model MiB | error | block inputs MiB | activations measured / model MiB |")
    print("|---|---|---|---|---|---|---|")
    for span in args.peak_spans:
        for tokens in args.peak_tokens:
            got = measured[span][tokens]
            model, inputs = estimate(shape, span, tokens, torch.finfo(getattr(torch, args.peak_dtype)).bits // 8)
            print(
                f"| {span} | {tokens} | {got / MIB:.1f} | {model / MIB:.1f} | {(model - got) / got:+.1%} | "
                f"{inputs / MIB:.1f} | {(got - inputs) / MIB:.1f} / {(model - inputs) / MIB:.1f} |"
            )


def kept_table(args: argparse.Namespace, workdir: Path) -> None:
    """What a step keeps, chained and client-driven, on an in-process swarm."""
    model_dir = make_tiny_model(workdir / "model", layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden)
    per_span = args.layers // args.spans
    rows = []
    with InProcessSwarm(model_dir, workdir / "swarm") as local:
        local.start_peers({f"p{i}": f"{i * per_span}:{(i + 1) * per_span}" for i in range(args.spans)})
        for count in args.micro_batches:
            for chain in (True, False):
                rows.append((count, chain, measure(local, model_dir, chain, count, args.batch, args.seq)))
    activation = args.batch * args.seq * args.hidden * 4  # one fp32 hidden-state tensor of a micro-batch
    print(
        f"\n{args.spans} spans, micro-batches of {args.batch}x{args.seq} tokens, hidden {args.hidden} (fp32): "
        f"one activation = {activation / MIB:.2f} MiB"
    )
    print(f"{'micro-batches':>13} {'mode':>14} {'client MiB':>11} {'activations':>12} {'peer MiB':>9}")
    for count, chain, kept in rows:
        mode = "chained" if chain else "client-driven"
        print(
            f"{count:>13} {mode:>14} {kept['client'] / MIB:>11.2f} {kept['client'] / activation:>12.1f} "
            f"{kept['peer'] / MIB:>9.2f}"
        )
    big, gib = 2048 * 8192 * 2, 1 << 30  # the 70B micro-batch: 2048 tokens x hidden 8192 in bf16
    print(
        f"\n70B case (one activation {big / MIB:.0f} MiB, 5 spans, 16 micro-batches): client-driven keeps "
        f"{16 * 5 * 2 * big / gib:.1f} GiB on the client; chained keeps {16 * 2 * big / gib:.1f} GiB on the client "
        f"and {16 * big / gib:.1f} GiB of host memory on each peer (one span input per micro-batch)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", nargs="+", choices=["kept", "peak"], default=["kept", "peak"])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--spans", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--peak-spans", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--peak-tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--peak-hidden", type=int, default=512, help="a multiple of 256 (heads of 64, 4 per kv head)")
    parser.add_argument("--peak-dtype", choices=["float32", "bfloat16"], default="float32", help="bf16 is slow on CPU")
    parser.add_argument("--measure-peak", type=int, help=argparse.SUPPRESS)  # the child: this span, in --workdir
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.measure_peak:
        print(
            json.dumps(
                measure_peaks(args.workdir, args.measure_peak, args.peak_tokens, getattr(torch, args.peak_dtype))
            )
        )
        return
    if args.layers % args.spans:
        parser.error("--layers must be a multiple of --spans")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-bench-memory-"))
    if "kept" in args.tables:
        kept_table(args, workdir)
    if "peak" in args.tables:
        peak_table(args, workdir)


if __name__ == "__main__":
    main()
