"""Benchmark training steps over emulated wide-area links: the same loopback swarm with every connection to a peer
(and to the bootstrap) passing through a link with a set round-trip time and bandwidth (swarm/wanlink.py), side by
side in one run: the plain ``loss.backward()`` loop and the pipelined ``model.train_step``, at each round-trip time.

For each configuration it prints the median step time, the client's requests and bytes per step, the round trips
the step effectively waited for ((step - step at 0 ms) / RTT), the commit's time, and a lower bound: the larger of
the step at 0 ms without a bandwidth cap (compute and loopback costs) and the bytes of the busiest peer link /
bandwidth (at best they overlap), + the round trips no schedule avoids (a forward and a backward through every
span, the commit, and a copy round when blocks have fewer servers than the client's min_copies).

``--home``: a client on a home link and peers on links of their own, chained vs client-driven hops, in network
namespaces (scripts/bench_wan_home.py; its options follow ``--home``).

Usage::

    sudo python scripts/bench_wan.py --home [--spans 2 4 8] [...]
    python scripts/bench_wan.py [--rtt-ms 0 50 100] [--mbit 100] [--peers 4 ...] [--layers 8] [--hidden 256]
        [--batch 4] [--seq 64] [--micro-batches 4] [--steps 5] [--warmup 1] [--modes loop pipelined]
        [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):  # swarm, and bench_step.py's recipe (one recipe for every step bench)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_step  # noqa: E402
import bench_wan_home  # noqa: E402
from hivemind.p2p import PeerID  # noqa: E402

import swarm  # noqa: E402
from swarm.client.calls import Send  # noqa: E402
from swarm.net.message import Message, payload_bytes  # noqa: E402
from swarm.net.protocol import method_of  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_wan")
GOAL_BOUND, GOAL_SPEEDUP = 1.5, 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """One mode at one link setting: step times, and the client's requests and bytes per step."""

    mode: str
    peers: int
    rtt_ms: float
    mbit: float
    times: list[float] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)
    calls: list[Counter] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    peer_bytes: list[dict[str, int]] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


