"""Promise 13 on a CUDA machine: a CPU replica and a CUDA replica of the same blocks (both fp32 weights, no
quantization) train 20 steps side by side through two in-process peers, and after every step their state digests
(LoRA tensors, AdamW moments, step) must be equal to the bit, with nobody named dishonest: the exact update
(peers/update.py) computes the same bits on both devices from the same gradient bits. With ``--devices cpu cpu``
(scripts/bench_gpu.py --cpu) it checks only that the part runs.

Usage::

    python scripts/bench_gpu_mixed.py [--devices cpu cuda] [--steps 20] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
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


def run(devices: list[str], steps: int, workdir: Path) -> dict:
    model_dir = make_tiny_model(workdir / "tiny-llama", family="llama", layers=4, seed=1)
    started = time.perf_counter()
    identical_steps, differing = 0, []
    with InProcessSwarm(model_dir, workdir / "swarm", quant="none") as local:
        for index, device in enumerate(devices):
            local.add_peer("0:4", f"replica-{index}", wait=False, device=device)
        for peer in local.peers.values():
            peer.wait_serving(120)
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir, initial_peers=local.initial_peers, adapter="mixed", lora_config=peft.LoraConfig(**LORA), seed=3
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
                    len(by_peer) == len(devices) and len(set(by_peer.values())) == 1 for by_peer in digests.values()
                )
                identical_steps += same
                if not same:
                    differing.append(model.step)
            dishonest = len(model.dishonest)
        finally:
            model.shutdown()
    ok = identical_steps == steps and dishonest == 0
    figures = {
        "devices": "+".join(devices),
        "steps": steps,
        "steps identical": identical_steps,
        "dishonest": dishonest,
        "s": time.perf_counter() - started,
    }
    logger.info("mixed replicas %s: %s (ok: %s)", devices, figures, ok)
    error = None if ok else f"replicas differ after steps {differing[:5]}, {dishonest} named dishonest"
    return dict(mode="+".join(devices), ok=ok, figures=figures, error=error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs=2, default=["cpu", "cuda"], help="the two replicas' devices")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--json", type=Path, default=None, help="write the summary row here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if any(d.startswith("cuda") for d in args.devices) and not torch.cuda.is_available():
        parser.error(f"--devices {' '.join(args.devices)}: torch {torch.__version__} sees no CUDA device")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-mixed-"))
    row = run(args.devices, args.steps, workdir)
    if args.json:
        args.json.write_text(json.dumps([row], indent=1))


if __name__ == "__main__":
    main()
