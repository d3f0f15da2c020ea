"""What redundancy costs and what it buys: per-step checkpoints + standby refresh vs none, and a takeover.

Part 1, side by side in one run: two loopback swarms of two peers (blocks split in halves) train the same
recipe, alternating rounds of steps so that machine noise hits both alike. The "plain" swarm keeps no standby
copies and writes no checkpoints (``--standby-blocks 0``); the "redundant" one checkpoints every step and keeps
standby copies of the other half, refreshed at every commit. Printed: median step time of each, and the ratio.

Part 2: a swarm of three peers (two replicas of the first half, one server of the second) trains; the second
half's only server is SIGKILLed between steps. Printed: seconds from the kill to the next committed step (the
takeover: detection, a replica of the first half loading the blocks and taking their state from its standby
copy, the client re-routing), and the steps lost (0 when the standby copy was current).

Usage::

    python scripts/bench_recovery.py [--hidden 512] [--layers 8] [--batch 4] [--seq 128] [--rounds 5]
        [--steps-per-round 4] [--balance-interval 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import peft
import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import make_bench_model  # noqa: E402

import swarm  # noqa: E402
from swarm.localswarm import LocalSwarm  # noqa: E402

logger = logging.getLogger("bench_recovery")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def connect(local: LocalSwarm, model_dir: Path, adapter: str) -> swarm.SwarmModelForCausalLM:
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
        patience=300,
    )


class Trainer:
    """One client and its data; ``steps(n)`` returns the seconds each of n optimizer steps took."""

    def __init__(self, model: swarm.SwarmModelForCausalLM, batch: int, seq: int):
        self.model, self.optimizer = model, swarm.RemoteOptimizer(model, lr=1e-4)
        g = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, 1024, (batch, seq), generator=g) for _ in range(2)]

    def steps(self, count: int) -> list[float]:
        times = []
        for _ in range(count):
            started = time.perf_counter()
            for ids in self.batches:
                (self.model(ids, labels=ids).loss / len(self.batches)).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            times.append(time.perf_counter() - started)
        return times


def overhead(args, model_dir: Path, workdir: Path) -> tuple[float, float]:
    half = args.layers // 2
    spans = {"p1": f"0:{half}", "p2": f"{half}:{args.layers}"}
    base = ["--balance-interval", str(args.balance_interval)]
    with LocalSwarm(workdir / "plain") as plain_swarm, LocalSwarm(workdir / "redundant") as redundant_swarm:
        plain_swarm.start_dht()
        plain_swarm.start_peers(model_dir, spans, [*base, "--standby-blocks", "0"])
        redundant_swarm.start_dht()
        redundant_swarm.start_peers(model_dir, spans, [*base, "--checkpoint-dir", str(workdir / "ckpt")])
        plain = Trainer(connect(plain_swarm, model_dir, "bench-plain"), args.batch, args.seq)
        redundant = Trainer(connect(redundant_swarm, model_dir, "bench-redundant"), args.batch, args.seq)
        try:
            plain.steps(2)  # warm-up; lets the redundant swarm's peers pick their standby blocks
            redundant.steps(2)
            times = {"plain": [], "redundant": []}
            for _ in tqdm(range(args.rounds), desc="rounds"):
                times["plain"] += plain.steps(args.steps_per_round)
                times["redundant"] += redundant.steps(args.steps_per_round)
        finally:
            plain.model.shutdown()
            redundant.model.shutdown()
    return statistics.median(times["plain"]), statistics.median(times["redundant"])


def takeover(args, model_dir: Path, workdir: Path) -> tuple[float, int, float]:
    half = args.layers // 2
    spans = {"a1": f"0:{half}", "a2": f"0:{half}", "c": f"{half}:{args.layers}"}
    with LocalSwarm(workdir / "takeover") as local:
        local.start_dht()
        peers = local.start_peers(model_dir, spans, ["--balance-interval", str(args.balance_interval)])
        trainer = Trainer(connect(local, model_dir, "bench-takeover"), args.batch, args.seq)
        try:
            median = statistics.median(trainer.steps(4))
            time.sleep(2 * args.balance_interval)  # standby copies in place and current
            killed = time.perf_counter()
            peers["c"].signal(signal.SIGKILL)
            trainer.steps(1)
            seconds = time.perf_counter() - killed
            lost = sum(event.steps for event in trainer.model.steps_lost)
        finally:
            trainer.model.shutdown()
    return seconds, lost, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--balance-interval", type=float, default=5.0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    model_dir = make_bench_model(workdir / "model", args.layers, args.hidden)
    plain, redundant = overhead(args, model_dir, workdir)
    seconds, lost, median = takeover(args, model_dir, workdir)
    print(
        f"config: hidden={args.hidden} layers={args.layers} batch=2x{args.batch}x{args.seq}, fp32, LoRA r=8 "
        f"all-linear, 2 peers x {args.layers // 2} blocks, {args.rounds} rounds x {args.steps_per_round} steps"
    )
    print(f"median step, no standby, no checkpoints      {plain:.3f} s")
    print(f"median step, standby + checkpoint every step {redundant:.3f} s")
    print(f"overhead ratio {redundant / plain:.3f}  (goal <= 1.03)")
    print(
        f"takeover: kill of the only server of blocks {args.layers // 2}:{args.layers} -> next committed step "
        f"{seconds:.2f} s (a step takes {median:.2f} s; balance interval {args.balance_interval:.0f} s), "
        f"steps lost: {lost}"
    )


if __name__ == "__main__":
    main()
