"""A thousand peers, simulated: the table and the figures of swarm/testing/simulation.py.

    .venv/bin/python scripts/simulate_swarm.py          # 100 and 1000 peers, 6 simulated hours, seed 0

What is real and what is simulated, and what each figure means: swarm/testing/simulation.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.testing.simulation import WARMUP_S, SimConfig, Simulation, Stats, stall_search, summary  # noqa: E402

logger = logging.getLogger("simulate_swarm")
STREAM_S, STREAM_MAX_PEERS = 1800.0, 200  # the saturated stream, measured by default in the smaller runs only


def print_table(rows: dict[str, dict[str, str]]) -> None:
    """One column per run, as a markdown table."""
    names = list(rows)
    keys = list(rows[names[0]])
    width = max(len(k) for k in keys)
    widths = [max(len(name), *(len(rows[name][k]) for k in keys)) for name in names]
    print("| " + " | ".join([" " * width, *(n.rjust(w) for n, w in zip(names, widths, strict=True))]) + " |")
    print("|" + "|".join(["-" * (width + 2)] + ["-" * (w + 1) + ":" for w in widths]) + "|")
    for key in keys:
        cells = [rows[name][key].rjust(w) for name, w in zip(names, widths, strict=True)]
        print("| " + " | ".join([key.ljust(width), *cells]) + " |")


PANELS = {
    "sim_coverage.png": [
        ("blocks without an online server", lambda s: s.uncovered),
        ("blocks with fewer than R online servers", lambda s: s.thin),
    ],
    "sim_replication.png": [
        ("online servers of the least served block", lambda s: s.least),
        ("online servers per block, mean", lambda s: s.mean),
        ("peers", lambda s: s.peers),
    ],
}


def plot(runs: dict[str, Stats], out: Path) -> list[Path]:
    """Coverage, replication and throughput over time after the cold start, one column per run; bursts dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for filename, panels in PANELS.items():
        fig, axes = plt.subplots(len(panels), len(runs), figsize=(5 * len(runs), 2.2 * len(panels)), squeeze=False)
        for column, (name, stats) in enumerate(runs.items()):
            samples = [s for s in stats.samples if s.at >= WARMUP_S]
            for ax, (title, value) in zip(axes[:, column], panels, strict=True):
                ax.plot([s.at / 3600 for s in samples], [value(s) for s in samples], lw=0.8)
                for burst in stats.bursts:
                    ax.axvline(burst.at / 3600, color="grey", linestyle=":", lw=0.8)
                ax.set_title(f"{name}: {title}", fontsize=9)
                ax.set_ylim(bottom=0)
            axes[-1, column].set_xlabel("simulated hours (dotted: bursts)")
        fig.tight_layout()
        fig.savefig(out / filename, dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for name, stats in runs.items():
        tput = [t for t in stats.throughput if t.best > 0]
        hours = [t.at / 3600 for t in tput]
        ax.plot(hours, [t.routed / t.widest for t in tput], label=f"{name}: a step, routed / widest chain")
        ax.plot(hours, [t.capacity / t.ideal for t in tput], label=f"{name}: capacity / ideal", linestyle="--")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("simulated hours")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sim_throughput.png", dpi=100)
    plt.close(fig)
    return [out / name for name in (*PANELS, "sim_throughput.png")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[100, 1000], help="swarm sizes, one run each")
    parser.add_argument("--hours", type=float, default=6.0, help="simulated hours per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replication", type=int, default=2, help="servers per block the balancer aims for (R)")
    parser.add_argument("--bursts", type=int, default=4, help="bursts in which 10-20%% of the peers leave at once")
    parser.add_argument("--lifetime-h", type=float, default=1.0, help="mean lifetime of a peer, hours")
    parser.add_argument("--load-s", type=float, default=10.0, help="seconds to load one block")
    parser.add_argument("--stall-cases", type=int, default=1000, help="random placements for the stall search")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for the PNGs")
    parser.add_argument(
        "--stream-s",
        type=float,
        default=None,
        help="measure a saturated stream every this many simulated seconds, 0: never "
        f"(default: {STREAM_S:g} in runs of at most {STREAM_MAX_PEERS} peers, else never: it takes minutes there)",
    )
    parser.add_argument(
        "--stream-in-flight",
        type=int,
        default=SimConfig.stream_in_flight,
        help="micro-batches of the saturated stream in flight at once, per serving peer",
    )
    parser.add_argument(
        "--relieve-below",
        type=float,
        default=SimConfig.relieve_below,
        help="a settled peer moves to relieve the weakest block below this fraction of the mean block throughput",
    )
    parser.add_argument(
        "--min-gain",
        type=float,
        default=SimConfig.min_gain,
        help="... if the move lifts the blocks it touches by this fraction",
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        parser.error("the figures need matplotlib: pip install -e '.[bench]', or pass --no-plots")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    started = time.perf_counter()
    failures = stall_search(args.stall_cases, args.seed)
    logger.info(
        "stall search: %d random placements, %d failed (%.0fs)",
        args.stall_cases,
        len(failures),
        time.perf_counter() - started,
    )
    runs, rows = {}, {}
    for peers in args.peers:
        config = SimConfig(
            peers,
            args.hours,
            args.seed,
            replication=args.replication,
            bursts=args.bursts,
            lifetime_h=args.lifetime_h,
            load_s=args.load_s,
            stream_s=args.stream_s if args.stream_s is not None else STREAM_S * (peers <= STREAM_MAX_PEERS),
            stream_in_flight=args.stream_in_flight,
            relieve_below=args.relieve_below,
            min_gain=args.min_gain,
        )
        logger.info("simulating %d peers for %g hours", peers, args.hours)
        started = time.perf_counter()
        stats = Simulation(config).run(progress=True)
        name = f"{peers} peers"
        runs[name], rows[name] = stats, summary(config, stats, time.perf_counter() - started)
        failures += stats.failures
    print_table(rows)
    print(f"stall search: {args.stall_cases} random placements; invariant failures in all: {len(failures)}")
    if not args.no_plots:
        for path in plot(runs, args.out):
            logger.info("wrote %s", path)
    for failure in failures[:20]:
        logger.error("%s", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
