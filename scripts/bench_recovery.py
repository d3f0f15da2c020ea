"""What redundancy costs and what it buys: per-step checkpoints, standby copies and durable acks vs none, and a
takeover.

Part 1, side by side in one run: three loopback swarms of two peers (blocks split in halves) train the same
recipe, alternating rounds of steps so that machine noise hits all alike. The "plain" swarm keeps no standby
copies and writes no checkpoints (``--standby-blocks 0``, client ``min_copies=1``); the "async" one checkpoints
every step and keeps standby copies of the other half, refreshed in the background after every commit
(``min_copies=1``); the "durable" one is the same with the default ``min_copies=2``: ``opt.step()`` returns only
once the other peer holds a copy of every block's new state. Printed: median step time of each, and the ratios.

Part 2: a swarm of three peers (two replicas of the first half, one server of the second) trains with the
defaults; the second half's only server is SIGKILLed right after a step returns. Printed: seconds from the kill
to the next committed step (the takeover: detection, a replica of the first half loading the blocks and taking
their state from the copy it was asked to hold, the client re-routing), and the steps lost.

Usage::

    python scripts/bench_recovery.py [--hidden 512] [--layers 8] [--batch 4] [--seq 128] [--rounds 5]
        [--steps-per-round 4] [--balance-interval 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
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

import swarm  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402
from swarm.testing.tiny import make_bench_model  # noqa: E402

logger = logging.getLogger("bench_recovery")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def connect(local: LocalSwarm, model_dir: Path, adapter: str, min_copies: int = 2) -> swarm.SwarmModelForCausalLM:
    return swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter=adapter,
        lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
        patience=300,
        min_copies=min_copies,
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


def overhead(args, model_dir: Path, workdir: Path) -> dict[str, float]:
    """Median step time of the three swarms, trained in alternating rounds."""
    half = args.layers // 2
    spans = {"p1": f"0:{half}", "p2": f"{half}:{args.layers}"}
    base = ["--balance-interval", str(args.balance_interval)]
    setups = {  # name: (peer flags, client min_copies)
        "plain": ([*base, "--standby-blocks", "0"], 1),
        "async": ([*base, "--checkpoint-dir", str(workdir / "ckpt-async")], 1),
        "durable": ([*base, "--checkpoint-dir", str(workdir / "ckpt-durable")], 2),
    }
    with contextlib.ExitStack() as stack:
        trainers = {}
        for name, (flags, min_copies) in setups.items():
            local = stack.enter_context(LocalSwarm(workdir / name))
            local.start_dht()
            local.start_peers(model_dir, spans, flags)
            model = connect(local, model_dir, f"bench-{name}", min_copies)
            stack.callback(model.shutdown)
            trainers[name] = Trainer(model, args.batch, args.seq)
        for trainer in trainers.values():
            trainer.steps(2)  # warm-up; lets the peers pick their standby blocks
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for name, trainer in trainers.items():
                times[name] += trainer.steps(args.steps_per_round)
    return {name: statistics.median(values) for name, values in times.items()}


def takeover(args, model_dir: Path, workdir: Path) -> tuple[float, int, float]:
    half = args.layers // 2
    spans = {"a1": f"0:{half}", "a2": f"0:{half}", "c": f"{half}:{args.layers}"}
    with LocalSwarm(workdir / "takeover") as local:
        local.start_dht()
        peers = local.start_peers(model_dir, spans, ["--balance-interval", str(args.balance_interval)])
        trainer = Trainer(connect(local, model_dir, "bench-takeover"), args.batch, args.seq)
        try:
            median = statistics.median(trainer.steps(4))
            killed = time.perf_counter()  # right after a step returned: its only copy besides c is the durable one
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
    medians = overhead(args, model_dir, workdir)
    seconds, lost, median = takeover(args, model_dir, workdir)
    print(
        f"config: hidden={args.hidden} layers={args.layers} batch=2x{args.batch}x{args.seq}, fp32, LoRA r=8 "
        f"all-linear, 2 peers x {args.layers // 2} blocks, {args.rounds} rounds x {args.steps_per_round} steps"
    )
    print(f"median step, no standby, no checkpoints                      {medians['plain']:.3f} s")
    print(f"median step, async standby + checkpoints, min_copies=1        {medians['async']:.3f} s")
    print(f"median step, durable acks (min_copies=2) + checkpoints         {medians['durable']:.3f} s")
    print(f"async standby + checkpoints vs plain:  ratio {medians['async'] / medians['plain']:.3f}  (goal <= 1.03)")
    print(f"min_copies=2 vs min_copies=1:          ratio {medians['durable'] / medians['async']:.3f}  (goal <= 1.05)")
    print(
        f"takeover: kill of the only server of blocks {args.layers // 2}:{args.layers} -> next committed step "
        f"{seconds:.2f} s (a step takes {median:.2f} s; balance interval {args.balance_interval:.0f} s), "
        f"steps lost: {lost}"
    )


if __name__ == "__main__":
    main()
