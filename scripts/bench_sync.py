"""Sync traffic per peer and training step, measured on links in network namespaces, not loopback (issue 47).

The bytes through every peer's own interface per step, in units of G (one span's fp32 LoRA gradient), at R = 2 / 3
replicas and M micro-batches a step, and the step time with every peer's link capped by tbf.

The lab is the one of tests/e2e/test_sync_bytes.py (swarm/testing/netlab.py; needs root, ip and tc: no home hosts, so no
nft): a tiny Llama (hidden 256, intermediate 688, 4 blocks) in 2 spans of 2 blocks, each span served by R peers, every
peer, the bootstrap and the client alone in a network namespace of its own; no standby copies by default
(``--standby-blocks 2``: every peer copies the other span and follows its commits, so the copies' bytes count too).
One swarm per R; on it one measuring client per configuration, one after the other,
each with an adapter of its own (swarm/testing/linkmeter.py: it reads every peer's interface counters right before and
after each measured step). A step is M micro-batches of 1 x 16 tokens, all in flight at once, then a commit; LoRA r=64
on all seven projections, so G = 2.50 MB per span against at most 2M x 16 KB of hidden states and their gradients each
way.

Printed per configuration: per peer and step (median over the measured steps), bytes in and out in G, the worst peer
and the median peer; next to the old per-micro-batch exchange's M(R-1)/R G a replica fetched (by construction) and the
issue's measurement of that code path (worst peer, R = 2, r = 16 on hidden 256: 3.1 / 7.3 / 13.1 G at M = 2 / 8 / 16;
that path no longer exists, so "before" is quoted, not measured). Then, for ``--cap-runs``, the median step time with
every peer's link capped (``--caps UP/DOWN`` Mbit/s: tbf on its uplink and on its port of the switch; the client and
the bootstrap are not capped), next to the uncapped step, and an *estimate* of the old code path's step at the same
caps: the uncapped step plus the bytes a replica then sent over its uplink (M(R-1)/R G, or the issue's worst peer) at
the cap (the exchange happened at the commit, after the backward passes, overlapping nothing). The same estimate from
the bytes measured now is printed as a check of the model against the measured capped step.

Usage::

    sudo .venv/bin/python scripts/bench_sync.py [--replicas 2 3] [--micro-batches 4 8 16] [--steps 3] [--warmup 1]
        [--cap-runs 2:16 3:16] [--caps 100/100 20/100] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.net.compression import WireFormat  # noqa: E402
from swarm.testing.linkmeter import Counters, LinkReport, MeterConfig, collect, start_client  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.netlab import Host, NetLab, unavailable  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_sync")

HIDDEN, INTERMEDIATE, BLOCKS, SPAN, HEADS, VOCAB = 256, 688, 4, 2, 4, 256
BATCH, SEQ, RANK = 1, 16, 64
PEER_FLAGS = ["--leave-grace", "0.2", "--no-rebalance"]
GOAL = 1.5  # G each way per peer and step, flat in M
BEFORE = {2: 3.1, 8: 7.3, 16: 13.1}  # the issue's worst peer per step, in G, at R = 2 (r = 16, hidden 256)
MBIT = 1e6 / 8  # bytes per second in a Mbit/s


def span_gradient_bytes(rank: int = RANK) -> int:
    """G: one span's fp32 LoRA gradient, rank r on q, k, v, o (hidden -> hidden) and gate, up, down."""
    per_block = 4 * (HIDDEN + HIDDEN) + 3 * (HIDDEN + INTERMEDIATE)
    return SPAN * rank * per_block * 4


def hop_bytes(micro_batches: int, seq: int, wire: WireFormat) -> float:
    """The most hidden states and their gradients one peer's link carries each way per step: in, the hidden states
    from upstream and the gradients from downstream; out, the same going on."""
    return 2 * micro_batches * BATCH * seq * HIDDEN * wire.value_bytes(torch.float32)


@dataclass(frozen=True)
class Cap:
    """Every peer's link: ``up`` Mbit/s sent, ``down`` received (0: not capped)."""

    up: float = 0.0
    down: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.up:g}/{self.down:g}" if self.up or self.down else "uncapped"

    @classmethod
    def parse(cls, text: str) -> Cap:
        up, _, down = text.partition("/")
        try:
            cap = cls(float(up), float(down or up))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected UP/DOWN in Mbit/s, got {text!r}") from None
        if cap.up <= 0 or cap.down <= 0:
            raise argparse.ArgumentTypeError(f"caps must be positive, got {text!r}")
        return cap


