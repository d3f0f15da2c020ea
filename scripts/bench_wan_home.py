"""The home-link scenario of scripts/bench_wan.py (``--home``): a client on a home link (20 Mbit/s up, 100 Mbit/s
down, 50 ms to every peer) and peers on 100 Mbit/s links, chained vs client-driven hops, at 2 / 4 / 8 spans.

The lab is swarm/testing/homelab.py (network namespaces; needs root, ip, tc and nft). For each number of spans one
swarm starts (a bootstrap, one peer per span, each peer on a host of its own) and three clients train on it, one
after the other, each on the home host (swarm/testing/linkmeter.py counts the bytes of every link per step):
"compute" (chained, with every cap and the delay off: the compute bound), then chained and client-driven over the
home link. A step is ``--micro-batches`` of ``--batch`` x ``--seq`` tokens, all in flight at once
(``model.train_step``), and a commit.

The bound of a step: the larger of the compute step and the slowest link's bytes per step over its bandwidth (they
overlap at best), plus the client's round trips no schedule avoids: forward and backward through the chain per
micro-batch wave (chained: one each; client-driven: one per span each), the commit and its durable copy (two).

Usage::

    sudo python scripts/bench_wan.py --home [--spans 2 4 8] [--modes chained client-driven] [--layers 8]
        [--hidden 512] [--batch 1] [--seq 128] [--micro-batches 4] [--steps 3] [--warmup 1] [--up-mbit 20]
        [--down-mbit 100] [--rtt-ms 50] [--peer-mbit 100] [--wires none bfloat16+hadamard4 ...] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):  # swarm, and bench_step.py's split of the blocks
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_step  # noqa: E402

from swarm.net.compression import WireFormat  # noqa: E402
from swarm.net.protocol import adapter_name_from  # noqa: E402
from swarm.testing.homelab import HomeLab, HomeLinks  # noqa: E402
from swarm.testing.linkmeter import LinkReport, MeterConfig, run_client  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.netlab import NetLab, unavailable  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_wan_home")

MODES = ("chained", "client-driven")
COMMIT_ROUNDS = 2  # the commit, and its durable copy (one server per block: min_copies=2 asks a copy each step)
PEER_FLAGS = ["--leave-grace", "0.2"]  # nothing is in flight when a swarm closes
GOAL_BOUND, GOAL_SPEEDUP = 1.3, 2.0


@dataclass
class HomeRun:
    """One client's measured steps: at ``spans`` spans, in ``mode`` ("compute": chained, the links off)."""

    spans: int
    mode: str
    report: LinkReport
    wire: str = "none"


def run_spans(home: HomeLab, model_dir: Path, args: argparse.Namespace, spans: int, workdir: Path) -> list[HomeRun]:
    """One swarm of ``spans`` peers; the compute run with the links off, then every mode over the home link."""
    config = MeterConfig(
        steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq, micro_batches=args.micro_batches
    )
    runs = []
    with LocalSwarm(workdir / f"spans{spans}") as local:
        local.start_dht(host=home.dht.ip, prefix=home.dht.command())
        for index, blocks in enumerate(bench_step.split_blocks(args.layers, spans)):
            peer_host = home.peers[index]
            local.start_peer(
                model_dir, blocks, f"peer{index}", PEER_FLAGS, wait=False, host="0.0.0.0", prefix=peer_host.command()
            )
        peers = local.processes[1:]
        for peer in peers:
            peer.wait_for_line("serving blocks", 300)
        watch = {peer.name: peer.pid for peer in peers}
        for mode, wire in [("compute", "none")] + [(mode, wire) for wire in args.wires for mode in args.modes]:
            home.shape(mode != "compute")
            measured = dataclasses.replace(
                config,
                adapter=adapter_name_from(f"home-{mode}-{wire}"),
                chain=mode != "client-driven",
                wire=wire,
            )
            report = run_client(local, home.client, model_dir, measured, mode, watch, timeout=args.client_timeout)
            runs.append(HomeRun(spans, mode, report, wire))
    return runs


def link_seconds(run: HomeRun, links: HomeLinks) -> float:
    """The slowest link's bytes per step over its bandwidth: the client's up and down, every peer's both ways."""
    rate = 1e6 / 8  # bytes per second in a Mbit/s
    client = run.report.median()
    seconds = [client.tx / (links.up_mbit * rate), client.rx / (links.down_mbit * rate)]
    for name in run.report.watched:
        peer = run.report.median(name)
        seconds.append(max(peer.rx, peer.tx) / (links.peer_mbit * rate))
    return max(seconds)


def round_trips(mode: str, spans: int, waves: int) -> int:
    """The client's round trips per step that no schedule avoids."""
    hops = 1 if mode == "chained" else spans
    return 2 * hops * waves + COMMIT_ROUNDS


