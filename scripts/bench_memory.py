"""What a step keeps for its backward and its replays, on the client and on a peer, against the number of
micro-batches: chained (the peers keep their span inputs in host memory) vs client-driven hops (the client keeps
every hop's input and output gradient), side by side in one run, on an in-process swarm of real peers.

It counts the bytes of what is kept, not the process's RSS: the client's ledger (the segments it keeps until the
step commits) and a peer's ``KeptInputs`` (peak within the step), read just before each commit. The last lines
scale the per-micro-batch figures to the issue's 70B case (hidden 8192, 2048 tokens per micro-batch in bf16, 5
spans, 16 micro-batches).

Usage::

    python scripts/bench_memory.py [--micro-batches 1 4 16] [--spans 4] [--hidden 256] [--layers 8] [--batch 2]
        [--seq 128] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import peft
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.client.ledger import StepLedger  # noqa: E402
from swarm.testing.inprocess import InProcessSwarm  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_memory")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
MIB = 1 << 20


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--spans", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.layers % args.spans:
        parser.error("--layers must be a multiple of --spans")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-bench-memory-"))
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


if __name__ == "__main__":
    main()
