"""Churn, measured: a loopback swarm trains for a fixed time while a seeded chaos driver crashes, freezes, stops,
restarts and adds peers, side by side with a run of the same length without churn. What a run does and prints:
swarm/testing/churn.py.

Usage::

    python scripts/bench_churn.py [--minutes 10] [--intervals 20 5] [--peers 6] [--layers 8] [--seeds 0 [1 ...]]
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

from swarm.testing.churn import MICRO_BATCHES, logger, report, run_churn  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each run")
    parser.add_argument("--intervals", type=float, nargs="+", default=[20.0, 5.0], help="mean seconds between events")
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--span", type=int, default=3, help="blocks per peer (--num-blocks)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny Llama")
    parser.add_argument("--model", type=Path, default=None, help="an HF model folder instead of a tiny random Llama")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one churn run per seed and interval")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without churn")
    parser.add_argument(
        "--min-copies",
        type=int,
        default=2,
        help="the client's min_copies: peers holding each block's new state before a step returns (3: a double "
        "failure leaves a current copy)",
    )
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="add a control run without churn, beside peer starts in a swarm of their own at the moments the first "
        "churn run starts peers (each killed once it serves): what the CPU of restarts alone costs",
    )
    parser.add_argument(
        "--restart-nice",
        type=int,
        default=0,
        help="niceness of a restarted peer until it serves (19: its start takes only idle CPU, as on a machine of "
        "its own; 0: it competes with the running swarm for these cores)",
    )
    args = parser.parse_args()
    if not 0 < args.minutes <= 60:
        parser.error("--minutes must be in (0, 60]")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    for handler in logging.root.handlers:  # the terminal: progress and warnings; the rest is in logs/client.log
        handler.addFilter(lambda record: record.levelno >= logging.WARNING or record.name == logger.name)
    logger.setLevel(logging.INFO)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-churn-"))
    used = sorted(p.name for p in workdir.glob("run*"))
    if used:
        # Peers restarting in a new run would load the old run's checkpoints of the same adapter: the client would
        # resume past step 0, and the comparison with local peft (trained from step 0) would be wrong.
        parser.error(f"{workdir} holds earlier runs ({', '.join(used)}): give an empty --workdir")
    model_dir = args.model or make_tiny_model(
        workdir / "model", layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden, seed=1
    )
    plan = {} if args.no_baseline else {"no churn": (None, args.seeds[0], False)}
    if args.shadow:
        plan["no churn, starts beside"] = (args.intervals[0], args.seeds[0], True)
    several = len(args.seeds) > 1
    for interval in args.intervals:
        for seed in args.seeds:
            plan[f"1 event / {interval:g} s" + (f", seed {seed}" if several else "")] = (interval, seed, False)
    runs = {}
    for index, (name, (interval, seed, shadow)) in enumerate(plan.items()):
        logs = workdir / f"run{index}" / "logs"
        logger.info("run %d/%d: %s, %.1f min (logs in %s)", index + 1, len(plan), name, args.minutes, logs)
        runs[name] = run_churn(
            model_dir,
            workdir / f"run{index}",
            args.minutes * 60,
            interval,
            seed,
            args.peers,
            args.span,
            args.restart_nice,
            args.min_copies,
            shadow,
        )
    print(
        f"config: {args.peers} peers x {args.span} blocks of a {args.layers}-block model (hidden {args.hidden}), "
        f"replication 2, min_copies {args.min_copies}, restarts at nice {args.restart_nice}, "
        f"{MICRO_BATCHES} micro-batches of 2x16 tokens per step, seeds {' '.join(map(str, args.seeds))}"
    )
    print(report(runs))
    failed = [
        n for n, r in runs.items() if r.error or (r.steps_lost and not r.excused) or not (r.parity or r.steps_lost)
    ]
    if failed:
        for name in failed:
            print(f"\n{name}: {runs[name].error or 'see the table'}")
        sys.exit(1)


if __name__ == "__main__":
    main()
