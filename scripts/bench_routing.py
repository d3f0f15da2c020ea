"""Routes chosen for throughput, measured on a real local swarm: peers of different speeds, replicas added one by one.

Each peer runs in a cgroup of its own with a CPU quota (``swarm.testing.cpuquota``; root needed), so speeds really
differ and each replica added brings compute of its own. For 1, 2, ... replicas of each of two spans (replica ``k`` of
every span gets the ``k``-th of ``--quotas``, fastest first), a fresh swarm on 127.0.0.1 trains the same steps twice,
each time with a fresh adapter: once routed by the client's router (the fastest chain for each micro-batch, given the
work already routed: micro-batches in flight spread over replicas in proportion to speed), once by the router this
project had before it (fewest hops; among the servers reaching farthest, one at random weighted by announced
throughput), re-implemented here as the baseline. A step is ``model.train_step`` over ``--micro-batches``
micro-batches, ``--in-flight`` at once (default: as many as the client chooses, two per server), then
``optimizer.step()``. Printed: the median step time of each, the share of the blocks each peer computed, and the
speed-up over one replica.

Usage::

    python scripts/bench_routing.py [--quotas 0.5 0.25 0.12] [--layers 4] [--hidden 256] [--batch 2] [--seq 128]
        [--micro-batches 8] [--in-flight N] [--steps 6] [--warmup 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
from hivemind.p2p import PeerID

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.client.routing import Hop, NoRouteError, Router  # noqa: E402
from swarm.testing.cpuquota import CpuQuotas  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_routing")
POLICIES = ("fastest chain", "fewest hops (before)")


@dataclass
class Run:
    """One policy on one swarm: its step times and how many blocks of micro-batches each peer computed."""

    times: list[float] = field(default_factory=list)
    passes: list[float] = field(default_factory=list)  # of each step, the forward and backward of its micro-batches
    blocks: Counter = field(default_factory=Counter)
    in_flight: int = 0  # micro-batches in flight, as given or as the client chose


def fewest_hops(router: Router, start: int = 0, end: int | None = None, prefer=None) -> list[Hop]:
    """The router before issue 26: at each hop the servers reaching farthest, one of them at random weighted by its
    announced throughput (``prefer`` if it is among them)."""
    end = router.num_blocks if end is None else end
    hops, block = [], start
    while block < end:
        candidates = router.replicas(block)
        if not candidates:
            raise NoRouteError(f"no live server for blocks {router.uncovered(start, end)}")
        reach = max(min(r.end, end) for r in candidates)
        farthest = [r for r in candidates if min(r.end, end) == reach]
        preferred = [r for r in farthest if r.peer_id == prefer]
        chosen = (
            preferred[0]
            if preferred
            else router.random.choices(farthest, weights=[max(r.throughput, 1e-3) for r in farthest])[0]
        )
        hops.append(Hop(chosen.peer_id, block, reach))
        block = reach
    return hops


def count_blocks(router: Router, route, run: Run):
    """Wrap a route function so that every hop it gives is counted against its peer."""

    def counted(*args, **kwargs) -> list[Hop]:
        hops = route(*args, **kwargs)
        for hop in hops:
            run.blocks[hop.peer_id] += len(hop.blocks)
        return hops

    return counted


def micro_batches(args: argparse.Namespace, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.micro_batches):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def train(model_dir: Path, swarm_: LocalSwarm, policy: str, adapter: str, args: argparse.Namespace) -> Run:
    run = Run()
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=swarm_.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        spot_check=0.0,
    )
    try:
        router = model.session.router
        route = router.route if policy == POLICIES[0] else lambda *a, **k: fewest_hops(router, *a, **k)
        router.route = count_blocks(router, route, run)
        optimizer = swarm.RemoteOptimizer(model, lr=1e-4)
        batches = micro_batches(args, model.config.vocab_size)
        for index in range(args.warmup + args.steps):
            if index == args.warmup:
                run.blocks.clear()
            started = time.perf_counter()
            model.train_step(batches, max_in_flight=args.in_flight)
            run.in_flight = args.in_flight or model.in_flight()
            passed = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            if index >= args.warmup:
                run.times.append(time.perf_counter() - started)
                run.passes.append(passed - started)
        logger.info("%s, %s: step times %s", adapter, policy, " ".join(f"{t:.2f}" for t in run.times))
    finally:
        model.shutdown()
    return run


def measure(model_dir: Path, replicas: int, args: argparse.Namespace, workdir: Path) -> tuple[dict, dict]:
    """A fresh swarm with ``replicas`` peers on each of two spans; both policies trained through it."""
    half = args.layers // 2
    names = {}
    with CpuQuotas(f"swarm-bench-routing-{replicas}") as quotas, LocalSwarm(workdir) as local:
        local.start_dht()
        peers = {}
        for k in range(replicas):
            for span in (f"0:{half}", f"{half}:{args.layers}"):
                name = f"peer-{span.replace(':', '-')}-q{args.quotas[k]:g}"
                peers[name] = local.start_peer(
                    model_dir, span, name=name, wait=False, launcher=quotas.launcher(args.quotas[k])
                )
        for name, process in peers.items():
            process.wait_for_line("serving blocks", timeout=300)
            names[process.peer_id] = name
        runs = {
            policy: train(model_dir, local, policy, f"r{replicas}-p{index}", args)
            for index, policy in enumerate(POLICIES)
        }
    return runs, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quotas", type=float, nargs="+", default=[0.4, 0.2, 0.1], help="cores per replica")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument(
        "--in-flight", type=int, default=None, help="micro-batches in flight (default: the client's choice)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-routing-"))
    model_dir = make_tiny_model(
        workdir / "model", layers=args.layers, hidden=args.hidden, intermediate=int(2.75 * args.hidden), seed=1
    )
    results = {}
    for replicas in range(1, len(args.quotas) + 1):
        logger.info("%d replica(s) of each span, quotas %s (logs in %s)", replicas, args.quotas[:replicas], workdir)
        results[replicas] = measure(model_dir, replicas, args, workdir / f"r{replicas}")
    print(
        f"config: 2 spans of a {args.layers}-block Llama (hidden {args.hidden}), {args.micro_batches} micro-batches "
        f"of {args.batch}x{args.seq} tokens per step, {args.in_flight or 'the client chooses how many'} in flight; "
        "replica k of each span limited to "
        f"{', '.join(f'{q:g}' for q in args.quotas)} core(s); median of {args.steps} steps after {args.warmup}"
    )
    base = {policy: statistics.median(results[1][0][policy].times) for policy in POLICIES}
    print(
        "| replicas per span | in flight | "
        + " | ".join(f"{p}: step (s), of it forward and backward (s), speed-up" for p in POLICIES)
        + f" | blocks per peer, {POLICIES[0]} / {POLICIES[1]} |"
    )
    print("|---:|---:|" + "---:|" * len(POLICIES) + "---|")
    for replicas, (runs, names) in results.items():
        cells = []
        for policy in POLICIES:
            median = statistics.median(runs[policy].times)
            passes = statistics.median(runs[policy].passes)
            cells.append(f"{median:.2f}, {passes:.2f}, {base[policy] / median:.2f}x")
        shares = []
        for peer, name in sorted(names.items(), key=lambda item: item[1]):
            counts = [runs[p].blocks[PeerID.from_base58(peer)] for p in POLICIES]
            totals = [sum(runs[p].blocks.values()) or 1 for p in POLICIES]
            shares.append(f"{name}: {counts[0] / totals[0]:.0%} / {counts[1] / totals[1]:.0%}")
        print(f"| {replicas} | {runs[POLICIES[0]].in_flight} | " + " | ".join(cells) + " | " + "; ".join(shares) + " |")


if __name__ == "__main__":
    main()