@dataclass
class Run:
    """One measuring client: ``micro_batches`` a step on a swarm of ``replicas`` per span, links ``cap``."""

    replicas: int
    micro_batches: int
    cap: Cap
    report: LinkReport

    def peers(self) -> dict[str, Counters]:
        return {name: self.report.median(name) for name in self.report.watched}


def peer_names(replicas: int) -> dict[str, str]:
    """Peer name -> its blocks: a1..aR serve the first span, b1..bR the second."""
    first, second = f"0:{SPAN}", f"{SPAN}:{2 * SPAN}"
    return {**{f"a{i}": first for i in range(1, replicas + 1)}, **{f"b{i}": second for i in range(1, replicas + 1)}}


def host(lab: NetLab, name: str) -> Host:
    """The lab's host ``name``, made the first time (hosts outlive the swarms: one swarm per R uses them in turn)."""
    return lab.hosts.get(name) or lab.public(name)


def set_caps(lab: NetLab, hosts: list[Host], cap: Cap) -> None:
    for peer in hosts:
        lab.uncap(peer)
        if cap.up:
            lab.cap(peer, cap.up)
        if cap.down:
            lab.cap_down(peer, cap.down)


def run_replicas(lab: NetLab, model: Path, args: argparse.Namespace, replicas: int, workdir: Path) -> list[Run]:
    """One swarm of 2 spans x ``replicas``; a client per M uncapped, then one per cap where ``--cap-runs`` asks."""
    spans = peer_names(replicas)
    hosts = [host(lab, name) for name in spans]
    plan = [(m, Cap()) for m in args.micro_batches]
    plan += [(m, cap) for r, m in args.cap_runs if r == replicas for cap in args.caps]
    runs: list[Run] = []
    with LocalSwarm(workdir / f"r{replicas}") as local:
        bootstrap = host(lab, "bootstrap")
        local.start_dht(host=bootstrap.ip, prefix=bootstrap.command())
        started = time.monotonic()
        peers = {
            name: local.start_peer(
                model,
                span,
                name,
                [*PEER_FLAGS, "--standby-blocks", str(args.standby_blocks)],
                wait=False,
                host="0.0.0.0",
                prefix=host(lab, name).command(),
            )
            for name, span in spans.items()
        }
        for process in peers.values():
            process.wait_for_line("serving blocks", args.peer_timeout)
        logger.info("R=%d: %d peers serving after %.0f s", replicas, len(peers), time.monotonic() - started)
        watch = {name: process.pid for name, process in peers.items()}
        client = host(lab, "client")
        for index, (micro_batches, cap) in enumerate(plan, 1):
            config = MeterConfig(
                adapter=f"sync-r{replicas}-m{micro_batches}-{index}",
                steps=args.steps,
                warmup=args.warmup,
                batch=BATCH,
                seq=args.seq,
                micro_batches=micro_batches,
                lora_rank=RANK,
                wire=args.wire.spec,
            )
            logger.info("R=%d M=%d %s (%d/%d)", replicas, micro_batches, cap.label, index, len(plan))
            set_caps(lab, hosts, cap)
            try:
                name = f"client-m{micro_batches}-{index}"
                report = collect(start_client(local, client, model, config, name, watch), args.client_timeout)
            finally:
                set_caps(lab, hosts, Cap())
            runs.append(Run(replicas, micro_batches, cap, report))
            logger.info("  median step %.2f s", report.median_step)
    return runs


def before_expected(replicas: int, micro_batches: int) -> float:
    """What a replica fetched per step by construction in the old per-micro-batch exchange, in G."""
    return micro_batches * (replicas - 1) / replicas