def report(args: argparse.Namespace, links: HomeLinks, runs: list[HomeRun], took: float) -> None:
    compute = {run.spans: run.report.median_step for run in runs if run.mode == "compute"}
    waves = MeterConfig(micro_batches=args.micro_batches).waves
    print()
    print(
        f"bench_wan --home: {links.describe()}; {args.layers} blocks of hidden {args.hidden} split over the peers, "
        f"{args.micro_batches} micro-batch(es) of {args.batch}x{args.seq} per step in flight together, fp32, LoRA "
        f"r=4 (q, v, o, up); median of {args.steps} steps after {args.warmup} warm-up ({took:.0f} s in all)"
    )
    print(
        "bound: max(compute, slowest link's bytes / bandwidth) + round trips (chained: 2 per wave; client-driven: "
        f"2 x spans per wave; + {COMMIT_ROUNDS} for the commit and its copy) x {links.rtt_ms:g} ms"
    )
    print()
    print(
        f"{'spans':>5} {'mode':<14} {'wire':<28} {'step s':>7} {'compute s':>9} {'link s':>7} {'bound s':>7} "
        f"{'/bound':>6} {'client MB/step':>14} {'up MB':>6} {'down MB':>7}"
    )
    medians: dict[tuple[int, str, str], float] = {}
    for run in runs:
        step, own = run.report.median_step, run.report.median()
        medians[(run.spans, run.mode, run.wire)] = step
        if run.mode == "compute":  # no link to speak of: the bound is this step
            link, bound = "-", step
        else:
            seconds = link_seconds(run, links)
            link = f"{seconds:.3f}"
            bound = max(compute[run.spans], seconds) + round_trips(run.mode, run.spans, waves) * links.rtt_ms / 1000
        print(
            f"{run.spans:5d} {run.mode:<14} {run.wire:<28} {step:7.3f} {compute[run.spans]:9.3f} {link:>7} "
            f"{bound:7.3f} {step / bound:6.2f} {run.report.bytes_per_step / 1e6:14.2f} {own.tx / 1e6:6.2f} "
            f"{own.rx / 1e6:7.2f}"
        )
    print()
    for wire in args.wires:
        for spans in sorted(compute):
            if (spans, "chained", wire) in medians and (spans, "client-driven", wire) in medians:
                speedup = medians[(spans, "client-driven", wire)] / medians[(spans, "chained", wire)]
                print(f"{wire}: chained vs client-driven at {spans} spans: {speedup:.2f}x faster")
        for mode in args.modes:
            over = [
                f"{medians[(s, mode, wire)] - compute[s]:+.3f} s at {s}"
                for s in sorted(compute)
                if (s, mode, wire) in medians
            ]
            print(f"{wire}: {mode}: step - compute: {', '.join(over)} spans")
    for spans, mode, wire in medians:
        if mode != "compute" and wire != "none" and (spans, mode, "none") in medians:
            ratio = medians[(spans, mode, "none")] / medians[(spans, mode, wire)]
            print(f"{wire} vs none, {mode} at {spans} spans: {ratio:.2f}x faster")
    print(
        f"goals: chained within {GOAL_BOUND}x of its bound; >= {GOAL_SPEEDUP}x faster than client-driven at 4 spans; "
        "chained step not growing with spans beyond the compute"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    links = HomeLinks()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, nargs="+", default=[2, 4, 8], help="numbers of spans (one peer each)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per client")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the measured ones")
    parser.add_argument("--up-mbit", type=float, default=links.up_mbit, help="the client's uplink")
    parser.add_argument("--down-mbit", type=float, default=links.down_mbit, help="the client's downlink")
    parser.add_argument("--rtt-ms", type=float, default=links.rtt_ms, help="the client's round trip to every peer")
    parser.add_argument("--peer-mbit", type=float, default=links.peer_mbit, help="every peer's link, both ways")
    parser.add_argument(
        "--wires",
        nargs="+",
        default=["none"],
        help="wire formats to compare (WireFormat.parse: none, bfloat16, "
        "blockwise8, bfloat16+hadamard4, bfloat16+hadamard4/hadamard3, ...)",
    )
    parser.add_argument("--client-timeout", type=float, default=900.0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help="model and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if not all(1 <= spans <= args.layers for spans in args.spans) or args.steps < 1:
        parser.error("need 1 <= --spans <= --layers and --steps >= 1")
    if min(args.up_mbit, args.down_mbit, args.peer_mbit) <= 0:
        parser.error("link rates must be positive")
    try:
        args.wires = [WireFormat.parse(wire).spec for wire in args.wires]
    except ValueError as e:
        parser.error(f"--wires: {e}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    why_not = unavailable()
    if why_not:
        sys.exit(f"bench_wan --home: cannot build the lab here: {why_not}")
    links = HomeLinks(args.up_mbit, args.down_mbit, args.rtt_ms, args.peer_mbit)
    with tempfile.TemporaryDirectory(prefix="bench_wan_home_") as tmp:
        workdir = args.workdir or Path(tmp)
        heads = max(1, args.hidden // 64)
        model_dir = make_tiny_model(
            workdir / "model",
            layers=args.layers,
            hidden=args.hidden,
            heads=heads,
            kv_heads=heads,
            intermediate=args.hidden * 11 // 4,
            vocab=args.vocab,
            seed=0,
        )
        started, runs = time.monotonic(), []
        with NetLab() as lab, HomeLab(lab, links, max(args.spans), workdir / "lab") as home:
            for spans in args.spans:
                runs.extend(run_spans(home, model_dir, args, spans, workdir))
        report(args, links, runs, time.monotonic() - started)


if __name__ == "__main__":
    main()
