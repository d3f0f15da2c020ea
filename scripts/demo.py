"""Local swarm demo: a tiny Llama trained with LoRA through peer daemons on 127.0.0.1, losses printed as they fall."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import peft
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import make_tiny_model  # noqa: E402

import swarm  # noqa: E402
from swarm.localswarm import LocalSwarm  # noqa: E402

logger = logging.getLogger("demo")


def synthetic_batches(vocab: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A few fixed sequences, so that a LoRA can learn them and the loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (4, 32), generator=g)
        batches.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)

    model_dir = args.workdir / "tiny-llama"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, family="llama", layers=4, hidden=64, seed=0)
    with LocalSwarm(args.workdir / "logs") as local:
        local.start_dht()
        logger.info("bootstrap node: %s", local.initial_peers[0])
        local.start_peer(model_dir, "0:2", name="peer-0-2")
        local.start_peer(model_dir, "2:4", name="peer-2-4")
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter=f"demo-{int(time.time())}",
            lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
        )
        try:
            optimizer = swarm.RemoteOptimizer(model, lr=3e-3, weight_decay=0.0)
            batches = synthetic_batches(model.spec.config.vocab_size, count=2)
            for step in range(args.steps):
                started = time.perf_counter()
                losses = []
                for batch in batches:  # two micro-batches per step: gradient accumulation
                    out = model(**batch)
                    (out.loss / len(batches)).backward()
                    losses.append(out.loss.item())
                optimizer.step()
                optimizer.zero_grad()
                print(
                    f"step {step + 1:3d}  loss {sum(losses) / len(losses):.4f}  ({time.perf_counter() - started:.2f}s)"
                )
            adapter_dir = model.save_adapter(args.workdir / "adapter")
            print(f"adapter saved to {adapter_dir} (load it with peft.PeftModel.from_pretrained)")
        finally:
            model.shutdown()


if __name__ == "__main__":
    main()
