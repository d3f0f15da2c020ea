"""Benchmark a training step through a peer behind NAT (served through the bootstrap's relay) against the same
peer served directly, side by side in one run, on a namespaced network (swarm/netlab.py).

The lab: the bootstrap and one peer on a public host, the other half of the model on a second public host (direct)
or on a home host behind a NAT router (relayed), and the client on a host of its own; every uplink capped at
``--mbit`` with tbf. The client runs in its own namespace and reports its step times. Needs root, ip and nft.

Usage::

    sudo python scripts/bench_nat.py [--hidden 256] [--layers 4] [--batch 4] [--seq 64] [--micro-batches 2]
        [--steps 10] [--warmup 2] [--mbit 100] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):  # swarm, and bench_step.py's recipe (one recipe for every step bench)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_step  # noqa: E402

from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.netlab import NetLab, unavailable  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_nat")


def client(args: argparse.Namespace) -> None:
    """Inside the client's namespace: train, print the step times as one JSON line."""
    import swarm

    model = swarm.SwarmModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, adapter="bench-nat", lora_config=bench_step.lora_config(), seed=0
    )
    batches = bench_step.make_batches(args.vocab, args.batch, args.seq, args.micro_batches)
    optimizer = swarm.RemoteOptimizer(model, **bench_step.HPARAMS)
    stats = bench_step.train("swarm", model, optimizer, batches, args.steps, args.warmup)
    model.shutdown()
    print(json.dumps({"times": stats.times}), flush=True)


def run(lab: NetLab, model: Path, args: argparse.Namespace, relayed: bool, workdir: Path) -> list[float]:
    """One swarm in the lab: the second half of the model on the home host (relayed) or a public one."""
    public, second = lab.hosts["public"], lab.hosts["home" if relayed else "public2"]
    outside = lab.hosts["client"]
    half = args.layers // 2
    with LocalSwarm(workdir / ("relayed" if relayed else "direct")) as local:
        local.start_dht(host=public.ip, prefix=public.command())
        local.start_peer(model, f"0:{half}", name="first", host="0.0.0.0", prefix=public.command(), wait=False)
        local.start_peer(model, f"{half}:{args.layers}", name="second", host="0.0.0.0", prefix=second.command())
        local.processes[-2].wait_for_line("serving blocks", 120)
        command = outside.command(sys.executable, __file__, "--client", "--model", str(model), "--initial-peers")
        command += [*local.initial_peers, *_shape_args(args)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"the client failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])["times"]


def _shape_args(args: argparse.Namespace) -> list[str]:
    names = ("vocab", "batch", "seq", "micro_batches", "steps", "warmup")
    return [x for name in names for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the measured ones")
    parser.add_argument("--mbit", type=float, default=100.0, help="uplink cap of every host (0: none)")
    parser.add_argument("--workdir", type=Path, default=None, help="model and logs (default: a temp dir)")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.client:
        return client(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    why_not = unavailable()
    if why_not:
        sys.exit(f"bench_nat: cannot build the lab here: {why_not}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_nat-"))
    heads = max(1, args.hidden // 64)
    model = make_tiny_model(
        workdir / "model",
        layers=args.layers,
        hidden=args.hidden,
        heads=heads,
        kv_heads=heads,
        intermediate=args.hidden * 11 // 4,
        vocab=args.vocab,
    )
    started = time.monotonic()
    with NetLab() as lab:
        for name in ("public", "public2", "client"):
            lab.public(name)
        lab.home("home")
        if args.mbit:
            for host in list(lab.hosts.values()):
                if not host.name.endswith("-router"):
                    lab.cap(host, args.mbit)
        direct = run(lab, model, args, relayed=False, workdir=workdir)
        relayed = run(lab, model, args, relayed=True, workdir=workdir)
    report(args, direct, relayed, time.monotonic() - started)


def report(args: argparse.Namespace, direct: list[float], relayed: list[float], took: float) -> None:
    cap = f"{args.mbit:g} Mbit/s uplinks" if args.mbit else "no bandwidth cap"
    print(
        f"\nbench_nat: hidden {args.hidden}, {args.layers} blocks split over 2 peers, {args.micro_batches} "
        f"micro-batch(es) of {args.batch}x{args.seq}, {cap}; median of {args.steps} steps after {args.warmup} "
        f"warm-up ({took:.0f} s in all)"
    )
    print(f"{'second peer':<34} {'step s (median)':>16} {'best':>8}")
    for name, times in (("public, dialed directly", direct), ("behind NAT, through the relay", relayed)):
        print(f"{name:<34} {statistics.median(times):>16.3f} {min(times):>8.3f}")
    print(f"relayed / direct: {statistics.median(relayed) / statistics.median(direct):.2f}x")


if __name__ == "__main__":
    main()
