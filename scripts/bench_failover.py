"""What a SIGKILLed replica costs: median step time vs the time of the step during which a replica died.

A loopback swarm with two replicas of each half of the model trains; during step ``--kill-step`` a replica is
SIGKILLed (its whole process group) part-way into the step. Printed side by side from one run: the median of
the other steps, the step with the kill, the extra seconds and the ratio, and the recoveries the client logged.

Usage::

    python scripts/bench_failover.py [--hidden 256] [--layers 4] [--batch 4] [--seq 64] [--steps 12]
        [--kill-step 6] [--kill-after 0.3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import tempfile
import threading
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

logger = logging.getLogger("bench_failover")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--kill-after", type=float, default=0.3, help="fraction of a median step before the kill")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-failover-"))
    half = args.layers // 2
    model_dir = make_bench_model(workdir / "model", args.layers, args.hidden)
    with LocalSwarm(workdir / "logs") as local:
        local.start_dht()
        spans = {"a1": f"0:{half}", "a2": f"0:{half}", "b1": f"{half}:{args.layers}", "b2": f"{half}:{args.layers}"}
        peers = {name: local.start_peer(model_dir, blocks, name=name, wait=False) for name, blocks in spans.items()}
        for peer in peers.values():
            peer.wait_for_line("serving blocks", 300)
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter="bench-failover",
            lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, lr=1e-4)
            g = torch.Generator().manual_seed(0)
            batches = [torch.randint(0, 1024, (args.batch, args.seq), generator=g) for _ in range(args.micro_batches)]
            times: list[float] = []
            for step in tqdm(range(1, args.steps + 1), desc="steps"):
                if step == args.kill_step:
                    delay = args.kill_after * statistics.median(times[1:] or times)
                    threading.Timer(delay, peers["a1"].signal, args=(signal.SIGKILL,)).start()
                started = time.perf_counter()
                for ids in batches:
                    (model(ids, labels=ids).loss / len(batches)).backward()
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.perf_counter() - started)
            recoveries = list(model.recoveries)
        finally:
            model.shutdown()
    killed = times[args.kill_step - 1]
    others = [t for i, t in enumerate(times) if i not in (0, args.kill_step - 1)]
    median = statistics.median(others)
    print(
        f"config: hidden={args.hidden} layers={args.layers} batch={args.batch}x{args.seq} "
        f"micro-batches={args.micro_batches}, 4 peers (2 replicas x {half} blocks), fp32, LoRA r=8 all-linear"
    )
    print(f"median step (no failure)   {median:.3f} s")
    print(f"step with a SIGKILL        {killed:.3f} s")
    print(f"extra                      {killed - median:+.3f} s   ratio {killed / median:.2f}  (goal: < 2.00)")
    for r in recoveries:
        print(f"recovery: {r.during} at step {r.step + 1}, retry took {r.seconds:.3f} s")


if __name__ == "__main__":
    main()
