"""Memory over thousands of steps: a loopback swarm in every role a peer can have (only server, replica, standby
holder, chain head and tail, relayed peer and its relay) trains a tiny Llama while each process tree's resident
memory, open files and threads are sampled. Prints, per width, growth per 1000 steps over the second half of the run
(the first half lets allocators and caches reach their steady size) and draws RSS against steps. What the swarm and
its client do: swarm/testing/soak.py.

Usage::

    python scripts/bench_soak.py [--steps 3000] [--hidden 64 512] [--sample-every 100] [--seq 64] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.testing.soak import SoakConfig, run_soak  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 512], help="one run per hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (2 sequences, 2 micro-batches)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 4 * args.sample_every:
        parser.error("--steps must be at least 4 x --sample-every (growth is fitted over the second half)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-soak-"))
    for hidden in args.hidden:
        run_dir = workdir / f"hidden{hidden}"
        model_dir = make_tiny_model(
            run_dir / "model", layers=args.layers, hidden=hidden, intermediate=2 * hidden, heads=4, kv_heads=2, seed=1
        )
        config = SoakConfig(steps=args.steps, sample_every=args.sample_every, seq=args.seq)
        result = run_soak(model_dir, run_dir, config)
        last = result.samples[-1]
        print(
            f"\nhidden {hidden}, {args.layers} blocks, {last.step} steps in {last.seconds:.0f} s "
            f"({last.step / last.seconds:.1f} steps/s), samples every {args.sample_every} steps"
        )
        print(result.table())
        plot = result.plot(run_dir / "soak.png", f"bench_soak: hidden {hidden}, {last.step} steps")
        print(f"plot: {plot}; samples: {result.to_csv(run_dir / 'samples.csv')}")


if __name__ == "__main__":
    main()