class Meter:
    """Counts the client's requests (by method) and bytes (sent + received, per peer) as they go out: its call hook
    (``from_pretrained(call_hook=meter)``)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def __call__(self, peer: PeerID, message: Message, send: Send) -> Message:
        reply = send(message)
        self.calls[method_of(message.meta)] += 1
        self.bytes[peer.to_base58()] += payload_bytes(message.tensors) + payload_bytes(reply.tensors)
        return reply

    def take(self) -> tuple[Counter, Counter]:
        calls, sent = self.calls, self.bytes
        self.calls, self.bytes = Counter(), Counter()
        return calls, sent


def train(model, meter: Meter, batches: list[dict], mode: str, steps: int, warmup: int, run: Run) -> None:
    optimizer = swarm.RemoteOptimizer(model, **bench_step.HPARAMS)
    for index in range(warmup + steps):
        meter.take()
        started = time.perf_counter()
        if mode == "pipelined":
            model.train_step(batches, max_in_flight=len(batches))
        else:
            for batch in batches:
                (model(**batch).loss / len(batches)).backward()
        committing = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - started
        calls, per_peer = meter.take()
        if index >= warmup:
            run.times.append(elapsed)
            run.commits.append(time.perf_counter() - committing)
            run.calls.append(calls)
            run.bytes.append(sum(per_peer.values()))
            run.peer_bytes.append(dict(per_peer))
    logger.info("%s at %.0f ms: %s", mode, run.rtt_ms, " ".join(f"{t:.3f}" for t in run.times))


def run_swarm(
    model_dir: Path, workdir: Path, args: argparse.Namespace, peers: int, rtt_ms: float, mbit: float
) -> list[Run]:
    """A bootstrap and ``peers`` peers on 127.0.0.1, each reached through its own emulated link; every mode
    trains a fresh adapter through it."""
    spans = bench_step.split_blocks(args.layers, peers)
    ports = [(free_port(), free_port()) for _ in range(peers + 1)]  # (announced, real) per node
    pairs = [f"{announced}:{real}" for announced, real in ports]
    link = subprocess.Popen(
        [sys.executable, "-m", "swarm.testing.wanlink", "--rtt-ms", str(rtt_ms), "--mbit", str(mbit), *pairs],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs = []
    try:
        time.sleep(1.0)
        with LocalSwarm(workdir / f"peers{peers}-rtt{rtt_ms:g}-mbit{mbit:g}") as local:

            def node(index: int) -> list[str]:
                announced, real = ports[index]
                return ["--port", str(real), "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{announced}"]

            local.start_dht(extra=node(0))
            for index, span in enumerate(spans):
                local.start_peer(model_dir, span, name=f"peer{index}", extra=node(index + 1), wait=False)
            for process in local.processes[1:]:
                process.wait_for_line("serving blocks", 120)
            batches = bench_step.make_batches(args.vocab, args.batch, args.seq, args.micro_batches)
            for mode in args.modes:
                meter = Meter()
                model = swarm.SwarmModelForCausalLM.from_pretrained(
                    model_dir,
                    initial_peers=local.initial_peers,
                    adapter=f"wan-{mode}",
                    lora_config=bench_step.lora_config(),
                    seed=0,
                    call_hook=meter,
                )
                try:
                    run = Run(mode, peers, rtt_ms, mbit)
                    train(model, meter, batches, mode, args.steps, args.warmup, run)
                    runs.append(run)
                finally:
                    model.shutdown()
    finally:
        link.kill()
        link.wait()
    return runs


def unavoidable_round_trips(spans: int, copies: bool) -> int:
    """A forward and a backward through every span, the commit, and a copy round when it is needed."""
    return 2 * spans + 1 + int(copies)


def report(args: argparse.Namespace, runs: list[Run]) -> None:
    base = {(run.mode, run.peers): run for run in runs if run.rtt_ms == 0 and run.mbit == 0}
    copies = True  # every block has one server here: min_copies=2 asks a standby copy each step
    print()
    print(
        f"config: {args.layers} blocks split over the peers, hidden {args.hidden}, {args.micro_batches} micro-batches "
        f"of {args.batch}x{args.seq} per step, fp32, LoRA r=8 all-linear, {args.steps} steps after {args.warmup} "
        "warm-up; every peer and the bootstrap behind its own emulated link"
    )
    print("round trips no schedule avoids: forward + backward through every span, commit, copy (2 x peers + 2)")
    print(
        "bound: the larger of the step at 0 ms without a cap (same mode and peers) and the busiest peer link's bytes / "
        "bandwidth (they overlap at best), + those round trips"
    )
    print()
    header = f"{'mode':<10} {'peers':>5} {'rtt ms':>6} {'Mbit/s':>7} {'step s':>8} {'bound s':>8} {'/bound':>7}"
    header += f" {'rt waited':>9} {'commit s':>8} {'requests':>8} {'MB/step':>8}"
    print(header)
    for run in runs:
        zero = base[(run.mode, run.peers)].median
        rounds = unavoidable_round_trips(run.peers, copies)
        busiest = max(max(per_peer.values(), default=0) for per_peer in run.peer_bytes)
        transfer = busiest / (run.mbit * 1e6 / 8) if run.mbit else 0.0
        bound = max(zero, transfer) + rounds * run.rtt_ms / 1000  # compute and transfer overlap at best
        waited = (run.median - zero) / (run.rtt_ms / 1000) if run.rtt_ms else 0.0
        requests = statistics.median(sum(c.values()) for c in run.calls)
        print(
            f"{run.mode:<10} {run.peers:5d} {run.rtt_ms:6.0f} {run.mbit:7.0f} {run.median:8.3f} {bound:8.3f} "
            f"{run.median / bound:7.2f} {waited:9.1f} {statistics.median(run.commits):8.3f} {requests:8.0f} "
            f"{statistics.median(run.bytes) / 1e6:8.2f}"
        )
    print()
    for (peers, rtt), at in sorted(_by_setting(runs).items()):
        if "loop" in at and "pipelined" in at:
            speedup = at["loop"].median / at["pipelined"].median
            print(f"pipelined vs loop, {peers} peers at {rtt:.0f} ms: {speedup:.2f}x faster")
    slowest = max(args.rtt_ms)
    commits = {r.peers: statistics.median(r.commits) for r in runs if r.rtt_ms == slowest and r.mode == runs[-1].mode}
    if len(commits) > 1:
        low, high = min(commits), max(commits)
        growth = (commits[high] - commits[low]) / (slowest / 1000) if slowest else 0.0
        print(
            f"commit at {slowest:.0f} ms: {commits[low]:.3f} s with {low} peers, {commits[high]:.3f} s with {high} "
            f"peers: grows by {growth:.2f} round trips (goal < 1)"
        )
    last = runs[-1]
    methods: Counter = Counter()
    for calls in last.calls:
        methods.update(calls)
    per_step = ", ".join(f"{m} {n / len(last.calls):.0f}" for m, n in sorted(methods.items()))
    print(f"requests per step ({last.mode}, {last.peers} peers, {last.rtt_ms:.0f} ms): {per_step}")
    print(f"goals at 100 ms: step <= {GOAL_BOUND}x the bound; >= {GOAL_SPEEDUP}x faster than the previous main")


def _by_setting(runs: list[Run]) -> dict[tuple[int, float], dict[str, Run]]:
    settings: dict[tuple[int, float], dict[str, Run]] = {}
    for run in runs:
        if run.mbit or run.rtt_ms:
            settings.setdefault((run.peers, run.rtt_ms), {})[run.mode] = run
    return settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 50.0, 100.0])
    parser.add_argument("--mbit", type=float, default=100.0, help="bandwidth of each link (Mbit/s per direction)")
    parser.add_argument("--peers", type=int, nargs="+", default=[4], help="peer counts to compare")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["loop", "pipelined"], choices=["loop", "pipelined"])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--home", action="store_true", help="the home-link scenario (see --home --help)")
    args = parser.parse_args(argv)
    if not all(1 <= peers <= args.layers for peers in args.peers) or args.steps < 1:
        parser.error("need 1 <= --peers <= --layers and --steps >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--home" in argv:
        return bench_wan_home.main([arg for arg in argv if arg != "--home"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_wan_") as tmp:
        workdir = args.workdir or Path(tmp)
        model_dir = make_tiny_model(
            workdir / "model",
            family="llama",
            layers=args.layers,
            hidden=args.hidden,
            heads=8,
            kv_heads=8,
            intermediate=args.hidden * 11 // 4,
            vocab=args.vocab,
            seed=0,
        )
        runs = []
        for peers in args.peers:
            runs.extend(run_swarm(model_dir, workdir, args, peers, 0.0, 0.0))
            for rtt in args.rtt_ms:
                runs.extend(run_swarm(model_dir, workdir, args, peers, rtt, args.mbit))
        report(args, runs)


if __name__ == "__main__":
    main()