def print_bytes(runs: list[Run], g: int, args: argparse.Namespace) -> None:
    print(
        f"{'R':>2} {'M':>3} {'worst in':>9} {'worst out':>9} {'median in':>9} {'median out':>10} {'hops<=':>7} "
        f"{'before M(R-1)/R':>15} {'before (issue)':>14} {'(R-1)G':>6} {'goal':>5} {'mean in/out':>11} "
        f"{'max in/out':>11}"
    )
    for run in runs:
        rows = run.peers()
        ins, outs = [c.rx / g for c in rows.values()], [c.tx / g for c in rows.values()]
        issue = f"{BEFORE[run.micro_batches]:.1f} G" if run.replicas == 2 and run.micro_batches in BEFORE else "-"
        hops = hop_bytes(run.micro_batches, args.seq, args.wire) / g
        expected = before_expected(run.replicas, run.micro_batches)
        ok = "ok" if max(max(ins), max(outs)) <= GOAL + hops else "over"
        worst = f"{max(ins):7.2f} G {max(outs):7.2f} G"
        median = f"{statistics.median(ins):7.2f} G {statistics.median(outs):8.2f} G"
        steps = [c for counters in run.report.watched.values() for c in counters]
        mean_in = max(statistics.mean(c.rx for c in counters) for counters in run.report.watched.values()) / g
        mean_out = max(statistics.mean(c.tx for c in counters) for counters in run.report.watched.values()) / g
        means = f"{mean_in:.2f}/{mean_out:.2f}"
        peaks = f"{max(c.rx for c in steps) / g:.2f}/{max(c.tx for c in steps) / g:.2f}"
        print(
            f"{run.replicas:2d} {run.micro_batches:3d} {worst} {median} {hops:5.2f} G {expected:13.1f} G "
            f"{issue:>14} {run.replicas - 1:4d} G {ok:>5} {means:>11} {peaks:>11}"
        )
    print()
    print("per peer (in / out, G per step, median over steps; each step's in/out in brackets):")
    for run in runs:
        cells = []
        for name, steps in run.report.watched.items():
            median = run.report.median(name)
            each = " ".join(f"{c.rx / g:.2f}/{c.tx / g:.2f}" for c in steps)
            cells.append(f"{name} {median.rx / g:.2f}/{median.tx / g:.2f} [{each}]")
        print(f"  R={run.replicas} M={run.micro_batches:<2d}: " + "; ".join(cells))


def print_times(runs: list[Run], g: int) -> None:
    uncapped = {(r.replicas, r.micro_batches): r for r in runs if not (r.cap.up or r.cap.down)}
    capped = [r for r in runs if r.cap.up or r.cap.down]
    print(
        f"{'R':>2} {'M':>3} {'links':>15} {'step s':>6} {'steps s':>14} {'worst in/out G':>14} {'est. now s':>10} "
        f"{'est. before s':>13} {'est. before (issue) s':>21} {'est. before / step':>18}"
    )
    for run in [*uncapped.values(), *capped]:
        step, rows = run.report.median_step, run.peers()
        steps = " ".join(f"{t:.2f}" for t in run.report.times)
        worst = f"{max(c.rx for c in rows.values()) / g:.2f}/{max(c.tx for c in rows.values()) / g:.2f}"
        line = f"{run.replicas:2d} {run.micro_batches:3d} {run.cap.label:>15} {step:6.2f} {steps:>14} {worst:>14}"
        base = uncapped.get((run.replicas, run.micro_batches))
        if not (run.cap.up or run.cap.down):
            print(line)
            continue
        compute = base.report.median_step if base else float("nan")
        now = compute + max(max(c.tx / (run.cap.up * MBIT), c.rx / (run.cap.down * MBIT)) for c in rows.values())
        before = compute + before_expected(run.replicas, run.micro_batches) * g / (run.cap.up * MBIT)
        ratios, issue = [f"{before / step:.1f}x"], "-"
        if run.replicas == 2 and run.micro_batches in BEFORE:
            issue_s = compute + BEFORE[run.micro_batches] * g / (run.cap.up * MBIT)
            issue = f"{issue_s:.2f}"
            ratios.append(f"{issue_s / step:.1f}x")
        print(f"{line} {now:10.2f} {before:13.2f} {issue:>21} {' / '.join(ratios):>18}")


