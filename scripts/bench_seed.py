"""The seed's story end to end on CPU (issue 56): six self-placing peers of 34 blocks (real ``swarm peer`` processes,
no ``--blocks``, replication 2, rebalancing on) on a tiny random Llama with the seed model's 80 blocks; a client
connects while they load and trains with pipelined micro-batches; once every block has two servers (or
``--settle-timeout`` passed) and ``--steps-before`` more steps, one peer is SIGKILLed halfway through a step; the
client trains on until the five left are at the best their spans allow, then ``--steps-after`` steps more. What a run
does, watches and prints: swarm/testing/seed.py.

Printed: a timeline sampled every ``--every`` s (seconds from the first peer's start; live peers; blocks with 0, 1 and
2 or more live online servers, as the peers' own view counts them; moves begun so far; steps committed; steps a minute
over the last 20 s), then the figures: when every block first had two servers, moves per peer, the step rate before
the kill and after the recovery (goal: a ratio of at least 5/6), steps lost, whether the five left got every block
back to two servers (five spans of 34 cannot: see ``best_doubled``) and how long they took to reach the best they
can, and the largest difference between the adapter and local peft trained on the same batches. ``--plot PATH``
writes the timeline as a PNG (a CSV where matplotlib is missing).

Usage::

    python scripts/bench_seed.py [--peers 6] [--span 34] [--layers 80] [--hidden 32] [--micro-batches 4]
        [--steps-before 10] [--steps-after 10] [--kill-after STEPS] [--victim 0] [--balance-interval 5]
        [--settle-timeout 300] [--recover-timeout 300] [--every 2] [--plot seed.png] [--no-compare] [--forks]
        [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.testing import zygote  # noqa: E402
from swarm.testing.seed import HEADER, HIDDEN, LAYERS, PEERS, SPAN, logger, plot, report, run_seed  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=PEERS)
    parser.add_argument("--span", type=int, default=SPAN, help="blocks per peer (--num-blocks)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="blocks of the tiny Llama")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size of the tiny Llama")
    parser.add_argument("--model", type=Path, default=None, help="an HF model folder instead of a tiny random Llama")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step, all in flight at once")
    parser.add_argument("--steps-before", type=int, default=10, help="steps measured before the kill")
    parser.add_argument("--steps-after", type=int, default=10, help="steps measured after the recovery")
    parser.add_argument(
        "--kill-after",
        type=int,
        default=None,
        help="kill after this many steps in all, whether or not every block has two servers (default: once it "
        "has, and --steps-before steps more)",
    )
    parser.add_argument("--victim", type=int, default=0, help="which peer to SIGKILL (peerN)")
    parser.add_argument("--balance-interval", type=float, default=5.0, help="the peers' --balance-interval")
    parser.add_argument("--settle-timeout", type=float, default=300.0, help="seconds to wait for two servers a block")
    parser.add_argument("--recover-timeout", type=float, default=300.0, help="seconds the five left get after the kill")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between two looks at the swarm")
    parser.add_argument("--patience", type=float, default=300.0, help="the client's patience")
    parser.add_argument("--plot", type=Path, default=None, help="write the timeline as a PNG here")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison with local peft")
    parser.add_argument(
        "--forks",
        action="store_true",
        help="start the peers from a fork server that imported the heavy modules once (as the tests do): six "
        "imports at once take ~30 s on two cores, which machines of their own would not share",
    )
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.peers < 2 or not 0 <= args.victim < args.peers:
        parser.error("--peers must be at least 2 and --victim one of them")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-seed-"))
    if (workdir / "logs").exists():
        parser.error(f"{workdir} holds an earlier run: give an empty --workdir")
    model_dir = args.model or make_tiny_model(
        workdir / "model", layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden, seed=1
    )
    if args.forks:
        zygote.enable()
    print(
        f"{args.peers} peers x {args.span} blocks of a {args.layers}-block Llama (hidden {args.hidden}), replication 2,"
        f" balance interval {args.balance_interval:g} s; {args.micro_batches} micro-batches of 2x16 tokens a step, "
        f"pipelined; logs in {workdir / 'logs'}",
        flush=True,
    )
    print(HEADER, flush=True)
    run = run_seed(
        model_dir,
        workdir,
        peers=args.peers,
        span=args.span,
        balance_interval=args.balance_interval,
        micro_batches=args.micro_batches,
        steps_before=args.steps_before,
        steps_after=args.steps_after,
        kill_after=args.kill_after,
        settle_timeout=args.settle_timeout,
        recover_timeout=args.recover_timeout,
        victim=args.victim,
        every=args.every,
        patience=args.patience,
        compare=not args.no_compare,
        echo=lambda line: print(line, flush=True),
    )
    print()
    print(report(run))
    if args.plot:
        print(f"timeline written: {plot(run, args.plot)}")
    if run.error:
        print(run.error)
        sys.exit(1)


if __name__ == "__main__":
    main()
