"""Promise 1 on a given device: the parity recipe (swarm.testing.parity: LoRA on every projection, AdamW with weight
decay, padded batches, 5 steps of 2 micro-batches) trained through two in-process peers and, from the same initial
adapter, locally with transformers + peft, both on ``--device``; reports how far the losses and the adapters are
apart. tests/integration/test_parity.py holds the same comparison on CPU; this runs it where the peers' kernels are
CUDA's (scripts/bench_gpu.py calls it).

Usage::

    python scripts/bench_gpu_parity.py [--device cpu|cuda|cuda:N] [--workdir DIR] [--json PATH]
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
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402
from swarm.testing.inprocess import InProcessSwarm  # noqa: E402
from swarm.testing.parity import HPARAMS, LORA, STEPS, local_peft, make_batches, train  # noqa: E402
from swarm.testing.tiny import make_tiny_model  # noqa: E402

logger = logging.getLogger("bench_gpu_parity")
# test_parity's tolerances: losses within 1e-5, adapters within rtol 1e-4 / atol 1e-5 (fp32 on both sides)
LOSS_TOL = 1e-5
ADAPTER_RTOL, ADAPTER_ATOL = 1e-4, 1e-5


def on(device: str, batches: list[list[dict[str, torch.Tensor]]]) -> list[list[dict[str, torch.Tensor]]]:
    """The same batches with every tensor on ``device`` (the local reference takes them as they are)."""
    return [[{key: value.to(device) for key, value in batch.items()} for batch in micro] for micro in batches]


def run(device: str, workdir: Path) -> dict:
    """Train both ways and compare; returns the summary row (figures and whether both are within tolerance)."""
    model_dir = make_tiny_model(workdir / "tiny-llama", family="llama", layers=4, seed=1)
    started = time.perf_counter()
    # quant "none": a peer on CUDA would otherwise default to nf4, and parity is about exact fp32 arithmetic
    with InProcessSwarm(model_dir, workdir / "swarm", device=device, quant="none") as local:
        local.start_peers({"a": "0:2", "b": "2:4"})
        model = swarm.SwarmModelForCausalLM.from_pretrained(
            model_dir,
            initial_peers=local.initial_peers,
            adapter="parity",
            lora_config=peft.LoraConfig(**LORA),
            dtype=torch.float32,
            device=device,
            seed=7,
        )
        try:
            model.save_adapter(workdir / "initial")
            batches = make_batches(model.spec.config.vocab_size)
            swarm_losses = train(model, swarm.RemoteOptimizer(model, **HPARAMS), batches)
            model.save_adapter(workdir / "final")
            steps = model.step
        finally:
            model.shutdown()
    swarm_s = time.perf_counter() - started
    reference = local_peft(model_dir, workdir / "initial").to(device)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    local_losses = train(reference, torch.optim.AdamW(trainable, **HPARAMS), on(device, batches))
    reference.save_pretrained(workdir / "local")

    swarm_state = load_file(workdir / "final" / "adapter_model.safetensors")
    local_state = load_file(workdir / "local" / "adapter_model.safetensors")
    loss_diff = max(abs(a - b) for a, b in zip(swarm_losses, local_losses, strict=True))
    adapter_diff = max((swarm_state[k] - local_state[k]).abs().max().item() for k in local_state)
    within = swarm_state.keys() == local_state.keys() and all(
        torch.allclose(swarm_state[k], local_state[k], rtol=ADAPTER_RTOL, atol=ADAPTER_ATOL) for k in local_state
    )
    ok = steps == STEPS and loss_diff <= LOSS_TOL and within and swarm_losses[-1] < swarm_losses[0]
    figures = {
        "steps": steps,
        "max |loss diff|": loss_diff,
        "max |adapter diff|": adapter_diff,
        "loss first": swarm_losses[0],
        "loss last": swarm_losses[-1],
        "swarm s": swarm_s,
    }
    logger.info("parity on %s: %s (ok: %s)", device, figures, ok)
    error = None if ok else f"outside tolerance (losses {LOSS_TOL}, adapter rtol {ADAPTER_RTOL} atol {ADAPTER_ATOL})"
    return dict(mode="fp32", ok=ok, figures=figures, error=error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: peers, client and reference")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--json", type=Path, default=None, help="write the summary row here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-parity-"))
    row = run(args.device, workdir)
    if args.json:
        args.json.write_text(json.dumps([row], indent=1))


if __name__ == "__main__":
    main()
