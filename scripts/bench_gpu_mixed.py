"""Promise 13 on a CUDA machine, in two runs of in-process peers serving all four blocks of a tiny Llama:
- devices: a CPU replica and a CUDA replica (both fp32 weights, no quantization) train 20 steps side by side, and
  after every step their state digests (LoRA tensors, AdamW moments, step) must be equal to the bit: the exact
  update (peers/update.py) computes the same bits on both devices from the same gradient bits;
- numerics: an NF4 CUDA replica beside a bf16 CUDA one and an fp32 CPU one, every micro-batch spot-checked: nobody
  is banned (swarm/net/numerics.py), and their adapter state is the same bits all the same.
Either run fails if a replica is named dishonest. With ``--cpu`` (scripts/bench_gpu.py --cpu) both run on the CPU,
with fewer steps: it checks only that the part runs.

Usage::

    python scripts/bench_gpu_mixed.py [--cpu] [--device cuda] [--steps 20] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import peft
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.testing.inprocess import InProcessSwarm  # noqa: E402
from swarm.testing.recipe import HPARAMS, LORA, MAX_GRAD_NORM, MICRO_BATCHES, batches_for_step  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_gpu_mixed")


@dataclass(frozen=True)
class Replica:
    device: str
    quant: str = "none"
    dtype: str = "float32"


def run(mode: str, replicas: list[Replica], steps: int, spot_check: float | None, workdir: Path) -> dict:
    model_dir = make_tiny_model(workdir / "tiny-llama", family="llama", layers=4, seed=1)
    started = time.perf_counter()
    identical_steps, differing = 0, []
    with InProcessSwarm(model_dir, workdir / mode.replace("+", "-")) as local:
        for index, replica in enumerate(replicas):
            local.add_peer(
                "0:4", f"replica-{index}", wait=False, device=replica.device, quant=replica.quant, dtype=replica.dtype
            )
        for peer in local.peers.values():
            peer.wait_serving(120)
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter=mode.replace("+", "-"),
            lora_config=peft.LoraConfig(**LORA),
            seed=3,
            spot_check=spot_check,
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
            while model.step < steps:
                for batch in batches_for_step(model.step):
                    (model(**batch).loss / MICRO_BATCHES).backward()
                model.clip_grad_norm_(MAX_GRAD_NORM)
                optimizer.step()
                optimizer.zero_grad()
                digests = model.replica_digests()
                same = all(
                    len(by_peer) == len(replicas) and len(set(by_peer.values())) == 1 for by_peer in digests.values()
                )
                identical_steps += same
                if not same:
                    differing.append(model.step)
            dishonest = len(model.dishonest)
        finally:
            model.shutdown()
    ok = identical_steps == steps and dishonest == 0
    figures = {
        "replicas": " ".join(f"{r.device}:{r.quant}:{r.dtype}" for r in replicas),
        "spot check": spot_check or 0.0,
        "steps": steps,
        "steps identical": identical_steps,
        "dishonest": dishonest,
        "s": time.perf_counter() - started,
    }
    logger.info("mixed replicas %s: %s (ok: %s)", mode, figures, ok)
    error = None if ok else f"replicas differ after steps {differing[:5]}, {dishonest} named dishonest"
    return dict(mode=mode, ok=ok, figures=figures, error=error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="every replica on the CPU, fewer steps")
    parser.add_argument("--device", default="cuda", help="the CUDA device of the CUDA replicas")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--json", type=Path, default=None, help="write the summary rows here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if not args.cpu and not torch.cuda.is_available():
        parser.error(f"torch {torch.__version__} sees no CUDA device (--cpu runs both runs on the CPU)")
    gpu = "cpu" if args.cpu else args.device
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-mixed-"))
    runs = {
        f"cpu+{'cpu' if args.cpu else 'cuda'}": ([Replica("cpu"), Replica(gpu)], None),
        "nf4+bf16+fp32": ([Replica(gpu, "nf4", "bfloat16"), Replica(gpu, "none", "bfloat16"), Replica("cpu")], 1.0),
    }
    rows = [run(mode, replicas, args.steps, spot, workdir) for mode, (replicas, spot) in runs.items()]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