def report(args: argparse.Namespace, runs: list[Run], took: float) -> None:
    g = span_gradient_bytes()
    print()
    print(
        f"bench_sync: tiny Llama hidden {HIDDEN}, {BLOCKS} blocks in 2 spans x R replicas, every peer in a namespace "
        f"of its own; M micro-batches of {BATCH}x{args.seq} tokens per step in flight together, LoRA r={RANK} on all "
        f"seven projections: G = {g / 1e6:.2f} MB per span; wire {args.wire.spec}; standby copies: "
        f"{args.standby_blocks} block(s) a peer; median of "
        f"{args.steps} steps after {args.warmup} warm-up ({took:.0f} s in all)"
    )
    print(
        "bytes per peer and step through its interface (everything: partial sums, hidden states, commits, DHT, "
        f"framing, TCP), uncapped runs; hops<=: the most hidden states + their gradients a peer carries each way; "
        f"goal <= {GOAL} G each way (+ hops), flat in M; (R-1)G: what the design moves each way (every replica "
        "a holder); before: the old per-micro-batch exchange (not measured here). "
        "worst/median: over peers, of each peer's median over steps; mean in/out: the worst peer's mean over steps; "
        "max in/out: the largest single step of any peer (an audit, a quarter of the fetched sums, adds one "
        "micro-batch gradient of one block: G / 2 here)"
    )
    print()
    print_bytes([r for r in runs if not (r.cap.up or r.cap.down)], g, args)
    print()
    print(
        "median step time, every peer's link capped (up/down Mbit/s; client and bootstrap not capped). est. = "
        "estimates, not measurements: the uncapped step + a peer's bytes / its cap (the exchange overlaps nothing); "
        "'now': the bytes measured in that run (worst peer, worse direction), a check of the model; 'before': "
        "M(R-1)/R G over the uplink; 'before (issue)': the issue's worst peer over the uplink; last column: the "
        "before estimates over the measured step"
    )
    print()
    print_times(runs, g)


def cap_run(text: str) -> tuple[int, int]:
    replicas, _, micro_batches = text.partition(":")
    if not replicas.isdigit() or not micro_batches.isdigit():
        raise argparse.ArgumentTypeError(f"expected R:M, got {text!r}")
    return int(replicas), int(micro_batches)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3], help="R: peers per span")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="M per step")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the measured ones")
    parser.add_argument(
        "--cap-runs",
        type=cap_run,
        nargs="*",
        default=[(2, 16), (3, 16)],
        metavar="R:M",
        help="configurations timed capped",
    )
    parser.add_argument(
        "--caps",
        type=Cap.parse,
        nargs="*",
        default=[Cap(100, 100), Cap(20, 100)],
        metavar="UP/DOWN",
        help="every peer's link in Mbit/s, one capped run each",
    )
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per micro-batch (hidden states grow with it)")
    parser.add_argument(
        "--wire",
        type=WireFormat.parse,
        default=WireFormat(),
        help="how hidden states and their gradients travel, e.g. bfloat16+hadamard4 (WireFormat.parse)",
    )
    parser.add_argument("--peer-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    parser.add_argument("--client-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help="model and logs (default: a temp dir)")
    parser.add_argument(
        "--standby-blocks",
        type=int,
        default=0,
        help="blocks each peer keeps a standby copy of (0: none; 2: the other span, so copies' bytes count too)",
    )
    args = parser.parse_args(argv)
    if min(args.replicas) < 1 or min(args.micro_batches) < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("need --replicas, --micro-batches, --steps >= 1 and --warmup >= 0")
    if any(m < 1 for _, m in args.cap_runs):
        parser.error("--cap-runs: need M >= 1")
    args.cap_runs = [(r, m) for r, m in args.cap_runs if r in args.replicas]  # the others have no swarm to run on
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    why_not = unavailable()
    if why_not and why_not.startswith("`nft` is missing"):  # only home hosts (NAT) need nft; this lab has none
        why_not = None
    if why_not:
        sys.exit(f"bench_sync: cannot build the lab here: {why_not}")
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        workdir = args.workdir or Path(tmp)
        model = make_tiny_model(
            workdir / "model",
            layers=BLOCKS,
            hidden=HIDDEN,
            heads=HEADS,
            kv_heads=HEADS,
            intermediate=INTERMEDIATE,
            vocab=VOCAB,
            seed=0,
        )
        started, runs = time.monotonic(), []
        with NetLab() as lab:
            for replicas in args.replicas:
                runs.extend(run_replicas(lab, model, args, replicas, workdir))
        report(args, runs, time.monotonic() - started)


if __name__ == "__main__":
    main()
